"""TreeBatch: the static-shape tensors one step's draft trees live in.

Every consumer (tree build, tree attention, tree walk, KV compaction) speaks this layout, so it is the one place
that fixes it. Shapes are sized once (max requests R, budget B) so CUDA graphs can capture code that reads them.

Per request row r, nodes are numbered 0..B: node 0 is the root (the last target token, not yet in the KV cache),
nodes 1..B are drafted tokens in best-first pop order, so ``parent[i] < i`` and any prefix of the node list is a
valid subtree. Rows with fewer than B real nodes (``num_nodes[r] < B``) pad with ``parent = -1``, ``depth = -1``,
``token = 0``; a padded node is never anybody's ancestor and never on an accepted path.

``ancestor_bits[r, i, w]`` (int32 words, W = ceil((B+1)/32)): bit ``j % 32`` of word ``j // 32`` is set iff node j
is node i itself or one of its ancestors. Node i's query may attend to tree key j exactly when that bit is set;
every query sees the whole committed prefix. Size O(B) per node, never O(context). The root's row has only bit 0.
Bit 31 of a word makes the int32 negative; readers must use logical shifts on the value masked to 32 bits, or
``(word >> b) & 1``, which is sign-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS_PER_WORD = 32


def num_ancestor_words(num_nodes_with_root: int) -> int:
    """Words needed to hold one bit per node (root included)."""
    return (num_nodes_with_root + BITS_PER_WORD - 1) // BITS_PER_WORD


@dataclass
class TreeBatch:
    """Static buffers for up to ``max_reqs`` trees of ``budget`` non-root nodes each (see module docstring)."""

    token_ids: torch.Tensor  # [R, B+1] int64; column 0 is the root token (written by the caller)
    parents: torch.Tensor  # [R, B+1] int32; parents[:, 0] = -1
    depths: torch.Tensor  # [R, B+1] int32; depths[:, 0] = 0
    ancestor_bits: torch.Tensor  # [R, B+1, W] int32
    num_nodes: torch.Tensor  # [R] int32, non-root nodes in the tree (0..B)

    @property
    def budget(self) -> int:
        return self.token_ids.shape[1] - 1

    @classmethod
    def allocate(cls, max_reqs: int, budget: int, device: torch.device | str) -> TreeBatch:
        n = budget + 1
        return cls(
            token_ids=torch.zeros(max_reqs, n, dtype=torch.int64, device=device),
            parents=torch.full((max_reqs, n), -1, dtype=torch.int32, device=device),
            depths=torch.full((max_reqs, n), -1, dtype=torch.int32, device=device),
            ancestor_bits=torch.zeros(max_reqs, n, num_ancestor_words(n), dtype=torch.int32, device=device),
            num_nodes=torch.zeros(max_reqs, dtype=torch.int32, device=device),
        )
