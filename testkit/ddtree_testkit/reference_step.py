"""One DDTree decode step on one screen, in plain PyTorch, over a toy one-layer target (docs/algorithm.md §2-§3).

    draft logits -> best-first tree (heap reference) -> every node's logits from the target run as a chain over its
    own root path -> greedy walk -> the committed chain: tokens, and the K/V the cache must hold afterwards

No tree mask, no paged cache, no depth positions: each node is verified the slow, obviously right way, as a chain
of its ancestors at positions ``s, s + 1, ...``. Tests hold both runner adapters (``vllm_ddtree/v1``,
``vllm_ddtree/mrv2``) to it: they run the same step through the verify core (tree attention over a paged cache,
depth positions, the walk, KV compaction) and must commit the same tokens and leave the same K/V at ``s .. s + m``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_ddtree.tree.build import per_depth_topk
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree.reference import heap_tree, tree_batch_from_lists


@dataclass
class ToyTarget:
    """One attention head, RoPE, an embedding and an output projection: enough for positions and masks to matter."""

    embed: torch.Tensor  # [V, D]
    wq: torch.Tensor  # [D, D]
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor  # [D, V]

    @classmethod
    def random(cls, vocab: int, dim: int, seed: int) -> ToyTarget:
        gen = torch.Generator().manual_seed(seed)

        def w(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[0])

        # Sharp output logits: well-separated greedy choices, so float32 kernels agree with this float64 reference.
        return cls(w(vocab, dim) * math.sqrt(vocab), w(dim, dim), w(dim, dim), w(dim, dim), w(dim, vocab) * 30.0)

    @property
    def dim(self) -> int:
        return self.embed.shape[1]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
        angle = positions.to(torch.float64)[:, None] * freq[None, :]
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=1)

    def qkv(self, tokens: torch.Tensor, positions: torch.Tensor):
        x = self.embed[tokens.long()]
        return self.rope(x @ self.wq, positions), self.rope(x @ self.wk, positions), x @ self.wv

    def logits(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention ``q [n, D]`` over ``k, v [S, D]`` (``mask [n, S]``), then the output projection."""
        scores = (q @ k.T) / math.sqrt(self.dim)
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return (attn @ v) @ self.wo


@dataclass
class ReferenceStep:
    tree: TreeBatch  # the tree the drafter's logits make (one row)
    accepted: list[int]  # accepted node ids, root first
    tokens: list[int]  # committed tokens: the accepted drafts, then the bonus
    keys: torch.Tensor  # [s + m + 1, D]: the cache after the step, the root and the accepted path appended
    values: torch.Tensor
    min_margin: float  # the smallest gap between a verified node's best and second-best logit


def reference_step(target: ToyTarget, prefix: list[int], root: int, draft_logits: torch.Tensor, budget: int,
                   num_fed: int | None = None, chain: bool = False) -> ReferenceStep:
    """One request: ``prefix`` is in the cache (positions 0..s-1), ``root`` is the last sampled token (position s),
    ``draft_logits [L, V]`` the drafter's; the scheduler fed the first ``num_fed`` nodes (default all). ``chain``:
    a chain step, which verifies the DFlash chain (each depth's most likely draft token) instead of the tree."""
    top_logp, top_ids = per_depth_topk(draft_logits[None], min(budget, draft_logits.shape[-1]))
    heap = heap_tree(top_logp[0].tolist(), top_ids[0].tolist(), budget)  # the authors' best-first heap
    tokens, parents = [root] + heap.tokens[1:], heap.parents
    if chain:  # node i: depth i's most likely token, child of node i - 1
        tokens = [root, *draft_logits.argmax(-1).tolist()]
        parents = list(range(-1, len(tokens) - 1))
    tree = tree_batch_from_lists([(tokens[1:], parents[1:])], budget, [root])
    n = len(tokens) - 1 if num_fed is None else num_fed

    def path(node: int) -> list[int]:
        nodes = [node]
        while parents[nodes[-1]] >= 0:
            nodes.append(parents[nodes[-1]])
        return nodes[::-1]

    def run_chain(nodes: list[int]):
        seq = torch.tensor(prefix + [tokens[i] for i in nodes])
        q, k, v = target.qkv(seq, torch.arange(len(seq)))
        causal = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()
        return target.logits(q, k, v, causal), k, v

    node_logits = torch.stack([run_chain(path(i))[0][-1] for i in range(n + 1)])  # each node verified as its own chain
    argmax = node_logits.argmax(-1).tolist()
    top2 = node_logits.topk(2, dim=-1).values
    children = {}
    for i in range(1, n + 1):
        children.setdefault(parents[i], {})[tokens[i]] = i
    accepted = [0]
    while argmax[accepted[-1]] in children.get(accepted[-1], {}):
        accepted.append(children[accepted[-1]][argmax[accepted[-1]]])
    _, keys, values = run_chain(accepted)
    return ReferenceStep(tree, accepted, [tokens[i] for i in accepted[1:]] + [argmax[accepted[-1]]], keys, values,
                         float((top2[:, 0] - top2[:, 1]).min()))
