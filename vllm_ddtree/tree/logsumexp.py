"""Row-wise float32 log-sum-exp of the draft logits in one read: the tree build's per-depth normaliser.

The build needs log-probs only for the top k tokens of each depth, so it ranks the logits themselves (a row's
log-softmax is the row shifted by its log-sum-exp: same order, same ties) and normalises just those k. The
shift must be float32: ``torch.logsumexp`` of bf16 logits rounds it to bf16 (about 0.02 at 10), and
``logits.float()`` first writes a float32 copy of the whole [R, L, V] block (0.6 GB per step at 64 requests x 15
depths x 152k tokens). On CUDA Triton programs read the logits once, keeping a running max and sum
in float32 (each row in pieces, then a merge: logsumexp_triton.py); elsewhere ``torch.logsumexp`` over float32
is the reference.
"""

from __future__ import annotations

import torch

_BLOCK = 1024


def row_logsumexp(logits: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """logits [..., V] (any float dtype, last dim contiguous) -> float32 [...]: log(sum(exp(x))) per row."""
    if not (use_triton if use_triton is not None else logits.is_cuda):
        return torch.logsumexp(logits.float(), dim=-1)
    from vllm_ddtree.tree.logsumexp_triton import row_logsumexp_triton

    return row_logsumexp_triton(logits, _BLOCK)
