"""Synthetic acceptance for trees: a benchmark mode that fixes how deep verify steps accept, so a target of a real
model's shape with random weights (which accepts nothing) is timed end to end at a stated acceptance.

The semantics are those of vLLM's ``rejection_sample_method: "synthetic"`` for chains, carried onto the tree:
vLLM's unconditional per-position rates (``synthetic_acceptance_rates``, or ``synthetic_acceptance_length``
resolved to them) give, for depth d, the probability that d nodes are accepted. Acceptance runs down the tree's
best-first path, the first child of each node in build order (the drafter's most likely token at every depth, i.e.
the chain's drafts). Per request and step, depth d is accepted with the conditional probability
``rates[d] / rates[d - 1]``, until the first refusal. The walk is then handed the path's tokens as the target's
draws, so the accepted path, KV compaction, logprobs and the drafter's hand-over all run as in production; the bonus
is the target's own draw at the deepest accepted node. Should that draw equal one of that node's children, the walk
accepts further, as a real verify would (on random weights it does not happen).

A random drafter's flat logits build trees one or two deep, which no stated τ could walk, so the mode also makes
the drafter confident in its argmax at every depth (``confident_drafts``, before the build): each tree then holds
the chain as its first ``tree_depth`` nodes and spends the rest of the budget on siblings, the shape of a tree whose
drafter the target agrees with. Outputs are not the target's, hence refused unless ``VLLM_DDTREE_BENCHMARK=1``
(config.py).

Static shapes, no host sync: a loop over the tree depth of gathers and one scatter each, replayed with the walk
from its CUDA graph (the draws come from the device's default generator, which CUDA graphs advance per replay).
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree.layout import TreeBatch

CONFIDENCE = 1000.0  # added to each depth's argmax logit: its log-probability ~0, every other token's < -900


def conditional_rates(rates: list[float], depth: int) -> list[float]:
    """P(depth d accepted | depth d - 1 accepted) for d = 1..depth: vLLM's conversion of its unconditional rates (the
    chain's), over the tree's depths (rates past the depth cut, missing ones 0)."""
    from vllm.v1.spec_decode.utils import unconditional_to_conditional_rates

    return unconditional_to_conditional_rates([*rates[:depth], *[0.0] * (depth - len(rates))])


class SyntheticAcceptance:
    """Forces each step's accepted depth along the best-first path (module docstring)."""

    def __init__(self, rates: list[float], depth: int, device: torch.device | str):
        self.depth = depth
        self.conditional = torch.tensor(conditional_rates(rates, depth), dtype=torch.float32, device=device)

    def confident_drafts(self, draft_logits: torch.Tensor) -> None:
        """Raise every depth's argmax in ``draft_logits [R, L, V]`` (in place) far above the other tokens."""
        top = draft_logits.argmax(-1, keepdim=True)
        draft_logits.scatter_add_(-1, top, torch.full(top.shape, CONFIDENCE, dtype=draft_logits.dtype,
                                                      device=draft_logits.device))

    def force(self, node_tokens: torch.Tensor, tree: TreeBatch) -> None:
        """Overwrite ``node_tokens [R, B+1]`` (the target's token per node, rows = the first R trees of ``tree``) so
        that the walk accepts the drawn depth of every tree's best-first path."""
        rows, width = node_tokens.shape
        device = node_tokens.device
        index = torch.arange(width, device=device)
        parents = tree.parents[:rows].to(torch.int64)
        live = (index <= tree.num_nodes[:rows, None]) & (parents >= 0)
        # The first child of every node in build order; ``width`` where a node has none.
        first_child = torch.full((rows, width + 1), width, dtype=torch.int64, device=device)
        first_child.scatter_reduce_(1, torch.where(live, parents, width), index.expand(rows, -1), reduce="amin")
        first_child = first_child[:, :width]
        accepting = (torch.rand(rows, self.depth, device=device) < self.conditional).to(torch.int32).cumprod(1)
        tokens = tree.token_ids[:rows]
        node = torch.zeros(rows, 1, dtype=torch.int64, device=device)
        for d in range(self.depth):
            child = first_child.gather(1, node)
            take = (child < width) & (accepting[:, d : d + 1] > 0)
            child = child.clamp(max=width - 1)
            drawn = torch.where(take, tokens.gather(1, child), node_tokens.gather(1, node))
            node_tokens.scatter_(1, node, drawn)
            node = torch.where(take, child, node)


def synthetic_acceptance(spec, device: torch.device | str) -> SyntheticAcceptance | None:
    """The speculative config's synthetic acceptance (config.py validated it), else None."""
    if getattr(spec, "rejection_sample_method", "standard") != "synthetic":
        return None
    return SyntheticAcceptance(list(spec.synthetic_acceptance_rates), spec.tree_depth, device)
