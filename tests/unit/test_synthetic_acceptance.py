"""Synthetic acceptance (the benchmark mode): the walk accepts the drawn depth of the best-first path, which is the
chain's drafts, at vLLM's per-position rates."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.sampler import walk_tree
from vllm_ddtree.synthetic_acceptance import SyntheticAcceptance, conditional_rates
from vllm_ddtree.tree.build import build_tree
from vllm_ddtree.tree.layout import TreeBatch

DEPTH, VOCAB, BUDGET = 6, 50, 24


def trees(rows: int, seed: int, confidence: float = 0.0) -> tuple[TreeBatch, torch.Tensor]:
    """Random trees; ``confidence`` is added to one token per depth (a confident drafter: its chain fills the tree's
    first DEPTH nodes)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, DEPTH, VOCAB, generator=gen) * 3
    logits.scatter_add_(2, torch.randint(0, VOCAB, (rows, DEPTH, 1), generator=gen),
                        torch.full((rows, DEPTH, 1), confidence))
    out = TreeBatch.allocate(rows, BUDGET, "cpu")
    build_tree(logits, BUDGET, out, torch.randint(0, VOCAB, (rows,), generator=gen))
    return out, logits


def off_tree_tokens(tree: TreeBatch) -> torch.Tensor:
    """Target draws that match no node (the random-weight target's case): a token outside the drafter's vocabulary."""
    return torch.full_like(tree.token_ids, VOCAB)


def chain_agreeing_tokens(tree: TreeBatch, logits: torch.Tensor) -> torch.Tensor:
    """Target draws of a target that agrees with the drafter's argmax at every depth (and nowhere else)."""
    chain = torch.cat([logits.argmax(-1), torch.full((logits.shape[0], 1), VOCAB)], dim=1)
    return torch.gather(chain, 1, tree.depths.to(torch.int64).clamp(0, DEPTH))


def test_conditional_rates_from_vllms_unconditional_rates():
    assert conditional_rates([1.0, 0.8, 0.4, 0.0], 3) == [1.0, 0.8, 0.5]
    assert conditional_rates([0.5], 3) == [0.5, 0.0, 0.0]  # shallower rates than the tree: nothing deeper


def test_full_rates_accept_what_a_target_agreeing_with_the_chain_accepts():
    """Rates of 1 accept the best-first path, the drafter's argmax at every depth, as deep as the tree holds it:
    what the walk accepts from a target that draws the chain's tokens (flat logits: the path ends early)."""
    tree, logits = trees(64, seed=0)
    node_tokens = off_tree_tokens(tree)
    SyntheticAcceptance([1.0] * DEPTH, DEPTH, "cpu").force(node_tokens, tree)
    walk = walk_tree(node_tokens, tree, DEPTH)
    agreeing = walk_tree(chain_agreeing_tokens(tree, logits), tree, DEPTH)
    assert torch.equal(walk.accepted_node_ids, agreeing.accepted_node_ids)
    assert 0 < int((walk.num_accepted < DEPTH).sum()) < 64, "the harness: some paths end inside the tree"
    n = walk.num_accepted.to(torch.int64)
    bonus = walk.output_token_ids.to(torch.int64).gather(1, n[:, None])
    assert (bonus == VOCAB).all(), "the bonus is the target's own draw"


def test_zero_rates_leave_the_targets_draws():
    tree, _ = trees(4, seed=1)
    node_tokens = torch.randint(0, VOCAB, tree.token_ids.shape, generator=torch.Generator().manual_seed(2))
    before = node_tokens.clone()
    SyntheticAcceptance([0.0] * DEPTH, DEPTH, "cpu").force(node_tokens, tree)
    assert torch.equal(node_tokens, before)


@pytest.mark.parametrize("rates", [[1.0, 0.8, 0.5, 0.2, 0.1, 0.0], [0.9, 0.9, 0.9, 0.9, 0.9, 0.9]])
def test_accepted_depths_follow_the_rates(rates):
    """P(accepted >= d) is rates[d - 1]: counts over 4000 trees within 5 binomial sigma (seeded, so deterministic)."""
    rows = 4000
    tree, logits = trees(rows, seed=3, confidence=30.0)
    node_tokens = off_tree_tokens(tree)
    torch.manual_seed(4)
    SyntheticAcceptance(rates, DEPTH, "cpu").force(node_tokens, tree)
    walk = walk_tree(node_tokens, tree, DEPTH)
    for d, rate in enumerate(rates, start=1):
        observed = int((walk.num_accepted >= d).sum())
        sigma = (rows * rate * (1 - rate)) ** 0.5
        assert abs(observed - rows * rate) <= 5 * sigma + 1e-9, (d, observed, rows * rate)
    n = walk.num_accepted.to(torch.int64)
    position = torch.arange(DEPTH)
    chain = logits.argmax(-1)
    emitted = walk.output_token_ids[:, :DEPTH].to(torch.int64)
    assert torch.equal(torch.where(position < n[:, None], emitted, -1), torch.where(position < n[:, None], chain, -1))


def test_confident_drafts_put_the_chain_first_in_every_tree():
    """A random drafter's flat logits build shallow trees; made confident, every tree holds the chain as its first
    DEPTH nodes, so any stated τ up to DEPTH + 1 can be walked."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, DEPTH, VOCAB, generator=gen)
    chain = logits.argmax(-1)
    flat = TreeBatch.allocate(16, BUDGET, "cpu")
    build_tree(logits, BUDGET, flat, torch.zeros(16, dtype=torch.int64))
    assert int(flat.depths.max()) < DEPTH, "the harness: flat logits build shallow trees"
    SyntheticAcceptance([1.0] * DEPTH, DEPTH, "cpu").confident_drafts(logits)
    assert torch.equal(logits.argmax(-1), chain)
    tree = TreeBatch.allocate(16, BUDGET, "cpu")
    build_tree(logits, BUDGET, tree, torch.zeros(16, dtype=torch.int64))
    assert torch.equal(tree.parents[:, 1 : DEPTH + 1].long(), torch.arange(DEPTH).expand(16, -1))
    assert torch.equal(tree.token_ids[:, 1 : DEPTH + 1], chain)
