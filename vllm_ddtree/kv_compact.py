"""Move the accepted tree nodes' K/V onto the committed path, for every attention layer, in one launch.

After the tree walk, request r accepted nodes ``acc[r, 0..m]`` (``acc[r, 0] = 0`` the root, strictly increasing,
``acc[r, k] >= k``, ``-1`` past m; width L+1). vLLM's rollback is bookkeeping only (``num_computed_tokens -=
rejected``), so before the next forward the K/V at logical index ``s_r + acc[k]`` must move to ``s_r + k``.
No recompute is needed: node ``acc[k]`` has depth k, so its keys were already RoPE'd at position ``s_r + k``.
Slot of logical index t: ``block_table[r, t // block_size] * block_size + t % block_size``.

Cache views: every entry of ``caches`` is a 4-D view ``[num_blocks, block_size, H, E]`` and all share shape,
strides and dtype; one "row" is the ``[H, E]`` entry of one slot.

* TRITON_ATTN (GPU): pass ``kv.transpose(1, 2)`` per layer, ``[nb, bs, Hkv, 2D]``: K and V are packed in the last
  dim, so moving the row moves both (NHD or HND stride order, both fine).
* Separate K and V caches with equal strides (FlashAttention's ``kv[0]``/``kv[1]``): pass both as entries.
  The CPU_ATTN K and V views (``torch_tree.cpu_attn_kv_views``) differ in strides: one KVCompactor for the K
  views and one for the V views, or, as the CPU engine does, ``kv_compact_torch``.

Race freedom. One program owns (request, layer, head-dim chunk) and moves k = 1..m of it in groups of KB rows:
load the group's source rows, block barrier, store its destination rows. Within a group no store precedes any
load (the barrier), whatever the overlap (``acc=[0,2,3]``: slot s+2 is both a source and a destination). Across
groups, a later group never reads what an earlier one wrote (it reads ``s+acc[k'] >= s+k' > s+k`` for every
earlier destination ``s+k``), and its stores follow its barrier, hence every earlier group's loads. Programs of one
launch touch disjoint memory: different layers, head-dim chunks, or requests (whose tree slots lie in blocks of
their own; vLLM never shares a block that is still being written). Layers that alias one cache (KV sharing) are
deduplicated, or two programs would race. KB = 1 is the plain in-place increasing-k copy; KB = 4 (default)
measured best. The loop stops at the request's own m (counted on the device, no host sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_compact_kernel(
    base_ptr, offsets_ptr, block_table_ptr, ctx_lens_ptr, acc_ptr,
    stride_c0, stride_c1, stride_c2, stride_c3,
    stride_bt0, stride_acc0,
    NUM_ROW: tl.constexpr, E: tl.constexpr, WIDTH: tl.constexpr, WIDTH_PAD: tl.constexpr, KB: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (request r, cache c, chunk): elements [chunk*CHUNK, +CHUNK) of the H*E row, k = 1..m in groups
    of KB rows: load the group, barrier, store the group."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    chunk = tl.program_id(2)
    base = base_ptr + tl.load(offsets_ptr + c)  # element offset of cache c relative to base_ptr (may be < 0)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = idx < NUM_ROW
    col = (idx // E).to(tl.int64) * stride_c2 + (idx % E).to(tl.int64) * stride_c3
    acc_row = acc_ptr + r.to(tl.int64) * stride_acc0
    kk = tl.arange(0, WIDTH_PAD)
    n_acc = tl.sum((tl.load(acc_row + kk, mask=kk < WIDTH, other=-1) >= 0).to(tl.int32), 0)  # m + 1 (0 if empty)
    ctx = tl.load(ctx_lens_ptr + r)
    bt_row = block_table_ptr + r.to(tl.int64) * stride_bt0
    for g in range(0, tl.cdiv(n_acc, KB)):
        k = g * KB + tl.arange(0, KB)
        a = tl.load(acc_row + k, mask=(k >= 1) & (k < WIDTH), other=-1)
        # -1 = past the accepted path (or k = 0, the root, already in place); a == k (chain prefix) is in place
        valid = (a >= 0) & (a != k)
        src_t = ctx + tl.maximum(a, 0)
        dst_t = ctx + k
        src_blk = tl.load(bt_row + src_t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        dst_blk = tl.load(bt_row + dst_t // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        src = base + (src_blk * stride_c0 + (src_t % BLOCK_SIZE).to(tl.int64) * stride_c1)[:, None] + col[None, :]
        dst = base + (dst_blk * stride_c0 + (dst_t % BLOCK_SIZE).to(tl.int64) * stride_c1)[:, None] + col[None, :]
        m2 = valid[:, None] & in_row[None, :]
        x = tl.load(src, mask=m2)
        tl.debug_barrier()  # all loads so far (this group and earlier ones) are done before any thread stores
        tl.store(dst, x, mask=m2)


def _check_views(caches: Sequence[torch.Tensor]) -> None:
    c0 = caches[0]
    assert c0.dim() == 4, "cache views must be [num_blocks, block_size, H, E]"
    for c in caches:
        assert c.shape == c0.shape and c.stride() == c0.stride() and c.dtype == c0.dtype and c.device == c0.device


class KVCompactor:
    """Holds the per-cache pointer offsets (computed once: KV caches never move) and launches the kernel.

    ``caches``: layer views ``[num_blocks, block_size, H, E]`` with identical shape/strides/dtype (module doc).
    Offsets are element distances from ``caches[0]``'s first element, so a single pointer argument plus an int64
    table addresses every layer without int-to-pointer casts.
    """

    def __init__(
        self, caches: Sequence[torch.Tensor], chunk: int | None = None, num_warps: int | None = None,
        rows_per_group: int = 4,
    ):
        """``chunk``: row elements per program (power of 2, default 1024); ``rows_per_group`` (power of 2): rows
        loaded before one barrier. Defaults from an H200 sweep (36 layers, Hkv 8, D 128 packed, bf16): 4-row groups
        x 1024 elements were best or tied everywhere (R=1: 10.5 us; R=32, m=4: 18 us; R=128, m=16: 185 us =
        3.3 TB/s); 16-row groups were up to 2.5x slower at large batch (their pointer tiles spill)."""
        _check_views(caches)
        # Layers that share one cache (KV sharing, e.g. Gemma) must be moved once: two programs moving the same
        # rows would race (one reads a slot the other already overwrote).
        seen: set[int] = set()
        self.caches = [c for c in caches if not (c.data_ptr() in seen or seen.add(c.data_ptr()))]
        self.base = self.caches[0]
        esz = self.base.element_size()
        diffs = []
        for c in self.caches:
            d = c.data_ptr() - self.base.data_ptr()
            assert d % esz == 0, "cache views must be element-aligned with each other"
            diffs.append(d // esz)
        self.offsets = torch.tensor(diffs, dtype=torch.int64, device=self.base.device)
        nb, bs, h, e = self.base.shape
        self.block_size = bs
        self.num_row = h * e
        self.chunk = chunk
        self.num_warps = num_warps
        self.rows_per_group = rows_per_group

    def __call__(self, block_table: torch.Tensor, ctx_lens: torch.Tensor, accepted: torch.Tensor) -> None:
        """``block_table [R, max_blocks]``, ``ctx_lens [R]`` (s_r), ``accepted [R, L+1]`` int: device tensors."""
        num_reqs, width = accepted.shape
        if width <= 1:
            return
        assert accepted.stride(1) == 1 and ctx_lens.shape[0] >= num_reqs and block_table.shape[0] >= num_reqs
        s = self.base.stride()
        width_pad = triton.next_power_of_2(width)
        kb = min(self.rows_per_group, width_pad)
        chunk = self.chunk or min(triton.next_power_of_2(self.num_row), 1024)
        num_warps = self.num_warps or 4
        grid = (num_reqs, len(self.caches), triton.cdiv(self.num_row, chunk))
        _kv_compact_kernel[grid](
            self.base, self.offsets, block_table, ctx_lens, accepted,
            s[0], s[1], s[2], s[3], block_table.stride(0), accepted.stride(0),
            NUM_ROW=self.num_row, E=self.base.shape[3], WIDTH=width, WIDTH_PAD=width_pad, KB=kb,
            BLOCK_SIZE=self.block_size, CHUNK=chunk, num_warps=num_warps,
        )


def kv_compact(
    caches: Sequence[torch.Tensor], block_table: torch.Tensor, ctx_lens: torch.Tensor, accepted: torch.Tensor
) -> None:
    """One-shot convenience around ``KVCompactor`` (recomputes the offset table: keep a KVCompactor per engine)."""
    KVCompactor(caches)(block_table, ctx_lens, accepted)


def kv_compact_torch(
    caches: Sequence[torch.Tensor], block_table: torch.Tensor, ctx_lens: torch.Tensor, accepted: torch.Tensor
) -> None:
    """Reference and CPU path: gather every accepted source row first, then scatter (overlap-safe).

    Uses ``nonzero`` (a data-dependent shape), fine on the CPU engine, a host sync on GPU: not for the decode path.
    Caches may have different strides here (any 4-D views ``[nb, bs, H, E]`` sharing ``block_size``).
    """
    num_reqs, width = accepted.shape
    if width <= 1:
        return
    k = torch.arange(width, device=accepted.device)
    acc = accepted.long()
    move = (acc >= 0) & (k[None, :] >= 1) & (acc != k[None, :])
    r_idx, k_idx = move.nonzero(as_tuple=True)
    if r_idx.numel() == 0:
        return
    ctx = ctx_lens.long()[r_idx]
    src_t = ctx + acc[r_idx, k_idx]
    dst_t = ctx + k_idx
    seen: set[int] = set()
    for cache in caches:
        if cache.data_ptr() in seen:  # aliased layer (KV sharing): already moved
            continue
        seen.add(cache.data_ptr())
        bs = cache.shape[1]
        bt = block_table.long()
        src_b, src_o = bt[r_idx, src_t // bs], src_t % bs
        dst_b, dst_o = bt[r_idx, dst_t // bs], dst_t % bs
        rows = cache[src_b, src_o].clone()  # [P, H, E]: all reads before any write
        cache[dst_b, dst_o] = rows
