"""What every budget choice would have accepted on a verify step's own tokens, for the cost-aware budget.

The budget policy compares choices by their mean accepted drafts (budget_policy.py). Windows that each hold only the
requests verified at their own budget compare different prompts at different times (H100, 2026-12-05: B=32 read
2.56 tokens and B=64 2.16, though a 64-node tree holds the 32-node one). A step verified at B nodes answers for
every smaller choice on the same tokens:

- a tree budget b <= B: trees are best-first (parents before children; the tree of budget b is nodes 0..b of the
  tree of budget B), so node ids increase along the accepted path and budget b accepts the path's nodes 1..b;
- the chain (its budget value is the depth): each depth's argmax draft. It accepts the leading run of the emitted
  tokens (the accepted path, then the bonus) equal to its tokens at depths 1, 2, ...: after a prefix it shares with
  the path, the target's token is the one drawn at the path's node (greedy: exact; at T > 0 the same coupling, as
  the walk and vLLM's rejection sampler with one-hot greedy drafts both accept a draft x when the target draws x).
  Where the chain also matches the bonus it ran past the tree, whose target tokens beyond were never drawn: the
  count (accepted + 1) is then a lower bound;
- choices larger than B, a request that verified nothing, and every tree on a chain step (whose only known column
  is the chain's, its own ``num_accepted``): -1, unknown.

Static shapes, no host sync: ``fill`` runs inside the walk's CUDA graph (``TreeVerifyCore._walk_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def acceptance_by_choice(accepted_node_ids: torch.Tensor, output_token_ids: torch.Tensor,
                         num_accepted: torch.Tensor, num_nodes: torch.Tensor, tree_rows: torch.Tensor,
                         chains: torch.Tensor | None, budgets: torch.Tensor, chain_column: int | None) -> torch.Tensor:
    """``[R, C]`` int32 accepted drafts per choice (module docstring), R = ``num_nodes.shape[0]``.

    The walk's ``accepted_node_ids`` and ``output_token_ids`` ``[>= R, L+1]`` and ``num_accepted [>= R]``;
    ``num_nodes [R]``: the nodes each request verified (0: none); ``tree_rows [R]``: >= 0 where the request verified
    a tree (verify_rows.py), so a request with nodes and no tree row verified its chain; ``chains [R, L]``: each
    request's chain tokens (needed with a ``chain_column``); ``budgets [C]``: the choices ascending,
    ``chain_column`` the chain's index among them (its value the depth)."""
    rows = num_nodes.shape[0]
    path = accepted_node_ids[:rows, 1:, None]  # [R, L, 1]: accepted node per depth, -1 past the path
    accepted = ((path >= 1) & (path <= budgets)).sum(1)  # [R, C]
    tree = tree_rows[:rows] >= 0
    out = torch.where((budgets <= num_nodes[:, None]) & tree[:, None], accepted, -1)
    if chain_column is not None:
        depth = chains.shape[1]
        matches = (output_token_ids[:rows, :depth].to(torch.int64) == chains).to(torch.int64).cumprod(1).sum(1)
        own = torch.where(num_nodes > 0, num_accepted[:rows].to(torch.int64), -1)  # a chain step: its own count
        out[:, chain_column] = torch.where(tree, matches, own)
    return out.to(torch.int32)


class ChoiceAcceptance:
    """Static buffers for ``acceptance_by_choice``: the step's chains, gathered in ``prepare``; ``out``."""

    def __init__(self, choices: Sequence[int], depth: int, max_reqs: int, device: torch.device, *, chain: bool):
        """``choices``: the budget policy's (``config.tree_budget_choices``); ``chain``: the chain fallback is on,
        and ``depth`` among the choices is the chain."""
        choices = sorted(choices)
        self.budgets = torch.tensor(choices, dtype=torch.int64, device=device)
        self.chain_column = choices.index(depth) if chain else None
        self.chains = torch.zeros(max_reqs, depth, dtype=torch.int64, device=device) if chain else None
        self.out = torch.full((max_reqs, len(choices)), -1, dtype=torch.int32, device=device)

    def prepare(self, slots: torch.Tensor, chains: torch.Tensor | None) -> None:
        """Before the forward: the batch's chains gathered by request slot from the hand-over, which the next draft
        step overwrites."""
        if self.chains is not None:
            torch.index_select(chains, 0, slots.to(torch.int64), out=self.chains[: slots.shape[0]])

    def fill(self, walk, num_nodes: torch.Tensor, tree_rows: torch.Tensor, rows: int) -> None:
        """Rows ``[:rows]`` of ``out`` from the walk (``sampler.TreeWalkOutput``), the verified node counts and the
        step's tree rows (read before the walk resets them)."""
        self.out[:rows] = acceptance_by_choice(
            walk.accepted_node_ids, walk.output_token_ids, walk.num_accepted, num_nodes[:rows], tree_rows[:rows],
            self.chains[:rows] if self.chains is not None else None, self.budgets, self.chain_column)
