"""Tree-masked paged attention: the Triton kernel (interpreter) and the PyTorch path against a float64 dense
reference built from parent arrays (independent of the bit encoding and of the paging)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_ddtree.attention.torch_tree import (
    ancestor_mask,
    cpu_attn_kv_views,
    tree_attention_torch,
    triton_attn_kv_views,
)
from vllm_ddtree.attention.triton_tree import split_workspace, tree_attention

CTX_LENS = [0, 1, 15, 17, 100]  # not multiples of the block size; 0 = tree only


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    """A random valid tree in TreeBatch order: parent[i] uniform in [0, i)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_sets(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        s, j = set(), i
        while j >= 0:
            s.add(j)
            j = parents[j]
        out.append(s)
    return out


def encode_bits(all_parents: list[list[int]], n: int) -> torch.Tensor:
    """TreeBatch.ancestor_bits [R, n, W] int32 (bit j%32 of word j//32), written with explicit two's complement."""
    w = (n + 31) // 32
    bits = torch.zeros(len(all_parents), n, w, dtype=torch.int32)
    for r, parents in enumerate(all_parents):
        for i, anc in enumerate(ancestor_sets(parents)):
            words = [0] * w
            for j in anc:
                words[j // 32] |= 1 << (j % 32)
            bits[r, i] = torch.tensor([x - (1 << 32) if x >= 1 << 31 else x for x in words], dtype=torch.int32)
    return bits


class Case:
    """A batch of requests: contiguous ground-truth K/V per request, scattered into a shuffled paged cache."""

    def __init__(
        self, ctx_lens, q_lens, budget, hq, hkv, d, bs, dtype, seed, *, layout="nhd", causal=(), rows=None,
        pad_tokens=0, pad_reqs=0, parents=None,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.R = len(ctx_lens)
        self.ctx, self.qlen, self.n = list(ctx_lens), list(q_lens), budget + 1
        self.hq, self.hkv, self.d, self.bs, self.dtype = hq, hkv, d, bs, dtype
        self.causal = set(causal)
        seq = [c + q for c, q in zip(ctx_lens, q_lens)]
        nblk = [math.ceil(s / bs) for s in seq]
        max_blocks = max(nblk) + 1
        num_blocks = sum(nblk) + 7
        perm = torch.randperm(num_blocks, generator=gen)  # shuffled, non-contiguous physical blocks
        self.block_table = torch.full((self.R + pad_reqs, max_blocks), 10**6, dtype=torch.int32)  # junk past end
        used = 0
        for r in range(self.R):
            self.block_table[r, : nblk[r]] = perm[used : used + nblk[r]].int()
            used += nblk[r]
        if layout == "sep":
            self.k_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
            self.v_cache = torch.randn(num_blocks, bs, hkv, d, generator=gen).to(dtype)
        else:
            kv = torch.randn(num_blocks, hkv, bs, 2 * d, generator=gen).to(dtype)  # logical TRITON_ATTN shape
            if layout == "nhd":  # vLLM's default physical order (0, 2, 1, 3)
                kv = kv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            self.kv = kv
            self.k_cache, self.v_cache = triton_attn_kv_views(kv, d)
        self.keys, self.values = [], []
        for r in range(self.R):
            k = torch.randn(seq[r], hkv, d, generator=gen).to(dtype)
            v = torch.randn(seq[r], hkv, d, generator=gen).to(dtype)
            t = torch.arange(seq[r])
            blk = self.block_table[r, t // bs].long()
            self.k_cache[blk, t % bs] = k
            self.v_cache[blk, t % bs] = v
            self.keys.append(k)
            self.values.append(v)
        self.parents = parents or [random_parents(self.n, gen) for _ in range(self.R)]
        # tree_rows: request r -> TreeBatch row; causal requests get -1
        self.rows = list(rows) if rows is not None else list(range(self.R))
        for r in self.causal:
            self.rows[r] = -1
        n_tree = max([x for x in self.rows if x >= 0], default=-1) + 1
        tree_parents = [[-1] * self.n for _ in range(max(n_tree, 1))]
        for r in range(self.R):
            if self.rows[r] >= 0:
                tree_parents[self.rows[r]] = self.parents[r]
        self.bits = encode_bits(tree_parents, self.n)
        self.tree_rows = torch.tensor(self.rows + [-1] * pad_reqs, dtype=torch.int32)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.num_tokens = qsl[-1] + pad_tokens
        qsl += [qsl[-1]] * pad_reqs  # cudagraph-style padding: empty trailing requests
        self.qsl = torch.tensor(qsl, dtype=torch.int32)
        self.seq_lens = torch.tensor(seq + [0] * pad_reqs, dtype=torch.int32)
        self.q = torch.randn(self.num_tokens, hq, d, generator=gen).to(dtype)
        self.scale = d**-0.5

    def dense_reference(self) -> torch.Tensor:
        """float64, from contiguous K/V and ancestor sets (NaN rows outside every request)."""
        g = self.hq // self.hkv
        out = torch.full((self.num_tokens, self.hq, self.d), float("nan"), dtype=torch.float64)
        q0 = 0
        for r in range(self.R):
            c, n = self.ctx[r], self.qlen[r]
            anc = ancestor_sets(self.parents[r])
            mask = torch.zeros(n, c + n, dtype=torch.bool)
            mask[:, :c] = True
            for i in range(n):
                for j in range(n):
                    mask[i, c + j] = (j <= i) if r in self.causal else (j in anc[i])
            q = self.q[q0 : q0 + n].double()
            k = self.keys[r].double().repeat_interleave(g, 1)
            v = self.values[r].double().repeat_interleave(g, 1)
            s = torch.einsum("nhd,shd->hns", q, k) * self.scale
            s = s.masked_fill(~mask[None], float("-inf"))
            out[q0 : q0 + n] = torch.einsum("hns,shd->nhd", torch.softmax(s, -1), v)
            q0 += n
        return out

    def run_triton(self, use_rows=True, **kw) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))  # poison
        tree_attention(
            self.q, self.k_cache, self.v_cache, out, self.qsl, self.seq_lens, self.block_table, self.bits,
            self.scale, tree_rows=self.tree_rows if use_rows else None, **kw,
        )
        return out

    def run_torch(self, **kw) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        tree_attention_torch(
            self.q, self.k_cache, self.v_cache, out, self.qsl, self.seq_lens, self.block_table, self.bits,
            self.scale, tree_rows=self.tree_rows, **kw,
        )
        return out


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # relative L2 error


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, num_valid: int | None = None):
    n = ref.shape[0] if num_valid is None else num_valid
    o, rf = out[:n].double(), ref[:n]
    assert not torch.isnan(o).any(), "unwritten or NaN output rows"
    rel = ((o - rf).norm() / rf.norm()).item()
    assert rel < TOL[dtype], f"relative error {rel:.2e} >= {TOL[dtype]:.0e}"
    assert (o - rf).abs().max().item() < 50 * TOL[dtype] + 1e-5


# (dtype, G, head_size, block_size, budget): every value of each axis appears with several others.
COMBOS = [
    (torch.float32, 1, 64, 16, 7),
    (torch.float32, 2, 128, 32, 16),
    (torch.float32, 4, 64, 32, 63),
    (torch.float32, 2, 64, 16, 1),
    (torch.float32, 4, 80, 16, 7),  # non-power-of-2 head size
    (torch.float32, 3, 64, 16, 16),  # non-power-of-2 GQA ratio: padded rows in every tile
    (torch.bfloat16, 1, 128, 16, 16),
    (torch.bfloat16, 2, 64, 16, 63),
    (torch.bfloat16, 4, 128, 32, 7),
    (torch.bfloat16, 2, 64, 32, 1),
    (torch.float16, 4, 64, 16, 16),
    (torch.float16, 1, 64, 32, 63),
    (torch.float16, 2, 128, 16, 1),
]


@pytest.mark.parametrize("dtype,g,d,bs,budget", COMBOS, ids=lambda x: str(x).replace("torch.", ""))
def test_matches_dense_reference(dtype, g, d, bs, budget):
    hkv = 2
    c = Case(CTX_LENS, [budget + 1] * len(CTX_LENS), budget, g * hkv, hkv, d, bs, dtype, seed=budget * 31 + d + g)
    ref = c.dense_reference()
    assert_close(c.run_triton(), ref, dtype)
    assert_close(c.run_torch(), ref, dtype)


def test_torch_path_float64_is_exact():
    c = Case([3, 40], [8, 8], 7, 4, 2, 64, 16, torch.float64, seed=1)
    out = c.run_torch(compute_dtype=torch.float64)
    torch.testing.assert_close(out, c.dense_reference(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("splits", [2, 4])
def test_kv_splits(splits):
    c = Case([100, 1, 63], [9, 9, 9], 8, 4, 2, 64, 16, torch.float32, seed=splits)  # ctx 1: empty splits
    ref = c.dense_reference()
    assert_close(c.run_triton(num_kv_splits=splits), ref, torch.float32)
    ws = split_workspace(c.num_tokens, c.hq, c.d, splits, "cpu")
    assert_close(c.run_triton(num_kv_splits=splits, workspace=ws), ref, torch.float32)


def test_truncated_trees_and_row_mapping():
    """q_len < B+1 (the scheduler kept a prefix of the node list) and request r reading TreeBatch row != r."""
    c = Case([17, 15, 0, 33], [16, 5, 1, 9], 15, 4, 1, 64, 16, torch.float32, seed=7, rows=[3, 0, 2, 1])
    assert_close(c.run_triton(), c.dense_reference(), torch.float32)
    assert_close(c.run_torch(), c.dense_reference(), torch.float32)


def test_mixed_batch_with_causal_requests():
    """tree_rows = -1: plain causal rows (a prefill chunk longer than the tree, a 1-token decode) in one launch."""
    c = Case([0, 20, 17, 5], [40, 8, 1, 8], 7, 4, 2, 64, 16, torch.float32, seed=11, causal=(0, 2))
    ref = c.dense_reference()
    assert_close(c.run_triton(max_query_len=40), ref, torch.float32)
    assert_close(c.run_triton(), ref, torch.float32)  # tile shape tuned for the tree: still correct
    assert_close(c.run_torch(), ref, torch.float32)


def test_padded_grid_leaves_padding_untouched():
    """Static shapes: extra token rows and empty trailing requests (as under CUDA graphs) are not written."""
    c = Case([15, 17], [8, 8], 7, 4, 2, 64, 16, torch.float32, seed=3, pad_tokens=5, pad_reqs=2)
    out = c.run_triton()
    assert_close(out, c.dense_reference(), torch.float32, num_valid=16)
    assert torch.isnan(out[16:]).all()


def test_bit31_and_multiword():
    """A chain of 41 nodes sets bit 31 (negative int32 words) and spans two words."""
    chain = [list(range(-1, 40))]
    c = Case([5], [41], 40, 2, 2, 64, 16, torch.float32, seed=5, parents=chain)
    assert (c.bits[0, 40, 0] < 0).item()
    assert_close(c.run_triton(), c.dense_reference(), torch.float32)


def test_default_rows_and_hnd_layout():
    c = Case([17, 1, 15], [8, 8, 8], 7, 8, 2, 64, 32, torch.float32, seed=9, layout="hnd")
    assert_close(c.run_triton(use_rows=False), c.dense_reference(), torch.float32)


@pytest.mark.parametrize("block_m,tile,k_rows", [(16, 16, False), (64, 32, True), (32, 64, False), (128, 128, True)])
def test_tile_shapes(block_m, tile, k_rows):
    """Tiles smaller and larger than a KV block, both K load forms."""
    c = Case([100, 17], [17, 17], 16, 4, 1, 64, 32, torch.float32, seed=13)
    out = c.run_triton(block_m=block_m, tile_size=tile, k_rows=k_rows)
    assert_close(out, c.dense_reference(), torch.float32)


def test_ancestor_mask_decoding():
    parents = [[-1, 0, 0, 1, 3]]
    m = ancestor_mask(encode_bits(parents, 5)[0], 5)
    expect = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m, expect)


def test_refuses_unsupported():
    c = Case([4], [2], 1, 2, 2, 64, 16, torch.float32, seed=0)
    out = torch.empty_like(c.q)
    args = (c.q, c.k_cache, c.v_cache, out, c.qsl, c.seq_lens, c.block_table, c.bits, c.scale)
    with pytest.raises(NotImplementedError):
        tree_attention(*args, softcap=30.0)
    with pytest.raises(NotImplementedError):
        tree_attention(*args, sliding_window=128)
    with pytest.raises(NotImplementedError):
        tree_attention(c.q.half(), *args[1:])


def _cpu_reshape_and_cache():
    try:
        from vllm import _custom_ops as ops

        ops.cpu_attn_reshape_and_cache  # noqa: B018
        return ops
    except Exception:  # pragma: no cover - vLLM CPU ops unavailable
        return None


@pytest.mark.parametrize("isa,bs", [("vec16", 16), ("vec", 32)])
def test_cpu_attn_layout(isa, bs):
    """The PyTorch path reads the CPU engine's own cache (written by vLLM's CPU op) through strided views."""
    ops = _cpu_reshape_and_cache()
    if ops is None:
        pytest.skip("vLLM CPU ops not importable")
    hkv, d = 2, 64
    c = Case([17, 40], [8, 8], 7, 4, hkv, d, bs, torch.float32, seed=17, layout="sep")
    kv = torch.zeros(c.k_cache.shape[0], hkv, bs, 2 * d)
    kcv, vcv = kv.view(kv.shape[0], hkv, 2 * bs, d).chunk(2, dim=2)  # exactly what cpu_attn.py passes
    for r in range(c.R):
        seq = c.ctx[r] + c.qlen[r]
        t = torch.arange(seq)
        slots = (c.block_table[r, t // bs].long() * bs + t % bs).long()
        try:
            ops.cpu_attn_reshape_and_cache(c.keys[r], c.values[r], kcv, vcv, slots, isa)
        except Exception as e:  # pragma: no cover - ISA not built into this wheel
            pytest.skip(f"cpu_attn_reshape_and_cache({isa}) failed: {e}")
    kview, vview = cpu_attn_kv_views(kv)
    for r in range(c.R):
        seq = c.ctx[r] + c.qlen[r]
        t = torch.arange(seq)
        blk = c.block_table[r, t // bs].long()
        assert torch.equal(kview[blk, t % bs], c.keys[r])
        assert torch.equal(vview[blk, t % bs], c.values[r])
    out = torch.full_like(c.q, float("nan"))
    tree_attention_torch(c.q, kview, vview, out, c.qsl, c.seq_lens, c.block_table, c.bits, c.scale,
                         tree_rows=c.tree_rows)
    assert_close(out, c.dense_reference(), torch.float32)


def test_cpu_tree_backend_keeps_the_vector_cache_layout(monkeypatch):
    """Where vLLM picks AMX (bf16 on a CPU with AMX tiles), the ddtree engine's builder and layers take the vector
    ISA, whose cache layout ``cpu_attn_kv_views`` reads (AMX packs K otherwise); other picks stand."""
    from vllm.v1.attention.backends import cpu_attn

    from vllm_ddtree.attention import backend

    def picks_amx(self, *args, **kwargs):
        self.isa = "amx"

    for cls in (cpu_attn.CPUAttentionMetadataBuilder, cpu_attn.CPUAttentionBackendImpl):
        monkeypatch.setattr(cls, "__init__", picks_amx)
    tree = backend.TreeCPUAttentionBackend
    assert [cls().isa for cls in (tree.get_builder_cls(), tree.get_impl_cls())] == ["vec", "vec"]
    assert [backend.vector_cache_isa(isa) for isa in ("vec", "vec16", "neon")] == ["vec", "vec16", "neon"]


def test_shared_workspace_is_fixed_and_lowers_splits(monkeypatch):
    """Without a caller workspace every call uses one fixed allocation (CUDA graphs keep the addresses they saw);
    a split factor that would not fit it is lowered, and the result stays exact."""
    from vllm_ddtree.attention import triton_tree

    c = Case([100, 63], [9, 9], 8, 4, 2, 64, 16, torch.float32, seed=21)
    monkeypatch.setattr(triton_tree, "WORKSPACE_ROWS", c.num_tokens * 2)
    monkeypatch.setattr(triton_tree, "_WORKSPACES", {})
    first = triton_tree.allocate_workspace(c.hq, c.d, "cpu")
    ref = c.dense_reference()
    assert_close(c.run_triton(num_kv_splits=8), ref, torch.float32)  # lowered to 2
    assert_close(c.run_triton(num_kv_splits=2), ref, torch.float32)
    assert triton_tree.allocate_workspace(c.hq, c.d, "cpu")[0].data_ptr() == first[0].data_ptr()
    assert first[0].shape[0] == c.num_tokens * 2


def test_graph_capture_warmup_shapes():
    """vLLM warms captured graphs up with seq_lens 1 (< q_len): the kernel must stay in bounds, reading only each
    request's first key (the clamped prefix is empty, so every row sees exactly key 0)."""
    c = Case([40, 17], [9, 9], 8, 4, 2, 64, 16, torch.float32, seed=23, causal=(1,))
    c.seq_lens.fill_(1)
    out = c.run_triton()
    g = c.hq // c.hkv
    for r in range(c.R):
        first_value = c.values[r][0].repeat_interleave(g, 0)  # [Hq, D]
        torch.testing.assert_close(out[9 * r : 9 * (r + 1)], first_value.expand(9, -1, -1))


@pytest.mark.parametrize("backend_name", ["flash", "triton"])
def test_gpu_backends_route_only_tree_rows_through_the_tree_kernel(monkeypatch, backend_name):
    """The GPU backends (vLLM's FlashAttention or Triton, subclassed): a full verify batch (query length one of the
    verify widths, the shape vLLM captures in full graphs) runs the tree kernel on every row, reading which requests
    verify a tree from the static ``tree_rows`` (-1 = causal); any other forward is vLLM's kernel, after which, with
    a verify step in flight, only the tree requests' rows are recomputed. A prefill batch whose longest query has a
    verify width is vLLM's (no-spec's prefill). Other layers (the drafter's) and the profiling run (no metadata) are
    vLLM's attention only."""
    from types import SimpleNamespace

    from vllm_ddtree.attention import backend
    from vllm_ddtree.verify_core import TreeAttentionInputs

    impl_cls = {"flash": backend.TreeFlashAttentionImpl, "triton": backend.TreeTritonAttentionImpl}[backend_name]
    vllm_impl = impl_cls.__mro__[2]  # the vLLM class the tree subclass extends
    c = Case([17, 30], [8, 8], 7, 4, 2, 64, 16, torch.float32, seed=29, causal=(0,))
    impl = impl_cls.__new__(impl_cls)
    impl.num_heads, impl.head_size, impl.scale = c.hq, c.d, c.scale
    impl.attn_type = backend.AttentionType.DECODER
    impl.vllm_flash_attn_version = None  # the tree kernel on every key (the prefix split: the test below)
    tree_rows = torch.full((4,), -1, dtype=torch.int32)
    tree_rows[1] = 1  # request 1 verifies the tree in row 1; request 0 is causal
    inputs = TreeAttentionInputs(c.bits, tree_rows, frozenset({8}))
    metadata = SimpleNamespace(
        num_actual_tokens=c.num_tokens, seq_lens=c.seq_lens, query_start_loc=c.qsl, block_table=c.block_table,
        max_query_len=8,
    )
    calls = []

    def vllm_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        calls.append(attn_metadata)
        return output.fill_(7.0)  # a value no attention output has here

    monkeypatch.setattr(vllm_impl, "forward", vllm_forward)

    def forward(metadata):
        out = torch.full_like(c.q, float("nan"))
        return impl.forward(None, c.q, None, None, c.kv, metadata, out)

    reference = c.dense_reference()
    assert forward(metadata).eq(7.0).all() and len(calls) == 1  # not a target layer: vLLM's
    impl.tree_inputs = inputs
    assert forward(None).eq(7.0).all() and len(calls) == 2  # profiling run: vLLM's
    inputs.step = SimpleNamespace(chain=False)  # a verify step in flight
    assert_close(forward(metadata), reference, torch.float32)  # a full verify batch: the tree kernel, every row
    assert len(calls) == 2
    from vllm_ddtree.attention import triton_tree

    kernel_calls = []
    real_kernel = triton_tree.tree_attention

    def spy(*args, **kwargs):
        kernel_calls.append(kwargs)
        return real_kernel(*args, **kwargs)

    monkeypatch.setattr(triton_tree, "tree_attention", spy)
    other_width = SimpleNamespace(**{**vars(metadata), "max_query_len": 9})
    tree_rows[1] = -1  # as outside every verify forward
    inputs.step = None
    # No verify step in flight, a verify width (a prefill batch, or vLLM's warm-up before a full-graph capture):
    # vLLM's output; the first such call runs the full variant once into a scratch output and the tree-rows variant
    # once (every row -1: it writes nothing), so that both are compiled before capture and serving.
    assert forward(metadata).eq(7.0).all() and len(calls) == 3
    assert [k["tree_rows_only"] for k in kernel_calls] == [False, True]
    assert forward(metadata).eq(7.0).all() and len(calls) == 4 and len(kernel_calls) == 2
    assert forward(other_width).eq(7.0).all() and len(calls) == 5 and len(kernel_calls) == 2
    tree_rows[1] = 1
    inputs.step = SimpleNamespace(chain=False)
    mixed = forward(other_width)
    assert len(calls) == 6 and len(kernel_calls) == 3
    assert mixed[:8].eq(7.0).all()  # the causal request keeps vLLM's output
    assert_close(mixed[8:], reference[8:], torch.float32)  # the tree request's rows are the tree kernel's
    # Tree rows only: the tile shape follows the tree's width (1 + B), not the batch's longest query.
    assert [k["tree_rows_only"] for k in kernel_calls] == [False, True, True]
    assert [k["max_query_len"] for k in kernel_calls[1:]] == [c.bits.shape[1]] * 2
    # A chain step (the chain fallback, every row causal, its width no verify width): vLLM's kernel only.
    tree_rows[1] = -1
    inputs.step = SimpleNamespace(chain=True)
    assert forward(other_width).eq(7.0).all() and len(calls) == 7 and len(kernel_calls) == 3


def prefix_attention(c: Case, empty_lse: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What FlashAttention computes for the prefix split: each row's softmax over its request's keys ``< ctx``
    (non-causal), in the query dtype, and its natural log-sum-exp ``[Hq, T]`` float32; rows without a prefix get
    output 0 and ``empty_lse`` (FlashAttention 3 writes -inf, FlashAttention 2 +inf)."""
    g = c.hq // c.hkv
    out = torch.zeros_like(c.q)
    lse = torch.full((c.hq, c.num_tokens + 3), float("nan"))[:, : c.num_tokens]  # strided, like a sliced buffer
    q0 = 0
    for r in range(c.R):
        ctx, n = c.ctx[r], c.qlen[r]
        if ctx == 0:
            lse[:, q0 : q0 + n] = empty_lse
        else:
            k = c.keys[r][:ctx].double().repeat_interleave(g, 1)
            v = c.values[r][:ctx].double().repeat_interleave(g, 1)
            s = torch.einsum("nhd,shd->hns", c.q[q0 : q0 + n].double(), k) * c.scale
            out[q0 : q0 + n] = torch.einsum("hns,shd->nhd", torch.softmax(s, -1), v).to(c.dtype)
            lse[:, q0 : q0 + n] = torch.logsumexp(s, -1).float()
        q0 += n
    return out, lse


@pytest.mark.parametrize("dtype,empty_lse", [(torch.float32, float("-inf")), (torch.bfloat16, float("inf")),
                                             (torch.float32, float("nan"))], ids=["fp32-fa3", "bf16-fa2", "nan"])
def test_merges_a_prefix_attended_elsewhere(dtype, empty_lse):
    """``prefix_lse``: ``out`` holds FlashAttention's attention over each request's prefix and the kernel adds this
    step's block in place (tree rows through their ancestors, causal rows causally; an empty prefix, whichever way
    FlashAttention marks it, adds nothing). Padded token rows stay untouched."""
    c = Case([0, 1, 15, 17, 100, 40], [17, 17, 17, 9, 17, 17], 16, 4, 2, 64, 16, dtype, seed=37, causal=(1, 4),
             pad_tokens=3)
    ref = c.dense_reference()
    out, lse = prefix_attention(c, empty_lse)
    out[-3:] = float("nan")
    tree_attention(c.q, c.k_cache, c.v_cache, out, c.qsl, c.seq_lens, c.block_table, c.bits, c.scale,
                   tree_rows=c.tree_rows, prefix_lse=lse)
    assert_close(out, ref, dtype, num_valid=c.num_tokens - 3)
    assert torch.isnan(out[-3:]).all()
    # Without the prefix's state the rows are wrong: the merge is what makes them right.
    blind = torch.zeros_like(c.q)
    tree_attention(c.q, c.k_cache, c.v_cache, blind, c.qsl, c.seq_lens, c.block_table, c.bits, c.scale,
                   tree_rows=c.tree_rows, prefix_lse=torch.full_like(lse, float("-inf")))
    assert not torch.allclose(blind[17:34].double(), ref[17:34], atol=1e-2)


def fake_flash_attn_varlen_func(*, q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale,
                                causal, block_table, return_softmax_lse, scheduler_metadata, fa_version, num_splits):
    """FlashAttention 3's paged varlen call, non-causal, in PyTorch: each request's queries over its first
    ``seqused_k`` keys; returns (out, lse [Hq, T]) with lse -inf where a request has no key."""
    assert not causal and return_softmax_lse
    hq, g = q.shape[1], q.shape[1] // k.shape[2]
    lse = torch.full((hq, q.shape[0]), float("-inf"))
    for r in range(seqused_k.shape[0]):
        q0, q1, n = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1]), int(seqused_k[r])
        out[q0:q1] = 0
        if n == 0 or q1 == q0:
            continue
        t = torch.arange(n)
        blk = block_table[r, t // k.shape[1]].long()
        keys = k[blk, t % k.shape[1]].double().repeat_interleave(g, 1)
        values = v[blk, t % k.shape[1]].double().repeat_interleave(g, 1)
        s = torch.einsum("nhd,shd->hns", q[q0:q1].double(), keys) * softmax_scale
        out[q0:q1] = torch.einsum("hns,shd->nhd", torch.softmax(s, -1), values).to(out.dtype)
        lse[:, q0:q1] = torch.logsumexp(s, -1).float()
    return out, lse


def test_flash_backend_attends_the_prefix_on_flash_attention(monkeypatch):
    """FLASH_ATTN's full verify batch: vLLM's FlashAttention over each request's committed prefix (its ``seqused_k``
    from seq_lens minus the query length, clamped at 0 for the graph warm-up's seq_lens 1), the tree kernel merging
    this step's block; the prefix lengths and FlashAttention 3's scheduler metadata for them (non-causal, this
    call's shapes) are computed once per forward (metadata object; the capture half of that key needs CUDA) and the
    metadata reaches every layer's call (none under VLLM_BATCH_INVARIANT, as in vLLM's builder).
    ``VLLM_DDTREE_TREE_KERNEL_PREFIX=1`` and FlashAttention 2 and 4 keep the tree kernel on every key."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends import flash_attn

    from vllm_ddtree.attention import backend, triton_tree
    from vllm_ddtree.verify_core import TreeAttentionInputs

    c = Case([17, 30, 0], [8, 8, 8], 7, 4, 2, 64, 16, torch.float32, seed=41, causal=(0,))
    impl = backend.TreeFlashAttentionImpl.__new__(backend.TreeFlashAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = c.hq, c.hkv, c.d, c.scale
    impl.attn_type, impl.vllm_flash_attn_version = backend.AttentionType.DECODER, 3
    impl.tree_inputs = TreeAttentionInputs(c.bits, c.tree_rows, frozenset({8}))
    impl.tree_inputs.step = SimpleNamespace(chain=False)  # a verify step in flight
    fa_calls, kernel_calls, schedules = [], [], []

    def fake(**kwargs):
        fa_calls.append(kwargs["seqused_k"].tolist())
        assert kwargs["scheduler_metadata"] is (schedules[-1][1] if schedules else None)
        return fake_flash_attn_varlen_func(**kwargs)

    def fake_schedule(**kwargs):
        schedules.append((kwargs, object()))
        return schedules[-1][1]

    def spy(*args, **kwargs):
        kernel_calls.append(kwargs.get("prefix_lse") is not None)
        return real_kernel(*args, **kwargs)

    real_kernel = triton_tree.tree_attention
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", fake, raising=False)
    monkeypatch.setattr(flash_attn, "get_scheduler_metadata", fake_schedule, raising=False)
    monkeypatch.setattr(triton_tree, "tree_attention", spy)

    def metadata():
        return SimpleNamespace(num_actual_tokens=c.num_tokens, seq_lens=c.seq_lens, query_start_loc=c.qsl,
                               block_table=c.block_table, max_query_len=8, max_seq_len=38, max_num_splits=0)

    def forward(md):
        out = torch.full_like(c.q, float("nan"))
        return impl.forward(None, c.q, None, None, c.kv, md, out)

    reference = c.dense_reference()
    md = metadata()
    assert_close(forward(md), reference, torch.float32)
    assert fa_calls == [[17, 30, 0]] and kernel_calls == [True]
    (schedule_args, _), = schedules
    assert schedule_args["cache_seqlens"].tolist() == [17, 30, 0] and schedule_args["causal"] is False
    assert (schedule_args["batch_size"], schedule_args["max_seqlen_q"], schedule_args["max_seqlen_k"]) == (3, 8, 38)
    assert (schedule_args["num_heads_q"], schedule_args["num_heads_kv"], schedule_args["headdim"]) == (c.hq, c.hkv, c.d)
    assert schedule_args["page_size"] == c.bs and schedule_args["cu_seqlens_q"] is not None
    first = inputs_lens(impl)
    forward(md)  # another layer of the same forward: the same prefix lengths and schedule
    assert inputs_lens(impl) is first and len(fa_calls) == 2 and len(schedules) == 1
    forward(metadata())
    assert inputs_lens(impl) is not first and len(schedules) == 2  # a new forward computes them again
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    schedules.clear()
    forward(metadata())
    assert schedules == []
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    warmup = metadata()
    warmup.seq_lens = torch.ones_like(c.seq_lens)
    forward(warmup)
    assert fa_calls[-1] == [0, 0, 0]
    monkeypatch.setenv(backend.TREE_KERNEL_PREFIX_ENV, "1")
    assert_close(forward(metadata()), reference, torch.float32)
    monkeypatch.delenv(backend.TREE_KERNEL_PREFIX_ENV)
    for version in (2, 4):
        impl.vllm_flash_attn_version = version
        assert_close(forward(metadata()), reference, torch.float32)
    assert len(fa_calls) == 5 and kernel_calls[-3:] == [False] * 3


def inputs_lens(impl) -> torch.Tensor:
    return impl.tree_inputs.prefix_of_forward[2]
