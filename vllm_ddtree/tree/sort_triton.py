"""The PyTorch beam's sorts in one Triton launch each: ``torch.sort(scores, descending=True, stable=True)``, cut to
the first ``keep`` columns.

Why: at B=64 the PyTorch beam sorts about 280 candidates per depth and about 960 members in the merge, and torch
runs each such row through ``radixSortKVInPlace`` (its path for rows of 129..4096): 252 us per build step at
batch 1 and 273 at batch 8 on an H200 (Qwen3-8B shape, CUDA graphs, 2026-12-02 profile), the largest cost of the
B=64 build after the top-k. Here each row is one program: every score becomes a unique 64-bit key, (score order
reversed) in the high word and the column in the low word, and a bitonic ``tl.sort`` of the keys gives the stable
descending order, ties by column; the values are then read back by column, so they are the input's bits. Whole
B=64 builds went from 509 / 784 us to 261 / 518 at batch 1 / 8 (H200, CUDA graphs, bench_tree_core.py build against
build_torch_sort, 2026-12-02, fourth session).

Scores are float32 without NaN; -0.0 ranks as +0.0 (as in torch, where they compare equal and keep their column
order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sort_desc_kernel(scores_ptr, values_ptr, order_ptr, n_cols, keep, stride_in, stride_out,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    live = cols < n_cols
    scores = tl.load(scores_ptr + row * stride_in + cols, mask=live, other=0.0)
    bits = scores.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> +0.0
    # A signed int32 that orders like the float: negative floats get their magnitude bits flipped.
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    # Descending score = ascending ~ordered; padding columns go after everything (the largest high word).
    high = tl.where(live, ~ordered, 2147483647)
    keys = (high.to(tl.int64) << 32) | cols.to(tl.int64)
    keys = tl.sort(keys, 0)
    order = (keys & 0xFFFFFFFF).to(tl.int32)
    out = cols < keep
    values = tl.load(scores_ptr + row * stride_in + order, mask=out, other=0.0)
    tl.store(values_ptr + row * stride_out + cols, values, mask=out)
    tl.store(order_ptr + row * stride_out + cols, order.to(tl.int64), mask=out)


def sort_desc_triton(scores: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, order) [R, keep] of ``torch.sort(scores [R, M] float32, dim=1, descending=True, stable=True)``."""
    rows, n_cols = scores.shape
    if scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError("sort_desc_triton takes float32 rows with unit column stride")
    keep = min(keep, n_cols)
    values = torch.empty(rows, keep, dtype=scores.dtype, device=scores.device)
    order = torch.empty(rows, keep, dtype=torch.int64, device=scores.device)
    block = triton.next_power_of_2(n_cols)
    _sort_desc_kernel[(rows,)](scores, values, order, n_cols, keep, scores.stride(0), keep, BLOCK=block,
                               num_warps=4 if block <= 512 else 8)
    return values, order
