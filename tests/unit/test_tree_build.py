"""Device tree build (vllm_ddtree/tree/build.py) against the heap reference, node for node, in pop order: the PyTorch
build (the CPU engine's), the same with its sorts in Triton (CUDA's for B > 32) and the one-launch Triton build
(CUDA's for B <= 32; Triton through TRITON_INTERPRET here, tests/unit/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_ddtree.tree.build import (
    ancestor_bits_from_parents,
    build_chain,
    build_tree,
    build_tree_from_topk,
    fill_chains,
    per_depth_topk,
    sort_descending,
)
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree.reference import ancestor_sets_from_bits, brute_force_tree, heap_tree

GARBAGE_ROWS = 1  # a row past the live batch, which the build must leave alone
BUILDS = pytest.mark.parametrize("build", [{"use_triton": False}, {"use_triton": True}], ids=["torch", "triton"])
# The PyTorch beam with its sorts in Triton (CUDA's build for B > 32): the interpreter takes about 0.7 s per row and
# sort, so it gets its own small cases below instead of every case above.
TRITON_SORT = {"use_triton": False, "triton_sort": True}


def poisoned_batch(rows: int, budget: int, seed: int) -> TreeBatch:
    """A TreeBatch full of random junk, so nothing stale can pass for a right answer."""
    gen = torch.Generator().manual_seed(seed)
    batch = TreeBatch.allocate(rows, budget, "cpu")
    for t in (batch.token_ids, batch.parents, batch.depths, batch.ancestor_bits, batch.num_nodes):
        t.copy_(torch.randint(-(2**31), 2**31 - 1, t.shape, generator=gen, dtype=torch.int64).to(t.dtype))
    return batch


def check_against_heap(logits: torch.Tensor, budget: int, out_budget: int | None = None, seed: int = 0,
                       build: dict | None = None) -> None:
    """Build on the device path and compare every field of every live row with the heap reference."""
    rows, depth, vocab = logits.shape
    out_budget = out_budget or budget
    out = poisoned_batch(rows + GARBAGE_ROWS, out_budget, seed)
    untouched = [t[rows:].clone() for t in (out.token_ids, out.parents, out.depths, out.ancestor_bits)]
    roots = torch.randint(0, vocab, (rows,))
    build_tree(logits, budget, out, roots, **(build or {}))

    top_logp, top_ids = per_depth_topk(logits, min(budget, vocab))
    for r in range(rows):
        ref = heap_tree(top_logp[r].tolist(), top_ids[r].tolist(), budget)
        n = ref.num_nodes
        assert int(out.num_nodes[r]) == n
        assert out.token_ids[r, 0] == roots[r]
        assert out.token_ids[r, 1 : n + 1].tolist() == ref.tokens[1:]
        assert out.parents[r, : n + 1].tolist() == ref.parents
        assert out.depths[r, : n + 1].tolist() == ref.depths
        assert ancestor_sets_from_bits(out.ancestor_bits[r, : n + 1].tolist()) == ref.ancestors
        assert all(0 <= p < i for i, p in enumerate(ref.parents[1:], start=1))  # parent < child
        # Padding past the tree: token 0, parent -1, depth -1, no ancestor bits.
        assert out.token_ids[r, n + 1 :].eq(0).all()
        assert out.parents[r, n + 1 :].eq(-1).all()
        assert out.depths[r, n + 1 :].eq(-1).all()
        assert out.ancestor_bits[r, n + 1 :].eq(0).all()
        # Siblings never repeat a token (the walk relies on it).
        pairs = list(zip(ref.parents[1:], ref.tokens[1:]))
        assert len(set(pairs)) == len(pairs)
    for before, t in zip(untouched, (out.token_ids, out.parents, out.depths, out.ancestor_bits)):
        assert torch.equal(before, t[rows:])


@BUILDS
@pytest.mark.parametrize("budget", [1, 2, 8, 15, 32, 64, 128])
@pytest.mark.parametrize("vocab_vs_budget", ["vocab_below_budget", "vocab_above_budget"])
def test_build_matches_heap_random(budget: int, vocab_vs_budget: str, build: dict) -> None:
    gen = torch.Generator().manual_seed(1000 * budget + len(vocab_vs_budget))
    vocab = max(2, budget // 3) if vocab_vs_budget == "vocab_below_budget" else 2 * budget + 37
    for depth in (1, 5, 16):
        logits = torch.randn(3, depth, vocab, generator=gen) * 2.5
        check_against_heap(logits, budget, seed=budget + depth, build=build)


@BUILDS
@pytest.mark.parametrize("budget", [8, 32, 128])
def test_build_matches_heap_exact_ties(budget: int, build: dict) -> None:
    """Quantised logits (many equal log-probs, equal path scores) and one-hot rows (log-prob exactly 0)."""
    gen = torch.Generator().manual_seed(budget)
    for vocab in (3, 7, 300):
        quantised = torch.randint(-2, 3, (3, 16, vocab), generator=gen).float()
        check_against_heap(quantised, budget, seed=vocab, build=build)
        one_hot = torch.full((3, 16, vocab), -1e4)
        one_hot[:, :, 1] = 0.0  # every depth certain: lp = 0, so whole chains tie with their parents
        one_hot[1, ::2] = torch.randint(0, 2, (8, vocab), generator=gen).float()  # mixed exact ties
        check_against_heap(one_hot, budget, seed=vocab + 1, build=build)
        uniform = torch.zeros(2, 16, vocab)  # everything ties everywhere
        check_against_heap(uniform, budget, seed=vocab + 2, build=build)


@BUILDS
def test_build_matches_heap_float_rounding_ties(build: dict) -> None:
    """Scores that differ before float32 rounding but coincide after it (huge and tiny log-probs mixed).

    This is where a lexicographic rank-tuple tie-break would let a beam drop a prefix; ours must not.
    """
    gen = torch.Generator().manual_seed(7)
    budget, depth, k, rows = 64, 8, 64, 24
    exponents = torch.randint(-30, 26, (rows, depth, k), generator=gen).float()
    jitter = 1 + torch.randint(0, 4, (rows, depth, k), generator=gen).float() * 2.0**-23
    top_logp = -(2.0**exponents) * jitter
    top_logp[:, :, 0] = torch.where(torch.rand(rows, depth, generator=gen) < 0.3, 0.0, top_logp[:, :, 0])
    top_logp = torch.sort(top_logp, dim=-1, descending=True).values
    top_ids = torch.stack([torch.randperm(1000, generator=gen)[:k] for _ in range(rows * depth)]).view(rows, depth, k)
    out = poisoned_batch(rows, budget, 3)
    build_tree_from_topk(top_logp, top_ids, budget, out, torch.zeros(rows, dtype=torch.int64), **build)
    for r in range(rows):
        ref = heap_tree(top_logp[r].tolist(), top_ids[r].tolist(), budget)
        assert out.token_ids[r, 1:].tolist() == ref.tokens[1:]
        assert out.parents[r].tolist() == ref.parents


@BUILDS
def test_budget_below_buffer_and_tiny_trees_pad(build: dict) -> None:
    """Budget smaller than the TreeBatch, and trees smaller than the budget (V^1 + ... + V^L < B)."""
    gen = torch.Generator().manual_seed(5)
    check_against_heap(torch.randn(2, 4, 50, generator=gen), budget=20, out_budget=64, build=build)
    check_against_heap(torch.randn(2, 3, 2, generator=gen), budget=32, out_budget=40,  # 2 + 4 + 8 = 14 nodes
                       build=build)
    check_against_heap(torch.randn(2, 16, 1, generator=gen), budget=32, build=build)  # a chain of 16


def path_scores(tree: TreeBatch, logits: torch.Tensor, rows: int, n: int) -> list[list[float]]:
    """Each node's path log-probability (root 0), for the first n nodes of each row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    scores = []
    for r in range(rows):
        s = [0.0]
        for i in range(1, n):
            s.append(s[int(tree.parents[r, i])] + float(logp[r, int(tree.depths[r, i]) - 1, int(tree.token_ids[r, i])]))
        scores.append(s)
    return scores


