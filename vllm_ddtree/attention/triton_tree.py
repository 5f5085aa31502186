"""Tree-masked attention over vLLM's paged KV cache, in Triton.

One verify step of tree speculative decoding runs every request's whole draft tree (root + B nodes) through the
target at once. Query i of a tree sees the committed prefix plus its own ancestors (``TreeBatch.ancestor_bits``);
vLLM 0.26.0 has no kernel that takes a per-request mask, so this is a small flash-attention kernel of our own.

Contract (the same as ``torch_tree.tree_attention_torch``, the reference and CPU path):

* ``q [T, Hq, D]``: each request's query rows are contiguous, ``query_start_loc [R+1]`` delimits them. For a tree
  request row i is tree node i (node 0 = root).
* ``key_cache``/``value_cache [num_blocks, block_size, Hkv, D]`` with arbitrary strides: vLLM's TRITON_ATTN cache
  ``kv [num_blocks, Hkv, block_size, 2*D]`` (logical; NHD or HND in memory) maps to
  ``kv.transpose(1, 2).split(D, -1)``, exactly what ``TritonAttentionImpl.forward`` builds.
* ``seq_lens [R]``: tokens in the cache per request *including* this step's queries (vLLM's ``seq_lens``), so the
  committed prefix is ``s = seq_lens - q_len``. The K/V of query row i was written at logical index ``s + i``
  (slots stay linear; RoPE used depth positions upstream, this kernel never sees positions).
* ``ancestor_bits [R_tree, B+1, W]`` int32 (TreeBatch layout) and ``tree_rows [R]`` int32: request r uses
  tree row ``tree_rows[r]``; ``-1`` means an ordinary causal request (prefill chunk, plain decode), so mixed batches
  need one launch. Without ``tree_rows`` request r uses row r. A tree request needs ``q_len <= B+1``.
* Query i of a tree request attends to keys ``t < s`` and to ``t = s + j`` iff bit j of ``ancestor_bits[row, i]``.

Design: one program per (query tile, kv head[, kv split]). The ``G = Hq/Hkv`` query heads sharing a kv head are
packed into the M dimension (row m = query ``m // G``, head ``m % G``), like vLLM's unified kernel, so ``tl.dot``
tiles are >= 16 and each K/V tile is read once per query tile, not once per head. Prefix tiles need no mask; only
the last tiles (those touching ``[s, s+q_len)``) load ancestor words. Extra memory is O(tree): the bits, never a
mask over the context. The grid depends only on ``T`` and ``R`` (static shapes), so CUDA graphs can capture it.

Split-KV (flash-decoding; ``num_kv_splits`` auto by default): the prefix tiles are divided among splits that write
partial (max, sum, acc) to a workspace, and a second kernel merges them. It pays off at small batch x long context
(H200, bf16, Hq 32 / Hkv 8 / D 128, 65-node tree, 32k context, batch 1: 200 us vs 244 us unsplit; SDPA over the
same data, contiguous and unmasked, 424 us). At large batch the kernel is compute-bound at ~160-200 TFLOP/s.

Not supported (the wrapper raises): softcap, sliding window, ALiBi, sinks, quantized (fp8/int8) KV caches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Read at import, like Triton itself: the interpreter needs a bf16 dot workaround (see _attend_tile).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Request owning global query block ``q_block``: request r's blocks start at ``qsl[r] // BLOCK_Q + r``."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(
    Q, M, L, acc, t0, k_base, v_base, bt_row_ptr,
    stride_k0, stride_k1, stride_v0, stride_v1,
    offs_d, qk_scale, keep, key_mask,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    MASKED: tl.constexpr, K_ROWS: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """One online-softmax step over keys [t0, t0+TILE). ``keep`` [BLOCK_M, TILE] and ``key_mask`` [TILE] only
    matter when MASKED; unmasked tiles lie inside the prefix and load without any mask (a mask that varies along
    the contiguous head dim would also stop vectorised loads, so the head-dim mask exists only when D is padded)."""
    offs_t = t0 + tl.arange(0, TILE)
    if MASKED:
        blk = tl.load(bt_row_ptr + offs_t // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + offs_t // BLOCK_SIZE).to(tl.int64)
    in_blk = (offs_t % BLOCK_SIZE).to(tl.int64)
    k_rows = k_base + blk[:, None] * stride_k0 + in_blk[:, None] * stride_k1 + offs_d[None, :]  # [TILE, D]
    v_rows = v_base + blk[:, None] * stride_v0 + in_blk[:, None] * stride_v1 + offs_d[None, :]
    if MASKED:
        row_mask = key_mask[:, None]
        if HEAD_SIZE != HEAD_PAD:
            row_mask = row_mask & (offs_d < HEAD_SIZE)[None, :]
        V = tl.load(v_rows, mask=row_mask, other=0.0)
        if K_ROWS:
            K = tl.trans(tl.load(k_rows, mask=row_mask, other=0.0))
        else:
            K = tl.load(tl.trans(k_rows), mask=tl.trans(row_mask), other=0.0)
    elif HEAD_SIZE != HEAD_PAD:
        d_mask = (offs_d < HEAD_SIZE)[None, :]
        V = tl.load(v_rows, mask=d_mask, other=0.0)
        if K_ROWS:
            K = tl.trans(tl.load(k_rows, mask=d_mask, other=0.0))
        else:
            K = tl.load(tl.trans(k_rows), mask=tl.trans(d_mask), other=0.0)
    else:
        V = tl.load(v_rows)
        if K_ROWS:
            K = tl.trans(tl.load(k_rows))
        else:
            K = tl.load(tl.trans(k_rows))
    K = K.to(Q.dtype)  # K^T [D, TILE]
    if DOT_F32:  # interpreter only: its tl.dot multiplies bf16 bit patterns (stored as uint16); exact in fp32
        S = tl.dot(Q.to(tl.float32), K.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        S = tl.dot(Q, K, input_precision=DOT_PREC) * qk_scale  # log2 domain
    if MASKED:
        S = tl.where(keep, S, float("-inf"))
    m_new = tl.maximum(M, tl.max(S, 1))
    # Rows that have seen no key yet keep M = -inf; exponentiate against 0 so they stay exactly 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    P = tl.exp2(S - m_safe[:, None])
    alpha = tl.exp2(M - m_safe)
    L = L * alpha + tl.sum(P, 1)
    P = P.to(V.dtype)
    if DOT_F32:
        acc = acc * alpha[:, None] + tl.dot(P.to(tl.float32), V.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(P, V, input_precision=DOT_PREC)
    return m_new, L, acc


@triton.jit(do_not_specialize=["num_seqs"])  # batch 1 and larger batches share one compiled variant
def _tree_attn_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr,
    block_table_ptr, seq_lens_ptr, qsl_ptr, anc_ptr, tree_rows_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, lse_ptr,
    qk_scale, num_seqs,
    stride_q0, stride_q1, stride_o0, stride_o1,
    stride_k0, stride_k1, stride_k2,
    stride_v0, stride_v1, stride_v2,
    stride_bt0, stride_a0, stride_a1, stride_a2, stride_lse0, stride_lse1,
    G: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_TREE_ROWS: tl.constexpr, K_ROWS: tl.constexpr, DOT_PREC: tl.constexpr,
    DOT_F32: tl.constexpr, SKIP_CAUSAL: tl.constexpr, PREFIX_DONE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(qsl_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    q0 = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first local query row of this tile
    if q0 >= q_len:
        return  # padding program of the static grid
    seq_len = tl.load(seq_lens_ptr + seq)
    # vLLM's graph-capture warm-up runs with seq_lens 1 < q_len: clamp so no tile index goes negative.
    ctx = tl.maximum(seq_len - q_len, 0)
    if USE_TREE_ROWS:
        tree_row = tl.load(tree_rows_ptr + seq)
    else:
        tree_row = seq
    is_tree = tree_row >= 0
    if SKIP_CAUSAL:
        if tree_row < 0:
            return  # another kernel (vLLM's) computed this causal request's rows

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    qi = q0 + offs_m // G  # local query row (= tree node) per packed row
    head = kv_head * G + offs_m % G
    row_valid = (offs_m < BLOCK_Q * G) & (qi < q_len)
    dim_mask = (offs_d < HEAD_SIZE) | (HEAD_SIZE == HEAD_PAD)
    tok = (q_start + qi).to(tl.int64)

    Q = tl.load(
        q_ptr + tok[:, None] * stride_q0 + head[:, None] * stride_q1 + offs_d[None, :],
        mask=row_valid[:, None] & dim_mask[None, :], other=0.0,
    )

    # Keys beyond ctx + q0 + BLOCK_Q are invisible to every row here (ancestors and causal keys precede the query).
    kv_hi = tl.minimum(seq_len, ctx + q0 + BLOCK_Q)
    # Keys below free_hi are visible to every valid row: the prefix (tree), or up to the first row (causal). With
    # the prefix done, only keys from ctx on remain.
    if PREFIX_DONE:
        free_hi = ctx
    else:
        free_hi = tl.where(is_tree, ctx, ctx + q0 + 1)
    n_free = free_hi // TILE
    n_all = tl.cdiv(kv_hi, TILE)

    if PREFIX_DONE:
        lo = 0
        hi = 0
    elif NUM_SPLITS == 1:
        lo = 0
        hi = n_free
    else:
        per_split = tl.cdiv(n_free, NUM_SPLITS)
        lo = tl.minimum(split * per_split, n_free)
        hi = tl.minimum(lo + per_split, n_free)

    if PREFIX_DONE:
        # out holds each row's softmax over the keys < ctx and lse their natural log-sum-exp: the online-softmax
        # state (max, sum, acc) = (lse in log2, 1, out). An empty prefix has lse -inf (FlashAttention 3), +inf
        # (FlashAttention 2) or NaN: the empty state.
        lse = tl.load(lse_ptr + head.to(tl.int64) * stride_lse0 + tok * stride_lse1, mask=row_valid,
                      other=float("-inf")) * 1.4426950408889634
        has_prefix = (lse > float("-inf")) & (lse < float("inf"))
        M = tl.where(has_prefix, lse, float("-inf"))
        L = tl.where(has_prefix, 1.0, 0.0)
        acc = tl.load(
            out_ptr + tok[:, None] * stride_o0 + head[:, None] * stride_o1 + offs_d[None, :],
            mask=(row_valid & has_prefix)[:, None] & dim_mask[None, :], other=0.0,
        ).to(tl.float32)
    else:
        M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        L = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    k_base = k_ptr + kv_head.to(tl.int64) * stride_k2
    v_base = v_ptr + kv_head.to(tl.int64) * stride_v2
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt0
    dummy_keep = row_valid[:, None]
    dummy_kmask = tl.arange(0, TILE) >= 0

    for j in range(lo, hi):
        M, L, acc = _attend_tile(
            Q, M, L, acc, j * TILE, k_base, v_base, bt_row,
            stride_k0, stride_k1, stride_v0, stride_v1, offs_d, qk_scale, dummy_keep, dummy_kmask,
            HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE, False, K_ROWS, DOT_PREC, DOT_F32,
        )

    # Tiles that touch the tree block (or the causal diagonal): the last split does them.
    if split == NUM_SPLITS - 1:
        anc_row = anc_ptr + tree_row.to(tl.int64) * stride_a0 + qi.to(tl.int64) * stride_a1
        for j in range(n_free, n_all):
            offs_t = j * TILE + tl.arange(0, TILE)
            key_mask = offs_t < kv_hi
            rel = offs_t - ctx  # tree node index of the key (negative inside the prefix)
            in_tree = (rel >= 0) & (rel < q_len)
            relc = tl.maximum(rel, 0)  # keep shifts and word indices non-negative where the bits are unused
            word = tl.load(
                anc_row[:, None] + (relc // 32)[None, :] * stride_a2,
                mask=row_valid[:, None] & in_tree[None, :] & is_tree, other=0,
            )
            # (word >> b) & 1 is sign-safe on int32 (bit 31 makes the word negative).
            anc = ((word >> (relc % 32)[None, :]) & 1) != 0
            causal_keep = offs_t[None, :] <= (ctx + qi)[:, None]
            if PREFIX_DONE:  # ancestors are tree nodes (rel >= 0) already
                tree_keep = anc
                causal_keep = causal_keep & (rel >= 0)[None, :]
            else:
                tree_keep = (rel < 0)[None, :] | anc
            keep = tl.where(is_tree, tree_keep, causal_keep) & key_mask[None, :] & row_valid[:, None]
            M, L, acc = _attend_tile(
                Q, M, L, acc, j * TILE, k_base, v_base, bt_row,
                stride_k0, stride_k1, stride_v0, stride_v1, offs_d, qk_scale, keep, key_mask,
                HEAD_SIZE, HEAD_PAD, BLOCK_SIZE, TILE, True, K_ROWS, DOT_PREC, DOT_F32,
            )

    if NUM_SPLITS == 1:
        L_safe = tl.where(L > 0.0, L, 1.0)  # a row with no visible key (only possible for padded nodes) -> 0
        o = acc / L_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_o0 + head[:, None] * stride_o1 + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_mask[None, :],
        )
    else:
        # workspace [T, Hq, NUM_SPLITS(, HEAD_PAD)], contiguous
        hq = tl.num_programs(1) * G
        p_row = (tok * hq + head) * NUM_SPLITS + split  # int64 (tok is)
        tl.store(part_m_ptr + p_row, M, mask=row_valid)
        tl.store(part_l_ptr + p_row, L, mask=row_valid)
        tl.store(part_acc_ptr + p_row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs"])  # batch 1 and larger batches share one compiled variant
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, qsl_ptr, num_seqs,
    stride_o0, stride_o1,
    NUM_Q_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """out[t, h] = sum_s acc_s 2^(m_s - m) / sum_s l_s 2^(m_s - m). Rows past the last request are skipped."""
    tok = tl.program_id(0)
    h = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_seqs):
        return
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_PAD)
    row = (tok.to(tl.int64) * NUM_Q_HEADS + h) * NUM_SPLITS
    m_s = tl.load(part_m_ptr + row + offs_s)
    l_s = tl.load(part_l_ptr + row + offs_s)
    m = tl.max(m_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_s - m_safe)
    denom = tl.sum(l_s * w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    a = tl.load(part_acc_ptr + (row + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    o = tl.sum(a * w[:, None], 0) / denom
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_o0 + h * stride_o1 + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def _head_pad(head_size: int) -> int:
    return max(16, triton.next_power_of_2(head_size))


def split_workspace(
    num_tokens: int, num_q_heads: int, head_size: int, num_kv_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Preallocate the split-KV workspace (acc, max, sum) once, so captured graphs see fixed addresses."""
    hp = _head_pad(head_size)
    return (
        torch.empty(num_tokens, num_q_heads, num_kv_splits, hp, dtype=torch.float32, device=device),
        torch.empty(num_tokens, num_q_heads, num_kv_splits, dtype=torch.float32, device=device),
        torch.empty(num_tokens, num_q_heads, num_kv_splits, dtype=torch.float32, device=device),
    )


