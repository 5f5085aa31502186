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

    @property
    def tree_requests(self) -> np.ndarray:
        """Batch rows that verify a tree."""
        return np.flatnonzero(self.has_tree_cpu)


@dataclass
class StaticTreeInputs:
    """What the GPU tree attention reads, at addresses fixed for the worker's lifetime, so a captured CUDA graph
    replays every step with that step's trees: ``tree_rows[r]`` is r while request r verifies a tree, else -1 (a
    causal request; it is -1 everywhere outside a verify step), ``ancestor_bits`` the verify step's trees."""

    ancestor_bits: torch.Tensor  # [max_reqs, B+1, W] int32 (TreeBatch layout)
    tree_rows: torch.Tensor  # [max_reqs] int32


_current: VerifyStep | None = None
_static: StaticTreeInputs | None = None


def publish_static_inputs(inputs: StaticTreeInputs) -> None:
    global _static
    _static = inputs


def static_inputs() -> StaticTreeInputs | None:
    return _static


def begin(step: VerifyStep) -> None:
    global _current
    _current = step


def current() -> VerifyStep | None:
    return _current


def end() -> None:
    global _current
    _current = None