@pytest.mark.parametrize("quantised", [False, True])
def test_first_b_nodes_are_the_tree_of_budget_b(quantised: bool) -> None:
    """The adaptive budget verifies the first b nodes of the budget-B tree (vLLM's dynamic speculation schedule
    truncates the drafts). In best-first order they are the tree that budget b builds; where path scores tie
    exactly, which of the tied nodes comes first may differ, but the scores (the expected acceptance) may not."""
    gen = torch.Generator().manual_seed(21 + quantised)
    logits = torch.randn(3, 15, 300, generator=gen) * 2.5
    if quantised:
        logits = logits.round()  # many exact ties
    roots = torch.zeros(3, dtype=torch.int64)
    full = poisoned_batch(3, 64, 1)
    build_tree(logits, 64, full, roots)
    for b in (1, 4, 15, 16, 33, 63):
        small = poisoned_batch(3, b, 2)
        build_tree(logits, b, small, roots)
        if not quantised:
            assert torch.equal(full.token_ids[:, : b + 1], small.token_ids)
            assert torch.equal(full.parents[:, : b + 1], small.parents)
            assert torch.equal(full.depths[:, : b + 1], small.depths)
        for got, want in zip(path_scores(full, logits, 3, b + 1), path_scores(small, logits, 3, b + 1)):
            assert got == pytest.approx(want, abs=1e-4)  # pop order: scores descend, so position by position


