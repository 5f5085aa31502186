"""The tensor-parallel agreement check: ranks that walked to different paths must be caught."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree import verify_core


class FakeGroup:
    """A two-rank group whose other rank accepted ``other`` (all_gather concatenates along dim 0)."""

    world_size = 2

    def __init__(self, other: torch.Tensor):
        self.other = other

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return torch.cat([tensor, self.other.flatten().to(tensor.dtype)], dim=dim)


@pytest.fixture()
def accepted() -> torch.Tensor:
    return torch.tensor([[0, 2, 5, -1], [0, -1, -1, -1]], dtype=torch.int32)


def test_agreeing_ranks_pass(monkeypatch, accepted):
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tp_group", lambda: FakeGroup(accepted.clone()))
    verify_core.check_ranks_agree(accepted)


def test_disagreeing_ranks_raise(monkeypatch, accepted):
    other = accepted.clone()
    other[0, 2] = 4  # the other rank accepted node 4 instead of 5 at depth 2
    monkeypatch.setattr("vllm.distributed.parallel_state.get_tp_group", lambda: FakeGroup(other))
    with pytest.raises(RuntimeError, match="different tree paths"):
        verify_core.check_ranks_agree(accepted)
