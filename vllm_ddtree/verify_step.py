"""One verify step's trees, shared by the three places vLLM calls into us during a target forward.

The runner hook (``DDTreeProposer.prepare_tree_verify``) fills a ``VerifyStep`` right after vLLM computed the slot
mapping; the target's attention backend reads it to mask tree rows; the tree sampler reads it to walk the trees and
then clears it, so the drafter's own forward (which uses the same backend classes) never sees it. vLLM passes no
per-step object through all three, so the step is published in this module, one per worker process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.tree.layout import TreeBatch


@dataclass
class VerifyStep:
    """Trees of the requests in this step's batch, indexed by the batch row ``r`` (vLLM's input-batch order)."""

    trees: TreeBatch  # rows [:num_reqs] hold this step's trees; num_nodes = drafts the scheduler kept
    num_reqs: int
    num_nodes_cpu: np.ndarray  # [num_reqs] scheduled drafts per request: its rows are the root, then these
    has_tree_cpu: np.ndarray  # [num_reqs] bool: verifies a tree (False: no drafts, or drafts from a stale tree)
    root_rows_cpu: np.ndarray  # [num_reqs] flat token row of each request's root (its tree rows follow)
    row_starts_cpu: np.ndarray  # [num_reqs] first logits row of each request (its root's)
    row_request: torch.Tensor  # [num_logits_rows] request of each logits row (rows are root, node 1, ...)
    row_node: torch.Tensor  # [num_logits_rows] node index of each logits row
    tree_rows_device: torch.Tensor  # [num_reqs] int32: r for a request verifying a tree, -1 otherwise

    @property
    def tree_requests(self) -> np.ndarray:
        """Batch rows that verify a tree."""
        return np.flatnonzero(self.has_tree_cpu)


_current: VerifyStep | None = None


def begin(step: VerifyStep) -> None:
    global _current
    _current = step


def current() -> VerifyStep | None:
    return _current


def end() -> None:
    global _current
    _current = None
