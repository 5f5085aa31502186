"""Kernel and library tests run on the CPU: Triton kernels through the Triton interpreter.

vLLM disables Triton unless exactly one active driver exists, and for its CPU wheel it also wants a "cpu" backend
entry. A placeholder backend whose driver is never active satisfies both checks, so vLLM keeps the real Triton and
its kernels run under TRITON_INTERPRET=1. This must happen before anything imports vLLM, and must stay out of
engine processes (tests/engine runs in its own pytest process).
"""

import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import triton.backends as _triton_backends  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402

from vllm_ddtree import LOGGER_NAME  # noqa: E402


class _InactiveCPUDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False

    def get_current_target(self):  # pragma: no cover - never active
        raise RuntimeError("placeholder driver")

    def get_active_torch_device(self):  # pragma: no cover
        raise RuntimeError("placeholder driver")

    def get_benchmarker(self):  # pragma: no cover
        raise RuntimeError("placeholder driver")


_triton_backends.backends.setdefault("cpu", _triton_backends.Backend(compiler=None, driver=_InactiveCPUDriver))


@pytest.fixture
def ddtree_log(caplog, monkeypatch):
    """caplog that sees ddtree's records: they go to vLLM's logger (``vllm_ddtree.LOGGER_NAME``), which vLLM's
    logging configuration keeps from the root logger, where caplog listens."""
    monkeypatch.setattr(logging.getLogger(LOGGER_NAME).parent, "propagate", True)
    return caplog
