"""Deterministic random weights for fixture models: each tensor a function of (seed, name) only, so a model is the
same whatever order its tensors are made in."""

from __future__ import annotations

import zlib


def _param_rng_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_tensor(shape: tuple[int, ...], name: str, seed: int, std: float, dtype):
    """Deterministic N(0, std) tensor (ones for norm weights), independent of creation order."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(_param_rng_seed(seed, name))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)