def pick_block_m(max_query_len: int, num_queries_per_kv: int, head_size: int = 128) -> int:
    """Packed rows per program: the whole tree's heads if they fit (each K/V tile is then read once), 16..128
    (64 for head sizes > 128, to stay within registers)."""
    g2 = triton.next_power_of_2(num_queries_per_kv)
    cap = 128 if head_size <= 128 else 64
    bm = min(max(16, triton.next_power_of_2(max(1, max_query_len) * num_queries_per_kv)), cap)
    return max(bm, g2)


def launch_config(block_m: int, head_size: int, elem_size: int) -> tuple[int, int, int]:
    """(tile, num_warps, num_stages) measured best on an H200 (bf16, D=128; out/attn_gpu notes in the report):
    128-row programs want 128-key tiles and 8 warps, 64-row programs 64-key tiles and 4 warps, 3 stages. Smaller
    tiles for D > 128 and fp32 keep the pipelined K/V tiles inside shared memory."""
    if head_size > 128 or elem_size > 2:
        return (32 if head_size > 128 else 64), 4, 2
    if block_m >= 128:
        return 128, 8, 3
    return 64, 4, 3


# The tree-block pass after a prefix computed elsewhere (``prefix_lse``) reads a few keys per query: smaller
# programs and key tiles. H200, bf16, Qwen3-8B's heads, 36 calls per graph (benchmarks/attention_sweep.py --block,
# 2026-12-01 fifth session): at batch 1 / 8 and B=16 4.6 / 5.0 us against 15.4 / 15.7 with launch_config's 128-row
# programs; within 10-20% of the best of 11 configurations at every batch x budget up to 32 x 65.
BLOCK_PASS_LAUNCH = (64, 32, 4, 1)  # block_m (at most), tile, warps, stages

