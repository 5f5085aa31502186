"""Host synchronisations under DDTree's code during engine steps (issue 6: no host sync in the decode loop).

``install(path)`` wraps the model runner's ``execute_model`` and ``sample_tokens`` in a torch function mode that
sees every torch call of the step. A call that makes the host wait for the device on a GPU (reading a value:
``item``, ``tolist``, ``bool(t)``, ...; a data-dependent shape: ``nonzero``, boolean-mask indexing, ...; a copy to
the host: ``cpu``, ``numpy``) is recorded when vllm_ddtree code is on its stack, with the innermost vllm_ddtree
frame and the innermost frame outside torch. The engine runs on the CPU, where nothing waits, but the same calls
would wait on a GPU, so the record says where a GPU step would stall. Calls made by test code (the drafter oracle,
tests/, testkit/) are the test's own. ``.to(device)`` is not recorded: on the CPU engine device copies look alike
both ways.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods / torch functions whose result the host must wait for on a GPU.
SYNC_CALLS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
    "masked_select", "unique", "unique_consecutive", "equal", "allclose", "is_nonzero",
}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = str(ROOT / "vllm_ddtree")
TEST_CODE = (str(ROOT / "tests"), str(ROOT / "testkit"))  # the tests and their kit (the oracle drafter's hook)
_HERE = str(Path(__file__).resolve())


def _bool_mask_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple | list) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _repeat_interleave_without_size(func, args, kwargs) -> bool:
    return getattr(func, "__name__", "") == "repeat_interleave" and kwargs.get("output_size") is None and (
        isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor))


class SyncAudit(TorchFunctionMode):
    def __init__(self, records: list[dict]):
        super().__init__()
        self.records = records

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if (name in SYNC_CALLS or (name in INDEXING and _bool_mask_index(args))
                or _repeat_interleave_without_size(func, args, kwargs)):
            self._record(name)
        return func(*args, **kwargs)

    def _record(self, name: str) -> None:
        frame = sys._getframe(2)
        innermost = None
        while frame is not None:  # from the call outwards, up to the innermost vllm_ddtree frame
            path = frame.f_code.co_filename
            where = f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
            if path.startswith(PACKAGE):
                self.records.append({"call": name, "in": where.replace(str(ROOT) + "/", ""), "innermost": innermost})
                return
            if path.startswith(TEST_CODE) and path != _HERE:
                return  # test code called it (e.g. the drafter oracle), or no vllm_ddtree frame is on the stack
            if innermost is None and "/torch/" not in path and path != _HERE:
                innermost = where
            frame = frame.f_back


def install(out_path: str) -> None:
    """Audit every step of the V1 model runner in this process; the records go to ``out_path`` (JSON, rewritten
    after each step so an engine that dies keeps them)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    records: list[dict] = []

    def audited(method):
        def run(self, *args, **kwargs):
            with SyncAudit(records):
                result = method(self, *args, **kwargs)
            Path(out_path).write_text(json.dumps(records))
            return result

        return run

    classes = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    except ImportError:
        pass
    for cls in classes:
        for name in ("execute_model", "sample_tokens"):
            if name in cls.__dict__:
                setattr(cls, name, audited(cls.__dict__[name]))
