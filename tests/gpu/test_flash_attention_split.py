"""FLASH_ATTN's verify batch on a GPU: FlashAttention 3 over each request's committed prefix, with the scheduler
metadata ddtree computes for that call, then the tree kernel over the step's block, merged (attention/backend.py),
against the float64 dense reference; eagerly, without the scheduler metadata, and replayed from a CUDA graph with new
queries. The CPU suite checks the same routing with FlashAttention replaced by PyTorch
(tests/unit/test_tree_attention.py); only a GPU runs the real call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fa3_impl(case):
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from vllm_ddtree.attention import backend
    from vllm_ddtree.verify_core import TreeAttentionInputs

    if get_flash_attn_version() != 3:
        pytest.skip("needs FlashAttention 3 (Hopper)")
    impl = backend.TreeFlashAttentionImpl.__new__(backend.TreeFlashAttentionImpl)
    impl.num_heads, impl.num_kv_heads, impl.head_size, impl.scale = case.hq, case.hkv, case.d, case.scale
    impl.attn_type, impl.vllm_flash_attn_version = backend.AttentionType.DECODER, 3
    impl.tree_inputs = TreeAttentionInputs(case.bits.cuda(), case.tree_rows.cuda(), frozenset({case.qlen[0]}))
    impl.tree_inputs.step = object()  # a verify step in flight
    return impl


def metadata(case, num_splits: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_actual_tokens=case.num_tokens, seq_lens=case.seq_lens.cuda(), query_start_loc=case.qsl.cuda(),
        block_table=case.block_table.cuda(), max_query_len=max(case.qlen), max_seq_len=int(case.seq_lens.max()),
        max_num_splits=num_splits,
    )


@pytest.mark.parametrize("ctx", [[0, 17, 300, 2055], [1500]], ids=["batch4", "batch1"])
def test_flash_attention_split_equals_the_dense_reference(ctx, monkeypatch):
    from test_tree_attention import Case, assert_close

    budget = 16
    case = Case(ctx, [budget + 1] * len(ctx), budget, 8, 2, 128, 16, torch.bfloat16, seed=43,
                causal=(0,) if len(ctx) > 1 else ())
    impl = fa3_impl(case)
    kv = case.kv.cuda()
    reference = case.dense_reference()

    def forward(q, md, out=None):
        out = torch.full_like(q, float("nan")) if out is None else out
        return impl.forward(None, q, None, None, kv, md, out)

    q = case.q.cuda()
    assert_close(forward(q, metadata(case, 0)).cpu(), reference, case.dtype)
    assert impl.tree_inputs.prefix_of_forward[3] is not None  # the scheduler metadata was computed and used
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # no scheduler metadata: FlashAttention 3 schedules itself
    assert_close(forward(q, metadata(case, 0)).cpu(), reference, case.dtype)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")

    # Captured once (with vLLM's split bound for graphs), replayed with other queries in the same buffers.
    static_q, static_out, md = q.clone(), torch.empty_like(q), metadata(case, 32)
    forward(static_q, md, static_out)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward(static_q, md, static_out)
    for seed in (1, 2):
        case.q = torch.randn(case.q.shape, generator=torch.Generator().manual_seed(seed)).to(case.dtype)
        static_q.copy_(case.q.cuda())
        static_out.fill_(float("nan"))
        graph.replay()
        assert_close(static_out.cpu(), case.dense_reference(), case.dtype)