@BUILDS
def test_low_precision_logits_and_determinism(build: dict) -> None:
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(4, 15, 500, generator=gen) * 3).to(torch.bfloat16)
    check_against_heap(logits, 64, build=build)
    first, second = poisoned_batch(4, 64, 1), poisoned_batch(4, 64, 2)
    build_tree(logits, 64, first, torch.zeros(4, dtype=torch.int64), **build)
    build_tree(logits, 64, second, torch.zeros(4, dtype=torch.int64), **build)
    for a, b in zip((first.token_ids, first.parents, first.ancestor_bits), (second.token_ids, second.parents,
                                                                           second.ancestor_bits)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_depth_topk(dtype: torch.dtype) -> None:
    """Top-k values are the log-probs, best first, equal values ordered by token id, nothing better left out."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (2, 5, 40), generator=gen).to(dtype)
    values, ids = per_depth_topk(logits, 16)
    logp = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(values, torch.gather(logp, -1, ids), rtol=0, atol=1e-6)
    assert (values[..., :-1] >= values[..., 1:]).all()
    tie = values[..., :-1] == values[..., 1:]
    assert (ids[..., :-1] < ids[..., 1:])[tie].all()
    left_out = logits.float().scatter(-1, ids, float("-inf"))  # on the logits: exact, ties at the k-th included
    assert (left_out.amax(-1) <= torch.gather(logits.float(), -1, ids[..., -1:]).squeeze(-1)).all()


TRITON_TOPK_CASES = [  # (method, vocab, k)
    *(("chunks", vocab, k) for vocab, k in [(40, 16), (5000, 16), (9000, 32), (300, 64)]),
    # 16-token chunks, as many as k; 512-token chunks (candidates from 8 of 10); 64-token chunks, as many as k. Each
    # case's half -inf row holds more candidates than the buffer: its k come from the whole row.
    *(("threshold", vocab, k) for vocab, k in [(256, 16), (5000, 8), (2048, 32)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,vocab,k", TRITON_TOPK_CASES)
def test_triton_topk_equals_the_torch_topk(dtype: torch.dtype, method: str, vocab: int, k: int) -> None:
    """The Triton top-k (topk_triton.py, interpreted here) gives per_depth_topk's log-probs position by position and
    its tokens wherever no tie straddles the k-th value (there, the lowest ids); rows longer than a chunk, a row half
    -inf, bf16 ties by the hundred, k above a chunk's share."""
    gen = torch.Generator().manual_seed(vocab + k)
    logits = (torch.randn(2, 3, vocab, generator=gen) * 3).to(dtype)
    logits[0, 0, : vocab // 2] = float("-inf")
    values, ids = per_depth_topk(logits, k, method=method)
    want_values, want_ids = per_depth_topk(logits, k, method="torch")
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == want_ids.shape
    assert torch.allclose(values, want_values, rtol=0, atol=1e-5)
    flat = logits.float().view(-1, vocab)
    kth = torch.gather(flat, -1, ids.view(-1, k)[:, -1:])  # the k-th logit
    straddles = ((flat == kth).sum(-1) > (torch.gather(flat, -1, ids.view(-1, k)) == kth).sum(-1)).view(ids.shape[:-1])
    assert torch.equal(ids[~straddles], want_ids[~straddles])
    tie = values[..., :-1] == values[..., 1:]
    assert (ids[..., :-1] < ids[..., 1:])[tie].all()
    left_out = logits.float().scatter(-1, ids, float("-inf"))
    assert (left_out.amax(-1) <= torch.gather(logits.float(), -1, ids[..., -1:]).squeeze(-1)).all()
    # Where a tie straddles the k-th value, the lowest ids of it get in.
    ties_at_kth = flat.eq(kth) & left_out.view(-1, vocab).isfinite()  # tokens of the k-th value left out
    taken_at_kth = torch.gather(flat, -1, ids.view(-1, k)).eq(kth)
    assert straddles.any() or not (dtype == torch.bfloat16 and vocab > 1000)  # (the tie branch is exercised)
    for r in range(flat.shape[0]):
        if ties_at_kth[r].any():
            assert ties_at_kth[r].nonzero().min() > ids.view(-1, k)[r][taken_at_kth[r]].max()


def test_threshold_topk_past_its_buffer() -> None:
    """More candidates than the buffer holds (a top of equal logits; a buffer of just k): the threshold top-k takes
    its k from the whole row, with the same result."""
    from vllm_ddtree.tree.topk_triton import per_depth_topk_threshold

    flat = torch.zeros(1, 1, 512)  # 16 chunks of 32 for k = 16: every token of the first 15 chunks reaches the cut
    values, ids = per_depth_topk_threshold(flat, 16)
    assert torch.equal(ids[0, 0], torch.arange(16)) and torch.allclose(values, torch.full_like(values, -math.log(512)))
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 2, 3000, generator=gen) * 3).to(torch.bfloat16)
    want = per_depth_topk_threshold(logits, 16)
    got = per_depth_topk_threshold(logits, 16, capacity=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Row 0: a run of 300 related ids lifted above the rest sits in 3 of 24 chunks of 128: hundreds of candidates
    # for a buffer of 32, which the re-cuts bring down. Row 1: logits rising with the id put 15 whole chunks above
    # the cut, and a buffer that catches the lowest of them each time is still over after the re-cuts: the whole
    # row. Both give the PyTorch top-k.
    logits = (torch.randn(2, 3000, generator=gen) * 3)
    logits[0, 1000:1300] += 20
    logits[1] = torch.linspace(-5, 5, 3000)
    values, ids = per_depth_topk_threshold(logits, 16, capacity=32)
    want_values, want_ids = per_depth_topk(logits, 16, method="torch")
    assert torch.equal(ids, want_ids) and torch.allclose(values, want_values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_logsumexp_kernel_equals_torch(dtype: torch.dtype) -> None:
    """The Triton kernels (interpreted here) against torch.logsumexp in float32: rows longer and shorter than a block,
    cut into pieces or not, -inf entries (masked vocabulary), a row that starts with a run of -inf (a whole piece of
    it), a row of nothing but -inf."""
    from vllm_ddtree.tree import logsumexp_triton
    from vllm_ddtree.tree.logsumexp import row_logsumexp

    gen = torch.Generator().manual_seed(9)
    assert logsumexp_triton.pieces_per_row(6, 2500, 1024) == 3 and logsumexp_triton.pieces_per_row(600, 2500, 1024) == 1
    for vocab in (7, 1024, 2500):
        logits = (torch.randn(3, 2, vocab, generator=gen) * 4).to(dtype)
        logits[0, 0, : vocab // 2] = float("-inf")
        logits[1, 1, ::3] = float("-inf")
        logits[2, 0] = float("-inf")
        want = torch.logsumexp(logits.float(), dim=-1)
        got = row_logsumexp(logits, use_triton=True)
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("rows,cols,keep", [(3, 280, 64), (1, 960, 64), (4, 17, 17), (1, 1, 1)])
def test_triton_sort_equals_torch_stable_sort(rows: int, cols: int, keep: int) -> None:
    """The beam's sort (sort_triton.py) against torch's stable descending sort: ties (a few distinct values), -inf,
    -0.0 beside +0.0, huge and tiny magnitudes; values bit for bit, ties in column order."""
    gen = torch.Generator().manual_seed(cols)
    scores = -torch.randint(0, 6, (rows, cols), generator=gen).float() * 0.5
    scores[:, ::7] = -torch.rand(rows, len(range(0, cols, 7)), generator=gen) * 2.0 ** torch.randint(
        -30, 30, (rows, len(range(0, cols, 7))), generator=gen).float()
    scores[:, 1::11] = float("-inf")
    scores[:, 2::13] = -0.0
    want_values, want_order = sort_descending(scores, keep, use_triton=False)
    got_values, got_order = sort_descending(scores, keep, use_triton=True)
    assert torch.equal(got_order, want_order)
    assert torch.equal(got_values.view(torch.int32), scores.gather(1, want_order).view(torch.int32))
    assert torch.equal(got_values, want_values)


def test_build_with_triton_sort_matches_heap() -> None:
    """The PyTorch beam with its sorts in Triton: random logits, exact ties (a few distinct logit values: ties
    inside a depth and across depths), and a chain of 16 nodes, at B = 64 (where CUDA takes this path)."""
    gen = torch.Generator().manual_seed(21)
    check_against_heap(torch.randn(2, 4, 300, generator=gen), 64, seed=1, build=TRITON_SORT)
    quantised = torch.randint(0, 3, (2, 3, 200), generator=gen).float()
    check_against_heap(quantised, 64, seed=2, build=TRITON_SORT)
    check_against_heap(torch.randn(1, 16, 1, generator=gen), 64, seed=3, build=TRITON_SORT)


def test_heap_reference_equals_brute_force() -> None:
    """The reference heap pops exactly the best B prefixes of the total order (checked by enumeration)."""
    gen = torch.Generator().manual_seed(2)
    for budget, depth, k in [(1, 2, 2), (5, 3, 3), (13, 3, 4), (20, 4, 3), (40, 4, 3), (30, 5, 2)]:
        for _ in range(15):
            top_logp = (torch.randint(-4, 1, (depth, k), generator=gen) / 2).sort(descending=True).values
            ids = torch.randint(0, 100, (depth, k), generator=gen).tolist()
            assert heap_tree(top_logp.tolist(), ids, budget) == brute_force_tree(top_logp.tolist(), ids, budget)


def test_ancestor_bits_word_boundaries() -> None:
    """A 129-node chain crosses bit 31 (the int32 sign bit) and several words."""
    nodes = 129
    parents = torch.arange(-1, nodes - 1, dtype=torch.int32)[None]
    bits = ancestor_bits_from_parents(parents, max_depth=nodes - 1)
    sets = ancestor_sets_from_bits(bits[0].tolist())
    assert sets == [frozenset(range(i + 1)) for i in range(nodes)]



@pytest.mark.parametrize("budget, depth", [(8, 4), (40, 33)])  # 33 deep: a chain across two ancestor words
def test_build_chain_files_the_build_trees_chain_as_a_chain_shaped_tree(budget: int, depth: int) -> None:
    """What a drafter files when the next step verifies the chain: the chain ``build_tree`` files beside its tree,
    and as the tree the chain-shaped tree a chain step verifies (``fill_chains``, prepare's reference), over
    whatever the buffers held; rows past the batch untouched."""
    gen = torch.Generator().manual_seed(depth)
    rows, vocab = 3, 50
    logits = torch.randn(rows, depth, vocab, generator=gen)
    roots = torch.randint(0, vocab, (rows,), generator=gen)
    want_chains = torch.zeros(rows, depth, dtype=torch.int64)
    build_tree(logits, budget, TreeBatch.allocate(rows, budget, "cpu"), roots, chain_out=want_chains)
    out, chains = TreeBatch.allocate(rows + 1, budget, "cpu"), torch.zeros(rows + 1, depth, dtype=torch.int64)
    build_tree(torch.randn(rows + 1, depth, vocab, generator=gen), budget, out, torch.arange(rows + 1))  # stale
    stale_row = [getattr(out, name)[rows].clone() for name in ("token_ids", "parents", "num_nodes")]
    build_chain(logits, out, roots, chains)
    assert torch.equal(chains[:rows], want_chains)
    want = TreeBatch.allocate(rows, budget, "cpu")
    want.token_ids[:, 0] = roots
    fill_chains(want_chains, torch.full((rows,), depth), want)
    for name in ("token_ids", "parents", "depths", "ancestor_bits"):
        assert torch.equal(getattr(out, name)[:rows], getattr(want, name)), name
    assert out.num_nodes[:rows].tolist() == [depth] * rows
    node = torch.arange(out.parents.shape[1])  # spelt out too: fill_chains is also build_chain's writer
    assert torch.equal(out.parents[:rows].long(), torch.where(node <= depth, node - 1, -1).expand(rows, -1))
    assert torch.equal(out.depths[:rows].long(), torch.where(node <= depth, node, -1).expand(rows, -1))
    assert all(torch.equal(getattr(out, name)[rows], before)
               for name, before in zip(("token_ids", "parents", "num_nodes"), stale_row))
    with pytest.raises(ValueError, match="does not fit"):
        build_chain(logits, TreeBatch.allocate(rows, depth - 1, "cpu"), roots, chains)
