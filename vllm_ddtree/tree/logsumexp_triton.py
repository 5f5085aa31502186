"""The Triton kernel behind ``logsumexp.row_logsumexp`` (one program per row, float32 running max and sum)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_logsumexp_kernel(x_ptr, out_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        # A lane with nothing but -inf so far keeps sum 0: shift by 0 there, never by -inf (-inf - -inf is NaN).
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    live = lane_max > float("-inf")
    total = tl.sum(tl.where(live, lane_sum * tl.exp(lane_max - row_max), 0.0), axis=0)
    tl.store(out_ptr + row, row_max + tl.log(total))


def row_logsumexp_triton(logits: torch.Tensor, block: int) -> torch.Tensor:
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    block = min(block, triton.next_power_of_2(vocab))
    _row_logsumexp_kernel[(flat.shape[0],)](flat, out, vocab, flat.stride(0), BLOCK=block)
    return out.view(logits.shape[:-1])
