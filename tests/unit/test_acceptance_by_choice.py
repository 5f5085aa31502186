"""acceptance_by_choice.py against brute force: each smaller budget's own tree (``build_tree`` at that budget) and the
chain, walked against a target that is a function of the prefix (greedy), on the tokens of one verified step."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_ddtree.acceptance_by_choice import ChoiceAcceptance, acceptance_by_choice
from vllm_ddtree.sampler import walk_tree
from vllm_ddtree.tree.build import build_tree, fill_chains
from vllm_ddtree.tree.layout import TreeBatch

DEPTH, VOCAB, BUDGET = 7, 12, 24
CHOICES = [3, DEPTH, 8, 16, BUDGET]  # DEPTH: the chain
CHAIN = CHOICES.index(DEPTH)


class Target:
    """The target's greedy token after each prefix (a tuple of draft tokens below the root), fixed on first use: it
    follows a child of the big tree at that prefix, else the chain's next token, often enough for long paths."""

    def __init__(self, seed: int, children: dict[tuple, list[int]], chain: list[int]):
        self.draw = random.Random(seed)
        self.children, self.chain = children, chain
        self.table: dict[tuple, int] = {}

    def __call__(self, prefix: tuple) -> int:
        if prefix not in self.table:
            follow = list(self.children.get(prefix, ()))
            if prefix == tuple(self.chain[: len(prefix)]) and len(prefix) < len(self.chain):
                follow.append(self.chain[len(prefix)])
            take = follow and self.draw.random() < 0.8
            self.table[prefix] = self.draw.choice(follow) if take else self.draw.randrange(VOCAB)
        return self.table[prefix]


def prefixes(tree: TreeBatch, row: int) -> list[tuple]:
    """Each live node's draft tokens from depth 1 (the root: ())."""
    out = [()]
    for i in range(1, int(tree.num_nodes[row]) + 1):
        out.append(out[int(tree.parents[row, i])] + (int(tree.token_ids[row, i]),))
    return out


