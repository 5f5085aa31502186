"""Tree-masked paged attention in plain PyTorch: the reference for the Triton kernel and the CPU engine's path.

Same contract as ``triton_tree.tree_attention`` (read its module docstring): queries ``[T, Hq, D]`` contiguous per
request, ``seq_lens`` including the queries, ``ancestor_bits`` in the TreeBatch layout, ``tree_rows`` (-1 = causal).

The caches are passed as two 4-D views ``[num_blocks, block_size, Hkv, D]`` with arbitrary strides, so one
function serves both engines' layouts:

* GPU, TRITON_ATTN: ``kv [num_blocks, Hkv, block_size, 2D]`` (logical) -> ``triton_attn_kv_views(kv)``, i.e.
  ``kv.transpose(1, 2).split(D, -1)``.
* CPU, CPU_ATTN (VEC / VEC16 ISAs): ``kv [num_blocks, Hkv, block_size, 2D]`` contiguous, where each
  (block, head) holds ``block_size * 2D`` elements: first K stored *transposed* ``[D, block_size]`` (element
  ``(t, d)`` at ``d * block_size + t``), then V row-major ``[block_size, D]``. ``cpu_attn_kv_views(kv)`` expresses
  both as strided views without copying. The AMX ISA (bf16, block_size % 32 == 0, AMX CPU) and the NEON BFMMLA path
  pre-pack K/V into tile formats that no strided view describes; ``block_size=16`` always selects VEC16.

This path reads request lengths on the host (``.tolist()``) and builds per-request shapes, so it is for the CPU
engine and for tests, not for the GPU decode path.
"""

from __future__ import annotations

import torch


def ancestor_mask(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Decode ``bits [..., W]`` int32 words into a bool mask ``[..., n]`` (bit j of word j//32; sign-safe)."""
    j = torch.arange(n, device=bits.device)
    words = bits[..., j // 32]
    return ((words >> (j % 32).to(words.dtype)) & 1).bool()


def triton_attn_kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TRITON_ATTN cache ``[num_blocks, Hkv, block_size, 2D]`` -> K, V views ``[num_blocks, block_size, Hkv, D]``."""
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def cpu_attn_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU_ATTN (VEC/VEC16) cache ``[num_blocks, Hkv, block_size, 2D]`` -> K, V views ``[nb, block_size, Hkv, D]``.

    Mirrors ``cpu_attn_reshape_and_cache``: per (block, head), K is written column-major ``[D, block_size]`` and V
    row-major ``[block_size, D]`` right after it (``kv.view(nb, H, 2*bs, D).chunk(2, dim=2)`` in cpu_attn.py).
    """
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    assert kv_cache.stride(3) == 1 and kv_cache.stride(2) == two_d, "each (block, head) must be contiguous"
    s0, s1 = kv_cache.stride(0), kv_cache.stride(1)
    off = kv_cache.storage_offset()
    k = kv_cache.as_strided((nb, bs, h, d), (s0, 1, s1, bs), off)
    v = kv_cache.as_strided((nb, bs, h, d), (s0, d, s1, 1), off + bs * d)
    return k, v


def gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """Logical tokens ``[0, length)`` of one request from a paged view ``[nb, bs, H, D]`` -> ``[length, H, D]``."""
    bs = cache.shape[1]
    t = torch.arange(length, device=cache.device)
    blocks = block_table_row[t // bs].long()
    return cache[blocks, t % bs]


def tree_attention_torch(
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
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Write tree-masked attention into ``out [T, Hq, D]`` (rows outside every request are left alone).

    Per request: gather its ``seq_len`` keys through the block table, mask ``[q_len, seq_len]`` (prefix visible,
    tree block from the ancestor bits, or causal when ``tree_rows[r] < 0``), softmax in ``compute_dtype``.
    A row that sees no key (only a padded node with an empty prefix) gets zeros.
    """
    num_q_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    g = num_q_heads // num_kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    rows = tree_rows.tolist() if tree_rows is not None else list(range(len(lens)))
    for r, seq_len in enumerate(lens):
        q0, q1 = qsl[r], qsl[r + 1]
        q_len = q1 - q0
        if q_len <= 0:
            continue
        ctx = seq_len - q_len
        k = gather_request_kv(key_cache, block_table[r], seq_len).to(compute_dtype)  # [S, Hkv, D]
        v = gather_request_kv(value_cache, block_table[r], seq_len).to(compute_dtype)
        k = k.repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(g, dim=1)
        qq = q[q0:q1].to(compute_dtype)  # [n, Hq, D]
        scores = torch.einsum("nhd,shd->hns", qq, k) * scale
        cols = torch.arange(seq_len, device=q.device)
        if rows[r] >= 0:
            tree = ancestor_mask(ancestor_bits[rows[r], :q_len], q_len)  # [n, n]
            mask = torch.cat([torch.ones(q_len, ctx, dtype=torch.bool, device=q.device), tree], dim=1)
        else:
            mask = cols[None, :] <= (ctx + torch.arange(q_len, device=q.device))[:, None]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        o = torch.einsum("hns,shd->nhd", p, v)
        out[q0:q1] = o.to(out.dtype)
    return out
