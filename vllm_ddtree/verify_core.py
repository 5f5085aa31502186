"""The target side of a DDTree step, runner-agnostic: tensors in, tensors out, static buffers.

One verify step, in the order the runner adapters (``v1/``, ``mrv2/``) call it:

1. ``prepare(rows)`` right after the runner's slot mapping: the guard, the trees gathered into batch order, depth
   positions in place (``verify_rows.prepare_rows``); the step is then *in flight* for the target's attention,
   which reads ``attention`` (static buffers, so a captured CUDA graph replays with this step's trees);
2. the runner's forward and logits; the adapter draws one target token per logits row with its runner's sampler;
3. ``walk(node_row_tokens)``: the walk (``walk_triton``, one launch, replayed from a graph; ``sampler.walk_tree`` is
   its reference and the CPU engine's), then KV compaction of the
   accepted nodes onto the path (and a hybrid target's recurrent state, ``hybrid/``), so the next step sees a chain;
4. ``linearise(...)`` for the drafter: positions back to linear, accepted rows right after their roots;
   ``path_rows`` puts logits rows in accepted-path order for the runner's logprobs.

With the chain fallback on (``"tree_budgets": ["chain", ...]``, docs/cost-aware-budget.md) a step whose widest
request was scheduled ``depth`` drafts is a *chain step*: every request of it verifies the first drafts of its
DFlash chain (filed beside its tree; ``prepare`` swaps them in where the runner fed a tree's), causally, on vLLM's
attention. KV compaction and linearisation have nothing to do (positions stay linear, accepted nodes 0..k sit at
their path slots already) and are skipped. With ``runner_verifies_chains`` (Model Runner V2, whose rejection sampler
reads the drafts from the fed rows that ``prepare`` swapped) the runner's own rejection sampler verifies chain steps,
as in vLLM's DFlash chain engine, and the walk and the acceptance by choice are skipped (``runner_verified``);
otherwise (V1, whose sampler reads the scheduler's drafts; synthetic acceptance) the walk runs on the chain as on any
tree. The step decides, not the request: fed tokens, attention and verification must agree for all.

With budget choices (``"tree_budgets"``) the walk also fills ``by_choice``: what each choice would have accepted on
the step's tokens (``acceptance_by_choice``), which the adapters hand to the scheduler's budget policy.

Nothing here synchronises with the host unless a debug check asks for it (``VLLM_DDTREE_CHECK_TREES``,
``VLLM_DDTREE_CHECK_RANKS``: each raises on what it finds, on either runner).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.acceptance_by_choice import ChoiceAcceptance
from vllm_ddtree.config import chain_fallback
from vllm_ddtree.cuda_graphs import GraphedStep, largest_bucket
from vllm_ddtree.kernel_choice import triton_kernels_on
from vllm_ddtree.sampler import TreeWalkOutput, walk_tree
from vllm_ddtree.step_timing import StepTimer
from vllm_ddtree.synthetic_acceptance import SyntheticAcceptance
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree_handover import TreeHandover
from vllm_ddtree.verify_rows import (
    PreparedRows,
    RowBuffers,
    RowInputs,
    chain_order,
    linearise_rows_torch,
    linearise_rows_triton,
    prepare_rows_torch,
    prepare_rows_triton,
)
from vllm_ddtree.walk_triton import walk_tree_triton

# Set to 1 to raise when a request is fed drafts of a fresh tree that differ from the tree (the target would verify
# tokens the tree does not hold: a bug in the hand-over). One host sync per verify step; the engine tests set it.
CHECK_TREES_ENV = "VLLM_DDTREE_CHECK_TREES"
# Set to 1 to raise when tensor-parallel ranks accept different paths (one small all-gather and a host sync per
# step): each rank compacts its own KV shard, so ranks that disagree would silently diverge.
CHECK_RANKS_ENV = "VLLM_DDTREE_CHECK_RANKS"


@dataclass
class VerifyStep:
    """The verify step in flight: what the runner knew on the host, and the device row layout."""

    rows: RowInputs
    prepared: PreparedRows
    num_drafts_cpu: np.ndarray  # [R] drafts fed per request (its logits rows are the root, then these)
    chain: bool = False  # verifies the requests' DFlash chains (causal attention), not their trees
    walked: bool = False

    @property
    def num_reqs(self) -> int:
        return self.rows.num_reqs

    @property
    def output_width(self) -> int:
        """Output columns: accepted drafts (at most the depth) + the bonus, from host data only."""
        return 1 + int(self.num_drafts_cpu.max(initial=0))


class TreeAttentionInputs:
    """What the target's attention layers read (attention/backend.py holds a reference per target layer).

    ``ancestor_bits`` and ``tree_rows`` are static buffers: ``tree_rows[r]`` is r while request r verifies a tree,
    else -1 (causal), and -1 everywhere outside a verify forward. ``verify_widths`` (``verify_widths``) are the query
    lengths of full verify batches: such batches run the tree kernel on every row, also inside a captured graph.
    ``step`` is the step in flight (host-side; eager or piecewise attention uses it to redo tree rows after vLLM's
    own kernel). ``prefix_of_forward`` is FLASH_ATTN's (metadata, capturing, committed keys per request, FlashAttention
    3's scheduler metadata) of the forward in flight (attention/backend.py ``_prefix_split``)."""

    def __init__(self, ancestor_bits: torch.Tensor, tree_rows: torch.Tensor, verify_widths: frozenset[int]):
        self.ancestor_bits = ancestor_bits
        self.tree_rows = tree_rows
        self.verify_widths = verify_widths
        self.step: VerifyStep | None = None
        self.prefix_of_forward: tuple | None = None


