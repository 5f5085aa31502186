"""Whether the package's Triton kernels or their plain-PyTorch references run on a device.

The kernels run on CUDA and, in the unit tests, under Triton's interpreter (``TRITON_INTERPRET=1``), where the tests
hold each to its reference; the CPU engine runs the references.
"""

from __future__ import annotations

import os

import torch


def triton_kernels_on(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
