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

That work grows with rows x k (k maxima one after another in every chunk). ``per_depth_topk_threshold`` reads
each row once whatever k: the k-th largest of the chunks' best keys is a threshold that at least k keys reach and
that only the k best chunks hold keys above, so only those chunks are read again, their keys at or above it
gathered (typically a few times k per row), and the top k taken from those. Its four launches:

1. per (row, chunk of ``THRESHOLD_CHUNK``): the normaliser's share and the chunk's best key;
2. per row: the log-sum-exp, the threshold (a ``tl.sort`` of the chunks' best keys), a zeroed candidate count;
3. per (row, chunk): nothing where the chunk's best key is below the threshold, else its keys at or above it,
   appended to the row's candidates (an atomic count; order does not matter, keys are distinct);
4. per row: the top k of the candidates by key (a ``tl.sort`` of the buffer), then ordered on ``logit -
   logsumexp`` as above (a second). Should a row hold more candidates than the buffer (many large logits in few
   chunks: a run of related token ids, or equal logits at the top), the program cuts again at the k-th largest key
   the buffer caught (at least k keys of the row reach it) and gathers the row's keys at or above it once more,
   up to ``RECUTS`` times: a round keeps about k / capacity of the candidates where the buffer caught a fair
   sample of them, and drops at least capacity - k + 1 whatever it caught. A round reads only the chunks whose
   best key reaches its cut. Still over, it takes its k from the whole row one maximum at a time: slow, exact.

Real logits overflow the buffer often: a language model's likely tokens cluster in id ranges, so the k-th best
chunk's best key lies deep in the tail and the best chunks hold hundreds of keys above it. SmolLM2-135M's own
next-token logits over a GSM8K prompt (bf16, 49,152 tokens, chunks of 512) put a median 53 / 127 / 358 candidates
above the threshold at k = 16 / 32 / 64, over the buffer (128 / 128 / 256) on 1% / 46% / 86% of rows; on an H100
(2026-12-06, the small pair at B = 64, torch profiler) the select launch took 86-152 us a step against 8 us for
the other three together, each re-cut then reading the whole row in one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.tree.logsumexp_triton import row_logsumexp_of_pieces

CHUNK = 4096  # tokens per program of the first launch
_LOW_WORD = tl.constexpr(4294967295)  # 2^32 - 1
_TAKEN = tl.constexpr(-9223372036854775808)  # below every key: a taken or missing entry
_OUTSIDE = tl.constexpr(-9223372036854775807)  # a lane past the vocabulary: below every real key, above _TAKEN
_ABOVE_ALL = tl.constexpr(9223372036854775807)  # above every key
THRESHOLD_CHUNK = 1024  # tokens per chunk of the threshold top-k: 149 chunks of Qwen3's vocabulary
RECUTS = 4  # re-cuts of an overflowed candidate buffer before the whole-row fallback (module docstring)


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
def _load_chunk(x_ptr, row, row_stride, vocab, chunk, CHUNK_SIZE: tl.constexpr):
    """Chunk ``chunk`` of row ``row``: float32 logits (-inf past the vocabulary), token ids, lanes inside it."""
    token = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    inside = token < vocab
    x = tl.load(x_ptr + row * row_stride + token, mask=inside, other=float("-inf")).to(tl.float32)
    return x, token, inside


@triton.jit
def _store_normaliser_share(x, max_ptr, sum_ptr, at):
    """A chunk's share of its row's log-sum-exp, (max, sum of exp(x - max)), stored at ``at``; a chunk of nothing
    but -inf gives (-inf, 0)."""
    chunk_max = tl.max(x, axis=0)
    shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)
    tl.store(max_ptr + at, chunk_max)
    tl.store(sum_ptr + at, tl.sum(tl.exp(x - shift), axis=0))