def walk(tree: TreeBatch, targets: list[Target]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The greedy walk of each row's tree: (accepted node ids, emitted tokens, accepted counts)."""
    rows = len(targets)
    node_tokens = torch.zeros(rows, tree.budget + 1, dtype=torch.int64)
    for r, target in enumerate(targets):
        for i, prefix in enumerate(prefixes(tree, r)):
            node_tokens[r, i] = target(prefix)
    out = walk_tree(node_tokens, tree, DEPTH)
    return out.accepted_node_ids, out.output_token_ids, out.num_accepted


def chain_accepts(target: Target, chain: list[int]) -> int:
    k = 0
    while k < len(chain) and chain[k] == target(tuple(chain[:k])):
        k += 1
    return k


def tree_rows(tree: TreeBatch) -> torch.Tensor:
    """A tree step's ``tree_rows``: r where request r verified nodes, else -1 (verify_rows.py)."""
    return torch.where(tree.num_nodes > 0, torch.arange(tree.num_nodes.shape[0], dtype=torch.int32), -1)


def draft_logits(rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, DEPTH, VOCAB, generator=gen) * 2.0


@pytest.mark.parametrize("seed", range(6))
def test_each_smaller_budget_and_the_chain_accept_what_their_own_walk_accepts(seed):
    rows = 6
    logits = draft_logits(rows, seed)
    roots = torch.arange(rows, dtype=torch.int64)
    big = TreeBatch.allocate(rows, BUDGET, "cpu")
    chains = torch.zeros(rows, DEPTH, dtype=torch.int64)
    build_tree(logits, BUDGET, big, roots, chain_out=chains)
    # Verified nodes per request: the whole tree, a prefix cut short (near max_model_len), none (refused).
    verified = torch.tensor([BUDGET, BUDGET, 10, BUDGET, 0, BUDGET], dtype=torch.int32)
    big.num_nodes.copy_(verified)
    targets = []
    for r in range(rows):
        children: dict[tuple, list[int]] = {}
        live = prefixes(big, r)
        for prefix in live[1:]:
            children.setdefault(prefix[:-1], []).append(prefix[-1])
        targets.append(Target(1000 * seed + r, children, chains[r].tolist()))
    accepted_ids, emitted, num_accepted = walk(big, targets)
    got = acceptance_by_choice(accepted_ids, emitted, num_accepted, big.num_nodes, tree_rows(big), chains,
                               torch.tensor(CHOICES), CHAIN)
    assert got.dtype == torch.int32 and got.shape == (rows, len(CHOICES))

    for b in (c for c in CHOICES if c != DEPTH):
        small = TreeBatch.allocate(rows, b, "cpu")
        build_tree(logits, b, small, roots)  # budget b's own tree, not a prefix taken from the big one
        small.num_nodes.copy_(torch.minimum(small.num_nodes, verified))
        _, _, want = walk(small, targets)
        column = got[:, CHOICES.index(b)].tolist()
        for r in range(rows):
            assert column[r] == (int(want[r]) if 0 < b <= int(verified[r]) else -1), (b, r)
    for r in range(rows):
        a = int(num_accepted[r])
        truth = chain_accepts(targets[r], chains[r].tolist())
        if verified[r] == 0:
            assert got[r, CHAIN] == -1
        elif truth <= a:
            assert got[r, CHAIN] == truth, r
        else:  # the chain matched the bonus, past the tree: a lower bound
            assert got[r, CHAIN] == a + 1 <= truth, r
    assert int(num_accepted.max()) >= 3, "the case should accept long paths"
    whole = verified == BUDGET  # the verified budget's own column is the walk's count
    assert torch.equal(got[whole, CHOICES.index(BUDGET)], num_accepted[whole].to(torch.int32))


def test_the_cases_cover_paths_off_the_prefix_and_the_chain_past_the_tree():
    """Across the seeds above some budgets accept less than the full tree, and the chain runs past a tree."""
    less = past = exact_chain = 0
    for seed in range(6):
        logits = draft_logits(6, seed)
        big = TreeBatch.allocate(6, BUDGET, "cpu")
        chains = torch.zeros(6, DEPTH, dtype=torch.int64)
        build_tree(logits, BUDGET, big, torch.arange(6), chain_out=chains)
        targets = []
        for r in range(6):
            children: dict[tuple, list[int]] = {}
            for prefix in prefixes(big, r)[1:]:
                children.setdefault(prefix[:-1], []).append(prefix[-1])
            targets.append(Target(1000 * seed + r, children, chains[r].tolist()))
        ids, emitted, n = walk(big, targets)
        got = acceptance_by_choice(ids, emitted, n, big.num_nodes, tree_rows(big), chains,
                                   torch.tensor(CHOICES), CHAIN)
        less += int((got[:, 0] < n).sum())
        for r in range(6):
            truth = chain_accepts(targets[r], chains[r].tolist())
            past += truth > int(n[r])
            exact_chain += 0 < truth <= int(n[r])
    assert less > 0 and past > 0 and exact_chain > 0, (less, past, exact_chain)


def test_a_chain_step_knows_only_the_chain():
    rows = 3
    chains = torch.randint(0, VOCAB, (rows, DEPTH), generator=torch.Generator().manual_seed(3))
    tree = TreeBatch.allocate(rows, BUDGET, "cpu")
    num_drafts = torch.tensor([DEPTH, DEPTH, 0])
    fill_chains(chains, num_drafts, tree)
    tree.num_nodes.copy_(num_drafts)
    node_tokens = torch.zeros(rows, BUDGET + 1, dtype=torch.int64)
    node_tokens[:, :4] = chains[:, :4]  # every row accepts 4 of its chain, then a miss
    node_tokens[:, 4] = (chains[:, 4] + 1) % VOCAB
    out = walk_tree(node_tokens, tree, DEPTH)
    no_tree_rows = torch.full((rows,), -1, dtype=torch.int32)  # a chain step verifies causally
    got = acceptance_by_choice(out.accepted_node_ids, out.output_token_ids, out.num_accepted, tree.num_nodes,
                               no_tree_rows, torch.zeros_like(chains), torch.tensor(CHOICES), CHAIN)
    assert out.num_accepted.tolist() == [4, 4, 0]
    want = [[-1] * len(CHOICES) for _ in range(rows)]
    want[0][CHAIN] = want[1][CHAIN] = 4  # its own count, whatever the chain buffer holds
    assert got.tolist() == want


def test_fill_writes_the_live_rows_and_prepare_gathers_the_chains_by_slot():
    slots_chains = torch.arange(5 * DEPTH, dtype=torch.int64).view(5, DEPTH)
    by_choice = ChoiceAcceptance([16, DEPTH, 3], DEPTH, max_reqs=4, device=torch.device("cpu"), chain=True)
    assert by_choice.budgets.tolist() == [3, DEPTH, 16] and by_choice.chain_column == 1
    by_choice.out.fill_(99)
    by_choice.prepare(torch.tensor([4, 1], dtype=torch.int32), slots_chains)
    assert torch.equal(by_choice.chains[:2], slots_chains[[4, 1]])
    tree = TreeBatch.allocate(2, 16, "cpu")
    tree.num_nodes.copy_(torch.tensor([16, 3]))
    walk_out = walk_tree(torch.zeros(2, 17, dtype=torch.int64), tree, DEPTH)  # nothing accepted
    by_choice.fill(walk_out, tree.num_nodes, torch.tensor([0, 1, -1, -1], dtype=torch.int32), 2)
    assert by_choice.out[:2].tolist() == [[0, 0, 0], [0, 0, -1]]
    assert by_choice.out[2:].eq(99).all()  # rows beyond the batch untouched
    by_choice.fill(walk_out, tree.num_nodes, torch.full((4,), -1, dtype=torch.int32), 2)  # the same as a chain step
    assert by_choice.out[:2].tolist() == [[-1, 0, -1], [-1, 0, -1]]
    without_chain = ChoiceAcceptance([16, 32], DEPTH, max_reqs=4, device=torch.device("cpu"), chain=False)
    assert without_chain.chain_column is None and without_chain.chains is None