def verify_widths(spec) -> frozenset[int]:
    """Query lengths of full verify batches: ``1 + B``, and ``1 + b`` for each budget of an adaptive schedule (vLLM
    captures full graphs for each), but not the chain's ``1 + depth``: chain steps are causal, vLLM's attention."""
    budgets = {spec.tree_budget} | {entry[2] for entry in spec.num_speculative_tokens_per_batch_size or ()}
    if chain_fallback(spec):
        budgets.discard(spec.tree_depth)
    return frozenset(1 + b for b in budgets)


class TreeVerifyCore:
    """Per worker: this step's trees in batch order, the walk, compaction and row bookkeeping (module docstring)."""

    def __init__(self, handover: TreeHandover, depth: int, max_reqs: int, max_num_tokens: int,
                 device: torch.device, *, cuda_graphs: bool, verify_widths: frozenset[int] | None = None,
                 timer: StepTimer | None = None, synthetic: SyntheticAcceptance | None = None,
                 choices: Sequence[int] | None = None, runner_verifies_chains: bool = False):
        """``choices``: the budget policy's (``config.budget_choices``), None for a fixed budget.
        ``runner_verifies_chains``: the adapter hands chain steps to its runner's rejection sampler (docstring)."""
        self.handover = handover
        self.budget = handover.budget
        self.depth = depth
        assert handover.chains is None or handover.chains.shape[1] == depth, "chains are one token per depth"
        self.device = device
        self.timer = timer or StepTimer(device)
        self.verify_trees = TreeBatch.allocate(max_reqs, self.budget, device)  # this step's trees, batch order
        self.tree_rows = torch.full((max_reqs,), -1, dtype=torch.int32, device=device)
        self.attention = TreeAttentionInputs(self.verify_trees.ancestor_bits, self.tree_rows,
                                             verify_widths or frozenset({1 + self.budget}))
        self.cuda_graphs = cuda_graphs
        self.node_tokens = torch.zeros(max_reqs, self.budget + 1, dtype=torch.int64, device=device)
        self.walk_out = TreeWalkOutput.allocate(max_reqs, depth, device)
        self.synthetic = synthetic  # benchmark mode: the accepted depth is drawn, not verified
        assert not (runner_verifies_chains and synthetic is not None), "synthetic acceptance is the walk's"
        self.runner_verifies_chains = runner_verifies_chains
        self.by_choice = (ChoiceAcceptance(choices, depth, max_reqs, device, chain=handover.chains is not None)
                          if choices else None)
        # One Triton launch each way on CUDA (and under TRITON_INTERPRET in tests); the torch reference elsewhere.
        use_triton = triton_kernels_on(device)
        self._prepare_rows = prepare_rows_triton if use_triton else prepare_rows_torch
        self._linearise_rows = linearise_rows_triton if use_triton else linearise_rows_torch
        self._walk_tree = walk_tree_triton if use_triton else walk_tree
        self._row_buffers = RowBuffers(max_reqs, max_num_tokens, device)
        self._identity = torch.arange(max_num_tokens, dtype=torch.int64, device=device)
        # The walk reads only static buffers (node_tokens, verify_trees) and writes walk_out: replayed from a graph.
        self._walk_graphs = GraphedStep(self._walk_rows, largest_bucket(max_reqs), device, enabled=cuda_graphs)
        self.compaction = None  # kv_layout.TargetKVCompaction, from bind_kv_caches
        self.hybrid = None  # hybrid.target.HybridTreeTarget on a GatedDeltaNet target (V1 runner)
        self.check_trees = os.environ.get(CHECK_TREES_ENV, "0") == "1"
        self.check_ranks = os.environ.get(CHECK_RANKS_ENV, "0") == "1"
        self._in_flight: VerifyStep | None = None  # prepared, not yet handed to the drafter

    def bind_kv_caches(self, forward_context: dict, draft_layer_names, kv_cache_groups) -> None:
        """Once vLLM has bound the KV caches: the target's attention caches, for compaction."""
        from vllm_ddtree.kv_layout import TargetKVCompaction

        self.compaction = TargetKVCompaction(forward_context, draft_layer_names, kv_cache_groups)

    @property
    def step(self) -> VerifyStep | None:
        return self.attention.step

    # ------------------------------------------------------------------ before the target forward

    def no_drafts(self) -> None:
        """A step without drafts: nothing to verify, and no earlier step left in flight."""
        self.attention.step = self._in_flight = None

    def prepare(self, rows: RowInputs, num_drafts_cpu: np.ndarray) -> VerifyStep | None:
        """Guard, gather and depth positions for a step with drafts (``num_drafts_cpu [R]``); None without."""
        self.no_drafts()
        if not num_drafts_cpu[: rows.num_reqs].any():
            return None
        self.timer.mark("prepare")
        handover = self.handover
        chain = handover.chains is not None and int(num_drafts_cpu[: rows.num_reqs].max()) == self.depth
        prepared = self._prepare_rows(rows, handover.trees, handover.stamp, handover.epoch, self.verify_trees,
                                      self.tree_rows, self._row_buffers, handover.chains, chain)
        if self.by_choice is not None and not (chain and self.runner_verifies_chains):
            self.by_choice.prepare(rows.slots[: rows.num_reqs], handover.chains)
        if self.check_trees and bool(prepared.refused_fresh.any()):
            bad = prepared.refused_fresh.nonzero().flatten().tolist()
            raise RuntimeError(f"ddtree: batch rows {bad} were fed drafts that are not their fresh tree's tokens")
        step = VerifyStep(rows=rows, prepared=prepared, num_drafts_cpu=np.asarray(num_drafts_cpu[: rows.num_reqs]),
                          chain=chain)
        self.attention.step = self._in_flight = step
        self.timer.mark("prepared")
        return step

    # ------------------------------------------------------------------ after the target forward

    def walk(self, step: VerifyStep, node_row_tokens: torch.Tensor, block_table: torch.Tensor,
             seq_lens: torch.Tensor) -> TreeWalkOutput:
        """Walk every tree given one target token per logits row, then move the accepted nodes' K/V (and a hybrid
        target's state) onto the path. ``block_table``: the target attention group's, batch order; ``seq_lens``
        [>= R]: this step's sequence lengths (the roots' positions are ``seq_len - rows``). The forward is over,
        so attention goes back to causal (``tree_rows = -1``)."""
        self.timer.mark("sample")
        num_reqs = step.num_reqs
        node_tokens = self.node_tokens[:num_reqs]
        node_tokens.zero_()
        node_tokens[step.prepared.row_request, step.prepared.row_node] = node_row_tokens.to(torch.int64)
        self._walk_graphs(num_reqs)  # reads tree_rows (acceptance by choice): before the reset
        self.tree_rows[:num_reqs].fill_(-1)
        self.attention.step = None
        step.walked = True
        walk = self.walk_out
        self.timer.mark("walked")
        if self.check_ranks:
            check_ranks_agree(walk.accepted_node_ids[:num_reqs])
        if not step.chain:  # a chain's accepted nodes 0..k already sit at s..s+k
            cu = step.rows.cu_num_logits[: num_reqs + 1]
            ctx_lens = seq_lens[:num_reqs] - (cu[1:] - cu[:-1])  # the roots' positions s
            self.compaction(block_table, ctx_lens, walk.accepted_node_ids[:num_reqs])
        if self.hybrid is not None:
            self.hybrid.relayout(num_reqs, walk.accepted_node_ids, walk.num_accepted)
        self.timer.mark("compacted")
        return walk

    def runner_verified(self, step: VerifyStep) -> None:
        """The runner's rejection sampler verified this chain step (``runner_verifies_chains``): attention goes back
        to causal, and the drafter takes the step as it is (nothing to linearise). No acceptance by choice: the
        scheduler takes the requests' own accepted counts for the chain."""
        assert step.chain and self.runner_verifies_chains
        self.attention.step = None

    def _walk_rows(self, rows: int) -> None:
        if self.synthetic is not None:
            self.synthetic.force(self.node_tokens[:rows], self.verify_trees)
        self._walk_tree(self.node_tokens[:rows], self.verify_trees, self.depth, self.walk_out)
        if self.by_choice is not None:
            self.by_choice.fill(self.walk_out, self.verify_trees.num_nodes, self.tree_rows, rows)

    def acceptance(self, step: VerifyStep) -> torch.Tensor | None:
        """A fresh copy of the walked step's ``[R, C]`` accepted drafts per budget choice (batch order), for the
        scheduler (the adapters attach it to vLLM's SamplerOutput); None without choices."""
        return self.by_choice.out[: step.num_reqs].clone() if self.by_choice is not None and step.walked else None

    def path_rows(self, step: VerifyStep, num_logits: int) -> torch.Tensor:
        """Logits rows in accepted-path order: row ``start[r] + j <- start[r] + acc[r, j]`` (logprob j of request r
        was drawn at its j-th accepted node), identity elsewhere."""
        accepted = self.walk_out.accepted_node_ids[: step.num_reqs]
        return chain_order(accepted, step.prepared.row_starts, num_logits)

    # ------------------------------------------------------------------ for the drafter

    def next_step_is_chain(self, next_num_drafts: int) -> bool:
        """Whether the step after this one verifies the chain, from the draft count vLLM's scheduler already fixed
        for it (``SchedulerOutput.num_spec_tokens_to_schedule``, which this step's drafter drafts for: the
        placeholders of async scheduling, the drafts a V1 drafter returns): then the drafter can file its chain
        without building a tree (``tree.build.build_chain``)."""
        return self.handover.chains is not None and next_num_drafts == self.depth

    def take_step(self) -> VerifyStep | None:
        """The step verified since the last draft (walked, or at least prepared), once."""
        step, self._in_flight = self._in_flight, None
        return step

    def linearise(self, step: VerifyStep) -> torch.Tensor | None:
        """Positions back to linear; once walked, the row permutation [T] putting each accepted path right after
        its root (what DFlash's input preparation expects of a chain), else None. None on a chain step: its
        positions stayed linear and each accepted path already follows its root."""
        if step.chain:
            return None
        accepted = self.walk_out.accepted_node_ids[: step.num_reqs] if step.walked else None
        return self._linearise_rows(step.rows, step.prepared, accepted, self._identity)


def check_ranks_agree(accepted: torch.Tensor) -> None:
    """Raise if the tensor-parallel ranks walked their trees to different accepted paths."""
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return
    # Node ids are small integers, exact in float32 (some backends, e.g. the CPU's shared-memory all-gather,
    # gather floating-point tensors only).
    paths = accepted.flatten().to(torch.float32)
    gathered = group.all_gather(paths, dim=0).view(group.world_size, -1)
    if not bool((gathered == gathered[0]).all()):
        raise RuntimeError(
            f"ddtree: tensor-parallel ranks accepted different tree paths (checksums {gathered.sum(1).tolist()}); "
            "their KV caches would diverge"
        )
