"""``build.per_depth_topk`` in two Triton launches: the top k of every depth's logits, normalised and in the
build's rank order (descending value, equal values by token id).

The PyTorch path is ``torch.topk`` (about eight kernels of a radix select), the row log-sum-exp, and
``order_topk``'s two sorts and gathers: 120 us of device time and some twenty launches per decode step at batch 1 on
an H200 (Qwen3-8B's 152k-token vocabulary, 15 depths; profile of 2026-12-02). Here:

1. one program per (row, chunk of ``CHUNK`` tokens) keeps the chunk's float32 max and sum of exponentials (the
   normaliser, as ``logsumexp_triton`` does) and its top k, taken one at a time by a max over int64 keys: the
   value's order-preserving bits above, ``2^32 - 1 - token id`` below, so keys are distinct and the larger key is
   the larger value, or on a tie the lower token id, which is the build's rank order;
2. one program per row merges its chunks: the normaliser, then the top k of the chunks' candidates, keyed again on
   ``logit - logsumexp`` (two logits a rounding apart can normalise to one log-prob, which then ties by id, as in
   ``order_topk``).

The set of k is the k largest logits; where several tokens tie at the k-th value the lowest ids get in (torch.topk
leaves that choice open). Values are float32 ``logit - logsumexp`` as in the PyTorch path, up to the normaliser's
summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.tree.logsumexp_triton import combine_pieces

CHUNK = 4096  # tokens per program of the first launch
_LOW_WORD = tl.constexpr(4294967295)  # 2^32 - 1
_TAKEN = tl.constexpr(-9223372036854775808)  # below every key: a taken or missing entry
_OUTSIDE = tl.constexpr(-9223372036854775807)  # a lane past the vocabulary: below every real key, above _TAKEN


@triton.jit
def _key(value, token):
    """Larger for a larger value; on equal values, larger for the lower token id (-0.0 counts as +0.0)."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (_LOW_WORD - token.to(tl.int64))


@triton.jit
def _value_of(key):
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_topk_kernel(x_ptr, row_stride, vocab, cand_ptr, max_ptr, sum_ptr, num_chunks,
                       K: tl.constexpr, CHUNK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    token = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    inside = token < vocab
    x = tl.load(x_ptr + row * row_stride + token, mask=inside, other=float("-inf")).to(tl.float32)
    # The normaliser's share: (max, sum of exp(x - max)); a chunk of nothing but -inf gives (-inf, 0).
    chunk_max = tl.max(x, axis=0)
    shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)
    tl.store(max_ptr + row * num_chunks + chunk, chunk_max)
    tl.store(sum_ptr + row * num_chunks + chunk, tl.sum(tl.exp(x - shift), axis=0))
    key = tl.where(inside, _key(x, token), _OUTSIDE)
    out = cand_ptr + (row * num_chunks + chunk) * K
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        tl.store(out + j, best)
        key = tl.where(key == best, _TAKEN, key)


@triton.jit
def _merge_topk_kernel(cand_ptr, max_ptr, sum_ptr, values_ptr, ids_ptr, num_chunks,
                       K: tl.constexpr, CHUNKS_PAD: tl.constexpr, CANDS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.arange(0, CHUNKS_PAD)
    has_chunk = chunk < num_chunks
    chunk_max = tl.load(max_ptr + row * num_chunks + chunk, mask=has_chunk, other=float("-inf"))
    chunk_sum = tl.load(sum_ptr + row * num_chunks + chunk, mask=has_chunk, other=0.0)
    lse = combine_pieces(chunk_max, chunk_sum)
    cand = tl.arange(0, CANDS_PAD)
    key = tl.load(cand_ptr + row * num_chunks * K + cand, mask=cand < num_chunks * K, other=_TAKEN)
    # Keyed again on the log-prob itself, so that logits a rounding apart that normalise to one value tie by id.
    token = _LOW_WORD - (key & _LOW_WORD)
    key = tl.where(key > _OUTSIDE, _key(_value_of(key) - lse, token), _TAKEN)
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        tl.store(values_ptr + row * K + j, _value_of(best))
        tl.store(ids_ptr + row * K + j, _LOW_WORD - (best & _LOW_WORD))
        key = tl.where(key == best, _TAKEN, key)


def per_depth_topk_triton(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_logits [..., V] (any float dtype) -> (top_logp [..., k] float32, top_ids [..., k] int64), best first,
    equal values by token id; ``k <= V``."""
    vocab = draft_logits.shape[-1]
    flat = draft_logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, device = flat.shape[0], flat.device
    chunk_size = min(CHUNK, triton.next_power_of_2(vocab))
    num_chunks = triton.cdiv(vocab, chunk_size)
    cands = torch.empty(rows, num_chunks, k, dtype=torch.int64, device=device)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    _chunk_topk_kernel[(rows, num_chunks)](flat, flat.stride(0), vocab, cands, chunk_max, chunk_sum, num_chunks,
                                           K=k, CHUNK_SIZE=chunk_size)
    _merge_topk_kernel[(rows,)](cands, chunk_max, chunk_sum, values, ids, num_chunks, K=k,
                                CHUNKS_PAD=triton.next_power_of_2(num_chunks),
                                CANDS_PAD=triton.next_power_of_2(num_chunks * k))
    shape = draft_logits.shape[:-1] + (k,)
    return values.view(shape), ids.view(shape)
