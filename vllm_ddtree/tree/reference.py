"""Plain-Python references for the tree core: the authors' heap (Algorithm 1), a brute-force optimum, a walk.

Slow on purpose and free of tensor tricks, so the device code in build.py / sampler.py has something obvious to
equal. Scores and the tie-break follow build.py's module docstring exactly: a prefix's score is its parent's
score plus one float32 log-prob, rounded to float32, and ties go by ``(-score, depth, key(parent), rank)``.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.tree.layout import BITS_PER_WORD, TreeBatch, num_ancestor_words


def f32_add(a: float, b: float) -> float:
    """float32 a + b, as the device computes it (a double sum of two float32 values rounds correctly)."""
    return float(np.float32(a + b))


@dataclass
class ReferenceTree:
    """One tree in pop order. Lists index nodes 0..N (node 0 = root; its token is not set here)."""

    tokens: list[int]  # tokens[0] = -1 placeholder for the root
    parents: list[int]  # parents[0] = -1
    depths: list[int]  # depths[0] = 0
    ranks: list[int]  # top-k rank of each node at its depth; -1 for the root
    scores: list[float]  # float32 path scores; 0.0 for the root
    ancestors: list[frozenset[int]]  # ancestor-or-self node sets

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1


def _finish(tokens, parents, depths, ranks, scores) -> ReferenceTree:
    ancestors = [frozenset({0})]
    for i in range(1, len(parents)):
        ancestors.append(ancestors[parents[i]] | {i})
    return ReferenceTree(tokens, parents, depths, ranks, scores, ancestors)


def heap_tree(top_logp: list[list[float]], top_ids: list[list[int]], budget: int) -> ReferenceTree:
    """Algorithm 1 as the authors coded it (docs/algorithm.md §2.2), with build.py's score and tie-break rule.

    top_logp/top_ids: [L][K] per depth, best first. Pops up to ``budget`` nodes; each pop pushes its next
    sibling (same parent, rank + 1) and its first child (depth + 1, rank 0).
    """
    depth_limit, k = len(top_logp), len(top_logp[0])
    tokens, parents, depths, ranks, scores = [-1], [-1], [0], [-1], [0.0]
    # Entries: (key, depth, rank, parent node, parent score). key = (-score, depth, parent key, rank) is
    # unique per prefix, so the payload is never compared.
    root_key: tuple = ()
    first = f32_add(0.0, top_logp[0][0])
    heap = [((-first, 1, root_key, 0), 1, 0, 0, 0.0)]
    node_keys = [root_key]
    while heap and len(tokens) - 1 < budget:
        key, depth, rank, parent, parent_score = heapq.heappop(heap)
        score = -key[0]
        node = len(tokens)
        tokens.append(int(top_ids[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(score)
        node_keys.append(key)
        if rank + 1 < k:
            sibling = f32_add(parent_score, top_logp[depth - 1][rank + 1])
            heapq.heappush(heap, ((-sibling, depth, key[2], rank + 1), depth, rank + 1, parent, parent_score))
        if depth < depth_limit:
            child = f32_add(score, top_logp[depth][0])
            heapq.heappush(heap, ((-child, depth + 1, key, 0), depth + 1, 0, node, score))
    return _finish(tokens, parents, depths, ranks, scores)


def brute_force_tree(top_logp: list[list[float]], top_ids: list[list[int]], budget: int) -> ReferenceTree:
    """Enumerate every prefix (K^1 + ... + K^L of them; keep it small), sort by the total order, keep ``budget``."""
    depth_limit, k = len(top_logp), len(top_logp[0])
    key_of: dict[tuple[int, ...], tuple] = {(): ()}
    score_of: dict[tuple[int, ...], float] = {(): 0.0}
    for depth in range(1, depth_limit + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            parent = ranks[:-1]
            score_of[ranks] = f32_add(score_of[parent], top_logp[depth - 1][ranks[-1]])
            key_of[ranks] = (-score_of[ranks], depth, key_of[parent], ranks[-1])
    chosen = sorted((r for r in key_of if r), key=key_of.__getitem__)[:budget]
    node_of = {(): 0}
    tokens, parents, depths, ranks_out, scores = [-1], [-1], [0], [-1], [0.0]
    for ranks in chosen:
        node_of[ranks] = len(tokens)
        tokens.append(int(top_ids[len(ranks) - 1][ranks[-1]]))
        parents.append(node_of[ranks[:-1]])  # KeyError here would mean the chosen set is not prefix-closed
        depths.append(len(ranks))
        ranks_out.append(ranks[-1])
        scores.append(score_of[ranks])
    return _finish(tokens, parents, depths, ranks_out, scores)


def ancestor_sets_from_bits(bits_row: list[list[int]]) -> list[frozenset[int]]:
    """Decode one row of ancestor bit words ([N+1][W] ints, possibly negative int32) into node sets."""
    sets = []
    for words in bits_row:
        members = set()
        for w, word in enumerate(words):
            word &= 0xFFFFFFFF
            members.update(w * BITS_PER_WORD + b for b in range(BITS_PER_WORD) if word >> b & 1)
        sets.append(frozenset(members))
    return sets


def tree_batch_from_lists(
    trees: list[tuple[list[int], list[int]]], budget: int, root_tokens: list[int], device="cpu"
) -> TreeBatch:
    """TreeBatch from per-row (tokens[1..N], parents[1..N]) lists (node 0 implicit), for hand-made test trees.

    Parents must precede children. Depths and ancestor bits are derived here, in Python.
    """
    batch = TreeBatch.allocate(len(trees), budget, "cpu")
    words = num_ancestor_words(budget + 1)
    for row, ((tokens, parents), root) in enumerate(zip(trees, root_tokens)):
        n = len(tokens)
        assert n == len(parents) <= budget and all(0 <= p <= i for i, p in enumerate(parents))
        depth = [0]
        anc = [{0}]
        for i, p in enumerate(parents, start=1):
            depth.append(depth[p] + 1)
            anc.append(anc[p] | {i})
        batch.token_ids[row, 0] = root
        batch.token_ids[row, 1 : n + 1] = torch.tensor(tokens, dtype=torch.int64)
        batch.parents[row, 1 : n + 1] = torch.tensor(parents, dtype=torch.int32)
        batch.depths[row, : n + 1] = torch.tensor(depth, dtype=torch.int32)
        batch.num_nodes[row] = n
        for i, members in enumerate(anc):
            for j in members:
                batch.ancestor_bits[row, i, j // BITS_PER_WORD] |= _int32_bit(j % BITS_PER_WORD)
        assert words == batch.ancestor_bits.shape[-1]
    return TreeBatch(*(t.to(device) for t in (batch.token_ids, batch.parents, batch.depths,
                                              batch.ancestor_bits, batch.num_nodes)))


def _int32_bit(b: int) -> int:
    return (1 << b) - (1 << 32) if b == 31 else 1 << b


def walk_tree_greedy_reference(
    tokens: list[int], parents: list[int], num_nodes: int, posterior: list[int], max_depth: int
) -> tuple[list[int], int]:
    """The authors' ``follow_verified_tree`` (docs/algorithm.md §3.2) on one row: child maps and a loop.

    tokens/parents index nodes 0..B (only 1..num_nodes are live); posterior[i] is the target's token at node i.
    Returns (accepted node ids starting with the root, bonus token). Stops at max_depth accepted drafts.
    """
    child_maps: list[dict[int, int]] = [dict() for _ in range(len(tokens))]
    for i in range(1, num_nodes + 1):
        child_maps[parents[i]][tokens[i]] = i
    accepted, current = [0], 0
    while posterior[current] in child_maps[current] and len(accepted) <= max_depth:
        current = child_maps[current][posterior[current]]
        accepted.append(current)
    return accepted, posterior[current]
