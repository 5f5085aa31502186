"""KV compaction: the one-launch Triton kernel (interpreter) against the PyTorch path and a naive sequential copy."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.attention.torch_tree import cpu_attn_kv_views, triton_attn_kv_views
from vllm_ddtree.kv_compact import KVCompactor, kv_compact, kv_compact_torch


def random_accepted(width: int, m: int, gen: torch.Generator, budget: int) -> list[int]:
    """acc[0] = 0, strictly increasing, acc[k] >= k, values <= budget, -1 past m."""
    acc = [0]
    for k in range(1, m + 1):
        lo = acc[-1] + 1
        hi = budget - (m - k)  # leave room for the rest
        acc.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    return acc + [-1] * (width - len(acc))


def naive_sequential(caches, block_table, ctx_lens, accepted):
    """The definition: for k = 1..m in increasing order, slot(s+k) <- slot(s+acc[k])."""
    for cache in caches:
        bs = cache.shape[1]
        for r in range(accepted.shape[0]):
            s = int(ctx_lens[r])
            for k in range(1, accepted.shape[1]):
                a = int(accepted[r, k])
                if a < 0:
                    break
                src, dst = s + a, s + k
                row = cache[int(block_table[r, src // bs]), src % bs].clone()
                cache[int(block_table[r, dst // bs]), dst % bs] = row


def make_layers(num_layers, num_blocks, bs, hkv, d, dtype, gen, layout="nhd"):
    """TRITON_ATTN-style per-layer caches (logical [nb, Hkv, bs, 2D]) and their [nb, bs, Hkv, 2D] row views."""
    layers = []
    for _ in range(num_layers):
        kv = torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype)
        if layout == "nhd":
            kv = kv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        layers.append(kv)
    return layers, [kv.transpose(1, 2) for kv in layers]


def make_batch(ctx_lens, ms, width, budget, bs, gen, extra_blocks=3):
    num_reqs = len(ctx_lens)
    need = [(s + budget + 1 + bs - 1) // bs for s in ctx_lens]
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(num_reqs, max(need) + 1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(need):
        bt[r, :nb] = perm[used : used + nb].int()
        used += nb
    acc = torch.tensor([random_accepted(width, m, gen, budget) for m in ms], dtype=torch.int32)
    return num_blocks, bt, torch.tensor(ctx_lens, dtype=torch.int32), acc


def check_all(views, bt, ctx, acc, groups=None, rows_per_group=1):
    ref = [v.clone() for v in views]
    seq = [v.clone() for v in views]
    kv_compact_torch(ref, bt, ctx, acc)
    naive_sequential(seq, bt, ctx, acc)
    for a, b in zip(ref, seq):
        assert torch.equal(a, b)
    for group in groups or [views]:  # one launch per group of identically strided views
        KVCompactor(group, rows_per_group=rows_per_group)(bt, ctx, acc)
    for a, b in zip(views, ref):
        assert torch.equal(a, b)  # bit-exact, and every other slot untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 32])
def test_random_batch_several_layers(dtype, bs):
    gen = torch.Generator().manual_seed(bs + dtype.itemsize)
    budget, width = 40, 9
    ctx_lens = [0, 1, 15, 17, 33, 100]
    ms = [8, 0, 3, 5, 1, 8]  # m = 0: no-op row
    nb, bt, ctx, acc = make_batch(ctx_lens, ms, width, budget, bs, gen)
    _, views = make_layers(3, nb, bs, 2, 64, dtype, gen)
    before = [v.clone() for v in views]
    check_all(views, bt, ctx, acc)
    # exactly the destination slots of moved rows changed; no-op rows and everything else kept
    changed = set()
    for r in range(len(ctx_lens)):
        for k in range(1, width):
            a = int(acc[r, k])
            if a >= 0 and a != k:
                t = ctx_lens[r] + k
                changed.add((int(bt[r, t // bs]), t % bs))
    for v, b in zip(views, before):
        diff = (v != b).flatten(2).any(-1).nonzero().tolist()
        assert {tuple(x) for x in diff} <= changed


def test_overlapping_ranges():
    """acc=[0,2,3]: slot s+1 <- s+2 then s+2 <- s+3 (a source is a later destination)."""
    gen = torch.Generator().manual_seed(0)
    bs, d = 16, 8
    _, views = make_layers(2, 4, bs, 1, d, torch.float32, gen)
    bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    ctx = torch.tensor([14], dtype=torch.int32)  # crosses the block boundary at 16
    acc = torch.tensor([[0, 2, 3, 5, 6, -1]], dtype=torch.int32)
    orig = [v.clone() for v in views]
    KVCompactor(views)(bt, ctx, acc)

    def slot(t):
        return int(bt[0, t // bs]), t % bs

    for v, o in zip(views, orig):
        for k, a in enumerate([0, 2, 3, 5, 6]):
            assert torch.equal(v[slot(14 + k)], o[slot(14 + a)])


def test_chain_and_empty_rows_are_noops():
    gen = torch.Generator().manual_seed(1)
    bs = 16
    nb, bt, ctx, _ = make_batch([5, 30], [0, 0], 6, 10, bs, gen)
    _, views = make_layers(2, nb, bs, 2, 16, torch.float32, gen)
    before = [v.clone() for v in views]
    acc = torch.tensor([[0, 1, 2, 3, -1, -1], [0, -1, -1, -1, -1, -1]], dtype=torch.int32)
    KVCompactor(views)(bt, ctx, acc)
    for v, b in zip(views, before):
        assert torch.equal(v, b)
    kv_compact(views, bt, ctx, acc[:, :1])  # width 1: nothing to do


def test_hnd_layout_and_chunking():
    """HND stride order and a row split over several programs (chunk < H*E)."""
    gen = torch.Generator().manual_seed(2)
    bs = 16
    nb, bt, ctx, acc = make_batch([3, 20, 47], [4, 2, 6], 7, 20, bs, gen)
    _, views = make_layers(2, nb, bs, 4, 32, torch.float16, gen, layout="hnd")
    ref = [v.clone() for v in views]
    kv_compact_torch(ref, bt, ctx, acc)
    KVCompactor(views, chunk=64)(bt, ctx, acc)  # 4*64 elements per row -> 4 chunks
    for a, b in zip(views, ref):
        assert torch.equal(a, b)


def test_triton_layout_moves_k_and_v():
    """Through the packed TRITON_ATTN entry both K and V of the accepted node land on the path slot."""
    gen = torch.Generator().manual_seed(3)
    bs, d = 16, 32
    nb, bt, ctx, acc = make_batch([17], [3], 5, 12, bs, gen)
    layers, views = make_layers(2, nb, bs, 2, d, torch.float32, gen)
    kvs = [triton_attn_kv_views(kv, d) for kv in layers]
    orig = [(k.clone(), v.clone()) for k, v in kvs]
    KVCompactor(views)(bt, ctx, acc)
    for (k, v), (k0, v0) in zip(kvs, orig):
        for kk in range(1, 4):
            a = int(acc[0, kk])
            dst, src = 17 + kk, 17 + a
            ds, ss = (int(bt[0, dst // bs]), dst % bs), (int(bt[0, src // bs]), src % bs)
            assert torch.equal(k[ds], k0[ss]) and torch.equal(v[ds], v0[ss])


def test_separate_k_v_caches_cpu_layout():
    """CPU_ATTN caches: K (stored transposed per block) and V views; their strides differ, so one launch each."""
    gen = torch.Generator().manual_seed(4)
    bs, d, hkv = 16, 32, 2
    nb, bt, ctx, acc = make_batch([9, 40], [5, 2], 8, 16, bs, gen)
    caches = [torch.randn(nb, hkv, bs, 2 * d, generator=gen) for _ in range(2)]
    kv_views = [cpu_attn_kv_views(kv) for kv in caches]
    ks, vs = [k for k, _ in kv_views], [v for _, v in kv_views]
    check_all(ks + vs, bt, ctx, acc, groups=[ks, vs])


def test_aliased_layers_moved_once():
    """Two layers sharing one cache (KV sharing) must not be moved twice (a second pass would corrupt it)."""
    gen = torch.Generator().manual_seed(5)
    bs = 16
    nb, bt, ctx, acc = make_batch([3], [3], 5, 9, bs, gen)
    _, views = make_layers(1, nb, bs, 2, 16, torch.float32, gen)
    ref = [views[0].clone()]
    kv_compact_torch(ref, bt, ctx, acc)
    KVCompactor([views[0], views[0]])(bt, ctx, acc)
    assert torch.equal(views[0], ref[0])


@pytest.mark.parametrize("rows_per_group", [1, 4, 16])
def test_long_paths_span_several_row_groups(rows_per_group):
    """m + 1 > 16 with rows moved one at a time or in groups; overlaps cross group boundaries (acc[k] = k + 1)."""
    gen = torch.Generator().manual_seed(6)
    bs = 16
    nb, bt, ctx, _ = make_batch([5, 30, 0], [0, 0, 0], 41, 60, bs, gen)
    shift = [0] + [k + 1 for k in range(1, 36)]  # every source is the next destination
    acc = torch.full((3, 41), -1, dtype=torch.int32)
    acc[0, :36] = torch.tensor(shift)
    acc[1, :17] = torch.tensor(random_accepted(17, 16, gen, 60)[:17])  # m + 1 = 17: one row into group 2
    acc[2, :16] = torch.tensor(random_accepted(16, 15, gen, 60)[:16])  # m + 1 = 16: exactly one group
    _, views = make_layers(2, nb, bs, 2, 16, torch.float32, gen)
    check_all(views, bt, ctx, acc, rows_per_group=rows_per_group)
