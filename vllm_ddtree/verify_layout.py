"""Where a verify step's tree nodes sit among the target's token rows, as device tensor work shared by both runners.

A request that verifies a tree owns ``1 + n`` consecutive rows: its root, then nodes 1..n in tree order, at slots
``s .. s + n`` (slots stay linear). Three mappings follow from that layout:

- ``gather_trees``: the step's trees, from wherever the drafter left them, into batch order;
- ``depth_position_shift``: node i's position is ``s + depth(i)``, not ``s + i``;
- ``chain_order``: after the walk, the row permutation that puts the accepted path right after its root
  (rows ``root + k <- root + acc[k]``), so the drafter (and logprobs) see a plain chain.

The V1 runner feeds them indices built on the host; Model Runner V2 builds them on the device. Nothing here
synchronises with the host or depends on data for its shapes.
"""

from __future__ import annotations

import torch

from vllm_ddtree.tree.layout import TreeBatch

TREE_FIELDS = ("token_ids", "parents", "depths", "ancestor_bits")


def gather_trees(source: TreeBatch, index: torch.Tensor, out: TreeBatch) -> None:
    """``out[r] = source[index[r]]`` for r < len(index), every field but ``num_nodes`` (set by the caller)."""
    num_reqs = index.shape[0]
    index = index.to(torch.int64)
    for name in TREE_FIELDS:
        torch.index_select(getattr(source, name), 0, index, out=getattr(out, name)[:num_reqs])


def depth_position_shift(
    trees: TreeBatch, row_request: torch.Tensor, row_node: torch.Tensor, row_has_tree: torch.Tensor
) -> torch.Tensor:
    """Per logits row, ``depth(node) - node`` for rows of requests that verify a tree, else 0 (int64).

    ``row_request`` indexes ``trees`` rows; nodes past a tree's end (depth -1) keep their chain position."""
    depth = trees.depths[row_request, row_node].to(torch.int64)
    return torch.where(row_has_tree & (depth >= 0), depth - row_node.to(torch.int64), 0)


def chain_order(accepted: torch.Tensor, root_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Row permutation [num_rows] putting each accepted path right after its root: ``order[root + k] = root + acc[k]``
    for every accepted k (``accepted [R, L+1]``, -1 padded), identity elsewhere. ``root_rows [R]`` is on the device."""
    acc = accepted.to(torch.int64)
    device = acc.device
    root = root_rows.to(torch.int64)[:, None]
    k = torch.arange(acc.shape[1], device=device)[None, :]
    dest = torch.where(acc >= 0, root + k, num_rows)  # invalid entries land in a spill slot
    order = torch.arange(num_rows + 1, device=device)
    order.scatter_(0, dest.reshape(-1), torch.where(acc >= 0, root + acc, num_rows).reshape(-1))
    return order[:num_rows]
