"""The tree core's Triton kernels compiled for the GPU against their PyTorch references (tests/unit runs them through
the interpreter, whose integer and bit arithmetic is numpy's: the compiled code must agree too)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QWEN3_VOCAB = 151936


@pytest.mark.parametrize("budget,k", [(16, 16), (32, 32), (64, 64)])
def test_topk_and_normaliser(budget: int, k: int) -> None:
    from vllm_ddtree.tree.build import per_depth_topk
    from vllm_ddtree.tree.logsumexp import row_logsumexp

    gen = torch.Generator(device="cuda").manual_seed(budget)
    for rows, dtype in ((1, torch.bfloat16), (8, torch.bfloat16), (2, torch.float32)):
        logits = (torch.randn(rows, 15, QWEN3_VOCAB, generator=gen, device="cuda") * 4).to(dtype)
        logits[0, 0, :1000] = float("-inf")
        want = torch.logsumexp(logits.float(), dim=-1)
        assert torch.allclose(row_logsumexp(logits, use_triton=True), want, rtol=0, atol=1e-4)
        ref_values, ref_ids = per_depth_topk(logits, k, method="torch")
        kth = ref_values[..., -1:]
        clear = ~((ref_values == kth).sum(-1) > 1)  # no tie at the k-th value: the same tokens, in the same order
        for method in ("chunks", "threshold"):
            values, ids = per_depth_topk(logits, k, method=method)
            assert torch.allclose(values, ref_values, rtol=0, atol=1e-4), method
            assert torch.equal(ids[clear], ref_ids[clear]), method


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_build_and_walk(budget: int) -> None:
    from vllm_ddtree.sampler import walk_tree
    from vllm_ddtree.tree.build import build_tree
    from vllm_ddtree.tree.layout import TreeBatch
    from vllm_ddtree.walk_triton import walk_tree_triton

    gen = torch.Generator(device="cuda").manual_seed(budget + 1)
    rows, depth, vocab = 8, 15, 2000
    logits = torch.randn(rows, depth, vocab, generator=gen, device="cuda") * 5
    roots = torch.randint(0, vocab, (rows,), generator=gen, device="cuda")
    torch_tree, triton_tree = (TreeBatch.allocate(rows, budget, "cuda") for _ in range(2))
    build_tree(logits, budget, torch_tree, roots, use_triton=False)
    build_tree(logits, budget, triton_tree, roots, use_triton=True)
    for name in ("token_ids", "parents", "depths", "ancestor_bits", "num_nodes"):
        assert torch.equal(getattr(torch_tree, name), getattr(triton_tree, name)), name
    # Target tokens that follow the tree often: each node's token is the first child's half the time.
    node_tokens = torch.randint(0, vocab, (rows, budget + 1), generator=gen, device="cuda")
    parents = torch_tree.parents.long()
    for r in range(rows):
        for child in range(budget, 0, -1):  # the last write wins: the lowest-numbered child
            if parents[r, child] >= 0 and torch.rand((), generator=gen, device="cuda") < 0.7:
                node_tokens[r, parents[r, child]] = torch_tree.token_ids[r, child]
    want, got = walk_tree(node_tokens, torch_tree, depth), walk_tree_triton(node_tokens, torch_tree, depth)
    assert int(want.num_accepted.max()) >= 2
    for name in ("output_token_ids", "accepted_node_ids", "num_accepted"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name


@pytest.mark.parametrize("rows,cols,keep", [(1, 280, 64), (8, 300, 64), (8, 960, 64), (2, 1920, 128)])
def test_beam_sort(rows: int, cols: int, keep: int) -> None:
    """The beam's Triton sort compiled, against torch's stable descending sort on the CPU (CUDA's radix sort orders
    -0.0 before +0.0; the CPU's compares them equal, as the kernel does)."""
    from vllm_ddtree.tree.sort_triton import sort_desc_triton

    gen = torch.Generator().manual_seed(cols)
    scores = -torch.randint(0, 6, (rows, cols), generator=gen).float() * 0.5
    scores[:, ::5] = -torch.rand(rows, len(range(0, cols, 5)), generator=gen) * 40
    scores[:, 1::11] = float("-inf")
    scores[:, 2::13] = -0.0
    want_values, want_order = torch.sort(scores, dim=1, descending=True, stable=True)
    got_values, got_order = sort_desc_triton(scores.cuda(), keep)
    assert torch.equal(got_order.cpu(), want_order[:, :keep])
    assert torch.equal(got_values.cpu().view(torch.int32), scores.gather(1, want_order[:, :keep]).view(torch.int32))


@pytest.mark.parametrize("chain_step", [False, True], ids=["trees", "chains"])
def test_prepare_rows(chain_step: bool) -> None:
    check_prepare_rows("cuda", chain_step)


def check_prepare_rows(device: str, chain_step: bool) -> None:
    """The verify step's prepare, compiled, against its PyTorch reference on every output: four requests with fresh
    trees (one fed fewer drafts, one fed a draft that is not its tree's: refused), in batch order != slot order; a
    chain step (the chain fallback) swaps each fresh request's chain into its fed drafts."""
    from vllm_ddtree.tree.build import build_tree
    from vllm_ddtree.tree.layout import TreeBatch
    from vllm_ddtree.tree_handover import TreeHandover
    from vllm_ddtree.verify_rows import TREE_FIELDS, RowBuffers, RowInputs, prepare_rows_torch, prepare_rows_triton

    budget, depth, vocab, max_reqs = 16, 15, 2000, 8
    gen = torch.Generator(device=device).manual_seed(7)
    slots = torch.tensor([5, 2, 7, 0], device=device)
    handover = TreeHandover(max_reqs, budget, torch.device(device), depth)
    trees, chains = TreeBatch.allocate(4, budget, device), torch.zeros(4, depth, dtype=torch.int64, device=device)
    roots = torch.randint(0, vocab, (4,), generator=gen, device=device)
    build_tree(torch.randn(4, depth, vocab, generator=gen, device=device) * 5, budget, trees, roots, chain_out=chains)
    handover.file(slots, trees, 4, chains)
    widest = depth if chain_step else budget
    fed = [widest, widest - 6, widest, widest]
    cu = torch.tensor([0, *torch.tensor(fed).add(1).cumsum(0).tolist()], dtype=torch.int32, device=device)
    num_tokens = int(cu[-1])
    input_ids = torch.cat([trees.token_ids[r, : n + 1] for r, n in enumerate(fed)]).to(torch.int32)
    input_ids[int(cu[2]) + 3] += 1  # request 2 was fed a draft that is not its tree's
    positions = torch.cat([torch.arange(n + 1, device=device) + 40 * r for r, n in enumerate(fed)])
    outputs = []
    for prepare in (prepare_rows_triton, prepare_rows_torch):
        rows = RowInputs(slots, cu, torch.arange(num_tokens, device=device), input_ids.clone(), positions.clone(),
                         None, 4, num_tokens)
        stamp, verify = handover.stamp.clone(), TreeBatch.allocate(max_reqs, budget, device)
        tree_rows = torch.full((max_reqs,), 3, dtype=torch.int32, device=device)
        prepared = prepare(rows, handover.trees, stamp, handover.epoch, verify, tree_rows,
                           RowBuffers(max_reqs, 64, torch.device(device)), handover.chains, chain_step)
        outputs.append((prepared, rows, stamp, verify, tree_rows))
    (kernel, k_rows, k_stamp, k_verify, k_tree_rows), (ref, r_rows, r_stamp, r_verify, r_tree_rows) = outputs
    assert kernel.has_tree.tolist() == ref.has_tree.tolist() == [True, True, False, True]
    for name in ("shift", "row_request", "row_node", "root_rows", "row_starts", "refused_fresh"):
        assert torch.equal(getattr(kernel, name), getattr(ref, name)), name
    for name in (*TREE_FIELDS, "num_nodes"):
        assert torch.equal(getattr(k_verify, name)[:4], getattr(r_verify, name)[:4]), name
    assert torch.equal(k_rows.input_ids, r_rows.input_ids) and torch.equal(k_rows.positions, r_rows.positions)
    assert torch.equal(k_stamp, r_stamp) and torch.equal(k_tree_rows, r_tree_rows)
    if chain_step:
        assert k_tree_rows.eq(-1).all() and torch.equal(k_rows.positions, positions)
        assert k_rows.input_ids[1 : 1 + depth].tolist() == chains[0].tolist()
        bits = ancestor_words(depth, budget, device)
        assert torch.equal(k_verify.ancestor_bits[0], bits)
    else:
        assert k_tree_rows.tolist() == [0, 1, -1, 3, -1, -1, -1, -1] and torch.equal(k_rows.input_ids, input_ids)


def ancestor_words(depth: int, budget: int, device: str) -> torch.Tensor:
    """A chain's ancestor bits [B + 1, W]: node i holds bits 0..i, nodes past the chain none."""
    from vllm_ddtree.tree.build import ancestor_bits_from_parents

    parents = torch.tensor([[-1, *range(depth)] + [-1] * (budget - depth)], device=device)
    bits = ancestor_bits_from_parents(parents, depth)[0]
    bits[depth + 1 :] = 0
    return bits