# Token x split rows of the shared split-KV workspace; tree_attention lowers the split factor to fit. Split-KV pays
# off only for small grids (few tokens), so this bound rarely binds.
WORKSPACE_ROWS = 4096

_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _device_key(device: torch.device | str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def allocate_workspace(num_q_heads: int, head_size: int, device: torch.device | str):
    """The split-KV workspace shared by every call with this head shape (layers run one after another on one
    stream: a layer's merge reads it before the next layer writes). Fixed size, allocated once: call this before
    CUDA graph capture, since a captured launch keeps the addresses it saw."""
    key = (num_q_heads, _head_pad(head_size), _device_key(device))
    if key not in _WORKSPACES:
        _WORKSPACES[key] = split_workspace(WORKSPACE_ROWS, num_q_heads, head_size, 1, device)
    return _WORKSPACES[key]


def _shared_workspace(num_tokens, num_q_heads, head_size, num_kv_splits, device):
    """Views of the shared workspace shaped for one call (``num_tokens * num_kv_splits <= WORKSPACE_ROWS``)."""
    acc, row_max, row_sum = allocate_workspace(num_q_heads, head_size, device)
    shape = (num_tokens, num_q_heads, num_kv_splits)
    n = num_tokens * num_q_heads * num_kv_splits
    return (
        acc.view(-1)[: n * acc.shape[-1]].view(*shape, acc.shape[-1]),
        row_max.view(-1)[:n].view(shape),
        row_sum.view(-1)[:n].view(shape),
    )


_NUM_SMS: dict[int, int] = {}


def auto_kv_splits(
    num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, max_query_len: int,
    device: torch.device | str, block_m: int | None = None,
) -> int:
    """Split-KV factor that gives the grid about four programs per SM, at most 16 (1 on CPU). Host ints only, so a
    backend can size its workspace with it at capture time; any factor is correct for any sequence lengths."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 1
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    g = num_q_heads // num_kv_heads
    bm = block_m or pick_block_m(max_query_len, g, 128)
    q_tiles = min(num_tokens // (bm // g) + num_seqs, num_seqs * triton.cdiv(max(1, max_query_len), bm // g))
    programs = max(1, q_tiles * num_kv_heads)
    splits = 1
    while splits < 16 and programs * splits * 2 <= 4 * _NUM_SMS[idx]:
        splits *= 2
    return splits


def tree_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    ancestor_bits: torch.Tensor,
    scale: float,
    *,
    tree_rows: torch.Tensor | None = None,
    max_query_len: int | None = None,
    num_kv_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_m: int | None = None,
    tile_size: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_rows: bool = False,
    softcap: float = 0.0,
    sliding_window: int | None = None,
    tree_rows_only: bool = False,
    prefix_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree-masked paged attention; writes ``out [T, Hq, D]`` and returns it (see module docstring).

    ``max_query_len`` (a host int, e.g. vLLM's ``max_query_len``; default ``B+1``) only tunes the tile shape:
    any value is correct because the grid covers every token. ``num_kv_splits``: None = auto (``auto_kv_splits``;
    always 1 on CPU), 1 = single pass, > 1 (a power of 2) uses ``workspace`` from ``split_workspace``, or else
    the module-level one shared by all calls (``allocate_workspace``; the factor is lowered to fit it).
    Tile, warps and stages default to ``launch_config`` (``BLOCK_PASS_LAUNCH`` with ``prefix_lse``). No host
    syncs: every shape and launch parameter comes from tensor shapes and Python ints. ``tree_rows_only``: write
    only the rows of requests with a tree (``tree_rows >= 0``), leaving the others' output as it is (another kernel
    computed them); single pass. ``prefix_lse [Hq, T]`` float32: ``out`` already holds every row's attention over
    its request's prefix (keys ``< seq_lens - q_len``, e.g. FlashAttention's, non-causal) with that softmax's
    natural log-sum-exp (FlashAttention's ``softmax_lse`` layout); the kernel then reads only the keys of this
    step's block (tree or causal) and merges them in place.
    """
    if softcap:
        raise NotImplementedError("tree attention: logits softcap is not supported")
    if sliding_window not in (None, -1, (-1, -1)):
        raise NotImplementedError("tree attention: sliding window is not supported")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise NotImplementedError(
            f"tree attention: KV cache dtype {key_cache.dtype} != query dtype {q.dtype} (quantized KV unsupported)"
        )
    num_tokens, num_q_heads, head_size = q.shape
    num_blocks, block_size, num_kv_heads, kd = key_cache.shape
    assert kd == head_size and value_cache.shape == key_cache.shape
    assert num_q_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and out.stride(2) == 1 and out.shape == q.shape
    assert key_cache.stride(3) == 1 and value_cache.stride(3) == 1, "head dim of the KV cache must be contiguous"
    assert ancestor_bits.dtype == torch.int32 and ancestor_bits.dim() == 3
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1 and block_table.shape[0] >= num_seqs
    g = num_q_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = ancestor_bits.shape[1]
    bm = block_m or pick_block_m(max_query_len, g, head_size)
    if prefix_lse is not None and not block_m:
        bm = max(min(bm, BLOCK_PASS_LAUNCH[0]), g)
    assert bm >= g and bm >= 16 and (bm & (bm - 1)) == 0
    block_q = bm // g
    if prefix_lse is not None:
        d_tile, d_warps, d_stages = BLOCK_PASS_LAUNCH[1:]
    else:
        d_tile, d_warps, d_stages = launch_config(bm, head_size, q.element_size())
    tile = tile_size or d_tile
    head_pad = _head_pad(head_size)
    grid0 = num_tokens // block_q + num_seqs
    if tree_rows_only:
        assert tree_rows is not None, "tree_rows_only needs tree_rows"
        num_kv_splits = 1  # the split merge would write every row
    if prefix_lse is not None:
        assert prefix_lse.dtype == torch.float32 and prefix_lse.shape[0] == num_q_heads
        assert prefix_lse.shape[1] >= num_tokens
        num_kv_splits = 1  # the few keys left need no split
    if num_kv_splits is None:
        num_kv_splits = auto_kv_splits(num_tokens, num_seqs, num_q_heads, num_kv_heads, max_query_len, q.device, bm)
    if workspace is None:
        while num_kv_splits > 1 and num_tokens * num_kv_splits > WORKSPACE_ROWS:
            num_kv_splits //= 2
    if num_kv_splits > 1:
        assert triton.next_power_of_2(num_kv_splits) == num_kv_splits, "num_kv_splits must be a power of 2"
        if workspace is None:
            workspace = _shared_workspace(num_tokens, num_q_heads, head_size, num_kv_splits, q.device)
        part_acc, part_m, part_l = workspace
        assert part_acc.shape[0] >= num_tokens and part_acc.shape[1:] == (num_q_heads, num_kv_splits, head_pad)
        assert part_acc.is_contiguous() and part_m.is_contiguous() and part_l.is_contiguous()
    else:
        part_acc = part_m = part_l = out  # unused
    use_tree_rows = tree_rows is not None
    kwargs = {"num_warps": num_warps or d_warps, "num_stages": num_stages or d_stages}
    _tree_attn_kernel[(grid0, num_kv_heads, num_kv_splits)](
        out, q, key_cache, value_cache,
        block_table, seq_lens, query_start_loc, ancestor_bits, tree_rows if use_tree_rows else seq_lens,
        part_acc, part_m, part_l, prefix_lse if prefix_lse is not None else out,
        float(scale) * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_table.stride(0), *ancestor_bits.stride(),
        *(prefix_lse.stride() if prefix_lse is not None else (0, 0)),
        G=g, HEAD_SIZE=head_size, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TILE=tile,
        BLOCK_M=bm, BLOCK_Q=block_q, NUM_SPLITS=num_kv_splits, USE_TREE_ROWS=use_tree_rows, K_ROWS=k_rows,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_F32=_INTERPRET and q.dtype == torch.bfloat16, SKIP_CAUSAL=tree_rows_only,
        PREFIX_DONE=prefix_lse is not None,
        **kwargs,
    )
    if num_kv_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_m, part_l, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            NUM_Q_HEADS=num_q_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_kv_splits,
        )
    return out