@triton.jit
def _chunk_topk_kernel(x_ptr, row_stride, vocab, cand_ptr, max_ptr, sum_ptr, num_chunks,
                       K: tl.constexpr, CHUNK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x, token, inside = _load_chunk(x_ptr, row, row_stride, vocab, chunk, CHUNK_SIZE)
    _store_normaliser_share(x, max_ptr, sum_ptr, row * num_chunks + chunk)
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
    lse = row_logsumexp_of_pieces(max_ptr, sum_ptr, row, num_chunks, CHUNKS_PAD)
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


@triton.jit
def _chunk_best_kernel(x_ptr, row_stride, vocab, max_ptr, sum_ptr, best_ptr, num_chunks, CHUNK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x, token, inside = _load_chunk(x_ptr, row, row_stride, vocab, chunk, CHUNK_SIZE)
    _store_normaliser_share(x, max_ptr, sum_ptr, row * num_chunks + chunk)
    tl.store(best_ptr + row * num_chunks + chunk, tl.max(tl.where(inside, _key(x, token), _OUTSIDE), axis=0))


@triton.jit
def _threshold_kernel(max_ptr, sum_ptr, best_ptr, lse_ptr, threshold_ptr, count_ptr, num_chunks,
                      K: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tl.store(lse_ptr + row, row_logsumexp_of_pieces(max_ptr, sum_ptr, row, num_chunks, CHUNKS_PAD))
    chunk = tl.arange(0, CHUNKS_PAD)
    best = tl.load(best_ptr + row * num_chunks + chunk, mask=chunk < num_chunks, other=_TAKEN)
    ranked = tl.sort(best, descending=True)
    tl.store(threshold_ptr + row, tl.sum(tl.where(chunk == K - 1, ranked, 0), axis=0))
    tl.store(count_ptr + row, 0)


@triton.jit
def _gather_kernel(x_ptr, row_stride, vocab, best_ptr, threshold_ptr, cand_ptr, count_ptr, num_chunks, capacity,
                   CHUNK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    threshold = tl.load(threshold_ptr + row)
    if tl.load(best_ptr + row * num_chunks + chunk) >= threshold:
        x, token, inside = _load_chunk(x_ptr, row, row_stride, vocab, chunk, CHUNK_SIZE)
        keep = inside & (_key(x, token) >= threshold)
        kept = keep.to(tl.int32)
        start = tl.atomic_add(count_ptr + row, tl.sum(kept, axis=0))
        slot = start + tl.cumsum(kept, axis=0) - 1
        tl.store(cand_ptr + row * capacity + slot, _key(x, token), mask=keep & (slot < capacity))


@triton.jit
def _select_kernel(x_ptr, row_stride, vocab, best_ptr, cand_ptr, count_ptr, lse_ptr, values_ptr, ids_ptr, num_chunks,
                   K: tl.constexpr, CAPACITY: tl.constexpr, CHUNK_SIZE: tl.constexpr, RECUTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, CAPACITY)
    count = tl.load(count_ptr + row)
    key = tl.load(cand_ptr + row * CAPACITY + slot, mask=slot < count, other=_TAKEN)
    rounds = 0
    while (count > CAPACITY) & (rounds < RECUTS):  # overflowed: re-cut at the buffer's k-th key (module docstring)
        cut = tl.sum(tl.where(slot == K - 1, tl.sort(key, descending=True), 0), axis=0)
        count = tl.zeros([], tl.int32)
        for chunk in range(0, num_chunks):
            # Only chunks whose best key reaches the cut hold keys at or above it: a few, where the row overflowed.
            if tl.load(best_ptr + row * num_chunks + chunk) >= cut:
                x, token, inside = _load_chunk(x_ptr, row, row_stride, vocab, chunk, CHUNK_SIZE)
                chunk_key = _key(x, token)
                keep = inside & (chunk_key >= cut)
                kept = keep.to(tl.int32)
                at = count + tl.cumsum(kept, axis=0) - 1
                tl.store(cand_ptr + row * CAPACITY + at, chunk_key, mask=keep & (at < CAPACITY))
                count += tl.sum(kept, axis=0)
        tl.debug_barrier()
        key = tl.load(cand_ptr + row * CAPACITY + slot, mask=slot < count, other=_TAKEN)
        rounds += 1
    if count > CAPACITY:  # still over: k maxima over the whole row, each below the one before, into slots 0..k-1
        key = tl.full([CAPACITY], _TAKEN, tl.int64)
        below = tl.full([], _ABOVE_ALL, tl.int64)
        for j in tl.static_range(K):
            best = tl.full([], _TAKEN, tl.int64)
            for chunk in range(0, num_chunks):
                x, token, inside = _load_chunk(x_ptr, row, row_stride, vocab, chunk, CHUNK_SIZE)
                chunk_key = tl.where(inside, _key(x, token), _TAKEN)
                best = tl.maximum(best, tl.max(tl.where(chunk_key < below, chunk_key, _TAKEN), axis=0))
            key = tl.where(slot == j, best, key)
            below = best
    # The k best keys lead; keyed again on the log-prob itself (module docstring), sorted, the first k written.
    top = tl.sort(key, descending=True)
    lse = tl.load(lse_ptr + row)
    token = _LOW_WORD - (top & _LOW_WORD)
    ranked = tl.sort(tl.where(slot < K, _key(_value_of(top) - lse, token), _TAKEN), descending=True)
    tl.store(values_ptr + row * K + slot, _value_of(ranked), mask=slot < K)
    tl.store(ids_ptr + row * K + slot, _LOW_WORD - (ranked & _LOW_WORD), mask=slot < K)


def threshold_chunk_size(vocab: int, k: int) -> int:
    """Tokens per chunk: ``THRESHOLD_CHUNK``, or fewer so that a row has at least k chunks (0: too few tokens)."""
    size = min(THRESHOLD_CHUNK, triton.next_power_of_2(vocab // k + 1) // 2)
    return size if size >= 16 else 0


def per_depth_topk_threshold(draft_logits: torch.Tensor, k: int, capacity: int | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_depth_topk_triton``'s result in four launches whose work hardly grows with k (module docstring);
    ``capacity`` candidates per row (a power of two, at least k; by default the larger of 128 and 4k: rows of
    Qwen3's vocabulary of random normal logits held 17 / 35 / 82 at k = 16 / 32 / 64, median of 64). Needs
    ``threshold_chunk_size(V, k) > 0``."""
    vocab = draft_logits.shape[-1]
    chunk_size = threshold_chunk_size(vocab, k)
    if chunk_size == 0:
        raise ValueError(f"threshold top-k needs at least 16 * k tokens per row, got {vocab} for k={k}")
    capacity = capacity or max(128, triton.next_power_of_2(4 * k))
    if capacity < k or capacity != triton.next_power_of_2(capacity):
        raise ValueError(f"threshold top-k capacity {capacity}: a power of two of at least k={k}")
    flat = draft_logits.reshape(-1, vocab)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, device = flat.shape[0], flat.device
    num_chunks = triton.cdiv(vocab, chunk_size)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_sum = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chunk_best = torch.empty(rows, num_chunks, dtype=torch.int64, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    threshold = torch.empty(rows, dtype=torch.int64, device=device)
    count = torch.empty(rows, dtype=torch.int32, device=device)
    cands = torch.empty(rows, capacity, dtype=torch.int64, device=device)
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=device)
    _chunk_best_kernel[(rows, num_chunks)](flat, flat.stride(0), vocab, chunk_max, chunk_sum, chunk_best, num_chunks,
                                           CHUNK_SIZE=chunk_size)
    _threshold_kernel[(rows,)](chunk_max, chunk_sum, chunk_best, lse, threshold, count, num_chunks, K=k,
                               CHUNKS_PAD=triton.next_power_of_2(num_chunks))
    _gather_kernel[(rows, num_chunks)](flat, flat.stride(0), vocab, chunk_best, threshold, cands, count, num_chunks,
                                       capacity, CHUNK_SIZE=chunk_size)
    _select_kernel[(rows,)](flat, flat.stride(0), vocab, chunk_best, cands, count, lse, values, ids, num_chunks, K=k,
                            CAPACITY=capacity, CHUNK_SIZE=chunk_size, RECUTS=RECUTS)
    shape = draft_logits.shape[:-1] + (k,)
    return values.view(shape), ids.view(shape)
