"""The target side of a DDTree step on Model Runner V2: depth positions before the forward, the tree walk in the
rejection sampler's place, KV compaction (docs/model-runner-v2.md §2.3-§2.6).

MRV2 feeds each decode request ``1 + nd`` rows: the root (its last sampled token) and ``nd`` drafts read from the
device buffer ``req_states.draft_tokens[slot]``, which the speculator filled with the tree's tokens one step
earlier. The trees themselves live in ``req_trees``, indexed by the same persistent slot (``req_state_idx``).

- ``MRV2TreeVerifier.prepare`` (patch 0004's ``prepare_verify`` hook, right after the slot mapping): a request
  verifies its tree only if every fed row equals the tree's token (the stale-tree guard: resumed or new requests
  are fed zeroed drafts while their slot may still hold an older request's tree); then the tree rows' positions
  become ``s + depth`` in place, and the trees are gathered into batch order for the attention kernel, all in one
  Triton launch (row_layout.py; so is ``linearise``, which gives the drafter the accepted paths as chains).
- ``MRV2TreeSampler``: one token per node with the runner's own ``Sampler`` (Gumbel noise keyed by the depth
  position, so siblings share noise and every emitted token is a fresh draw given the emitted prefix), the walk,
  then the accepted K/V moved onto the path. Its output follows MRV2's ``SamplerOutput`` contract with freshly
  allocated tensors (``AsyncOutput`` copies them on a side stream while the next step runs).

No host synchronisation: the only host data used are the CPU arrays MRV2 already holds for the step.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from vllm_ddtree import verify_step
from vllm_ddtree.cuda_graphs import GraphedStep, largest_bucket
from vllm_ddtree.mrv2.row_layout import (
    PreparedRows,
    RowBuffers,
    linearise_rows_torch,
    linearise_rows_triton,
    prepare_rows_torch,
    prepare_rows_triton,
)
from vllm_ddtree.sampler import TreeWalkOutput, walk_tree
from vllm_ddtree.step_timing import StepTimer
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.verify_layout import chain_order

logger = logging.getLogger("vllm_ddtree")

# Same switches as the V1 path (vllm_ddtree/verifier.py). CHECK_TREES logs, per verify step, how many requests
# with drafts the stale-tree guard refused (a host sync: for bring-up and tests only).
CHECK_RANKS_ENV = "VLLM_DDTREE_CHECK_RANKS"
CHECK_TREES_ENV = "VLLM_DDTREE_CHECK_TREES"


class MRV2TreeVerifier:
    """Per-worker verify state. ``req_trees``: the drafted trees by request slot (written by the speculator)."""

    def __init__(
        self,
        req_trees: TreeBatch,
        depth: int,
        max_num_tokens: int,
        device: torch.device,
        timer: StepTimer | None = None,
    ):
        max_reqs = req_trees.token_ids.shape[0]
        self.req_trees = req_trees
        self.budget = req_trees.budget
        self.depth = depth
        self.device = device
        self.timer = timer or StepTimer(device)  # VLLM_DDTREE_STEP_TIMING; "build -> built" is DFlash's whole pass
        # This step's trees in batch order: what the attention kernel (ancestor_bits) and the walk read.
        self.verify_trees = TreeBatch.allocate(max_reqs, self.budget, device)
        self.node_tokens = torch.zeros(max_reqs, self.budget + 1, dtype=torch.int64, device=device)
        self.walk = TreeWalkOutput.allocate(max_reqs, depth, device)
        self.tree_rows = torch.full((max_reqs,), -1, dtype=torch.int32, device=device)
        verify_step.publish_static_inputs(
            verify_step.StaticTreeInputs(self.verify_trees.ancestor_bits, self.tree_rows)
        )
        # One Triton launch on CUDA (and under TRITON_INTERPRET in tests); the torch reference elsewhere.
        use_triton = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        self._prepare_rows = prepare_rows_triton if use_triton else prepare_rows_torch
        self._linearise_rows = linearise_rows_triton if use_triton else linearise_rows_torch
        self._row_buffers = RowBuffers(max_reqs, max_num_tokens, device)
        self._row_identity = torch.arange(max_num_tokens, dtype=torch.int64, device=device)
        self._walk_graphs = GraphedStep(self._walk_rows, largest_bucket(max_reqs), device)
        self.rows: PreparedRows | None = None  # the step in flight: set by prepare, cleared by the speculator
        self.walked = False  # the step in flight has been walked (its accepted paths are in self.walk)
        self.compaction = None  # kv_layout.TargetKVCompaction, built on first use (caches bind after set_attn)
        self.block_tables = None  # MRV2's BlockTables, set by the speculator's set_attn
        self.kv_cache_config = None
        self.draft_layer_names: set[str] = set()
        self.forward_context: dict | None = None
        self.check_ranks = os.environ.get(CHECK_RANKS_ENV, "0") == "1"
        self.check_trees = os.environ.get(CHECK_TREES_ENV, "0") == "1"

    # ------------------------------------------------------------------ before the target forward

    def prepare(self, input_batch) -> None:
        """Guard, gather and depth positions for a step with drafts; publish it (verify_step.begin)."""
        self.rows = None
        self.walked = False
        if input_batch.num_draft_tokens == 0:  # also every dummy/capture batch (InputBatch.make_dummy)
            return
        self.timer.mark("prepare")
        num_reqs = input_batch.num_reqs
        prepared = self._prepare_rows(input_batch, self.req_trees, self.verify_trees, self.tree_rows, self._row_buffers)
        num_drafts_np = np.asarray(input_batch.num_draft_tokens_per_req[:num_reqs])
        if self.check_trees:
            refused = int(((num_drafts_np > 0) & ~prepared.has_tree.cpu().numpy()).sum())
            if refused:
                logger.info("ddtree: %d of %d requests with drafts verify no tree (stale or new)", refused, num_reqs)

        row_starts_np = np.asarray(input_batch.cu_num_logits_np[:num_reqs])
        root_rows_np = np.asarray(input_batch.query_start_loc_np[1 : num_reqs + 1]) - (num_drafts_np + 1)
        self.rows = prepared
        verify_step.begin(
            verify_step.VerifyStep(
                trees=self.verify_trees,
                num_reqs=num_reqs,
                num_nodes_cpu=num_drafts_np.copy(),
                has_tree_cpu=num_drafts_np > 0,  # may verify a tree: the guard decides on the device
                root_rows_cpu=root_rows_np,
                row_starts_cpu=row_starts_np,
                row_request=prepared.row_request,
                row_node=prepared.row_node,
            )
        )
        self.timer.mark("prepared")

    # ------------------------------------------------------------------ after the target forward

    def walk_trees(self, step: verify_step.VerifyStep, node_row_tokens: torch.Tensor) -> TreeWalkOutput:
        """Walk every tree of the step given one target token per logits row; the forward is over, so the
        attention goes back to causal (tree_rows = -1)."""
        num_reqs = step.num_reqs
        node_tokens = self.node_tokens[:num_reqs]
        node_tokens.zero_()
        node_tokens[step.row_request, step.row_node] = node_row_tokens
        self._walk_graphs(num_reqs)
        self.tree_rows[:num_reqs].fill_(-1)
        self.walked = True
        self.timer.mark("walked")
        if self.check_ranks:
            from vllm_ddtree.verifier import check_ranks_agree

            check_ranks_agree(self.walk.accepted_node_ids[:num_reqs])
        return self.walk

    def _walk_rows(self, rows: int) -> None:
        walk_tree(self.node_tokens[:rows], self.verify_trees, self.depth, self.walk)

    def compact_kv(self, input_batch) -> None:
        """Move accepted nodes' K/V from s + node to s + depth in every target layer, before anything reads them."""
        if self.compaction is None:
            from vllm_ddtree.kv_layout import TargetKVCompaction

            self.compaction = TargetKVCompaction(
                self.forward_context, self.draft_layer_names, self.kv_cache_config.kv_cache_groups
            )
        num_reqs = input_batch.num_reqs
        cu = input_batch.cu_num_logits[: num_reqs + 1]
        ctx_lens = input_batch.seq_lens[:num_reqs] - (cu[1:] - cu[:-1])  # the roots' positions s
        block_table = self.block_tables.input_block_tables[self.compaction.group][:num_reqs]
        self.compaction(block_table, ctx_lens, self.walk.accepted_node_ids[:num_reqs])
        self.timer.mark("compacted")

    # ------------------------------------------------------------------ for the drafter

    def linearise(self, input_batch, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        """For the drafter: undo the depth positions and, once the trees are walked, reorder the target's hidden
        rows so each accepted path is a chain right after its root (what MRV2's DFlash input kernel expects: it
        takes every scheduled row as context and the first ``1 + m`` as valid). Returns ``[T, H]`` tensors."""
        if self.rows is None:
            return hidden_states
        accepted = self.walk.accepted_node_ids[: input_batch.num_reqs] if self.walked else None
        order = self._linearise_rows(input_batch, self.rows, accepted, self._row_identity)
        if order is None:
            return hidden_states
        num_tokens = input_batch.num_tokens
        return [h[:num_tokens].index_select(0, order) for h in hidden_states]

    def finish_step(self) -> None:
        self.rows = None
        self.walked = False


class MRV2TreeSampler:
    """Model Runner V2's ``RejectionSampler`` slot: ``(logits, input_batch, draft_logits) -> SamplerOutput``."""

    def __init__(self, verifier: MRV2TreeVerifier, sampler, fallback):
        self.verifier = verifier
        self.sampler = sampler  # the runner's gpu.sample.sampler.Sampler
        self.fallback = fallback  # vLLM's RejectionSampler: steps without prepare_verify (no trees)

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits: torch.Tensor | None = None):
        step = verify_step.current()
        if step is None:
            return self.fallback(logits, input_batch, draft_logits)
        from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
        from vllm.v1.worker.gpu.metrics.logits import get_num_nans
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        sampler = self.sampler
        verifier = self.verifier
        verifier.timer.mark("sample")
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        rows = input_batch.logits_indices
        max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        return_logprobs = max_num_logprobs >= 0  # NO_LOGPROBS is -1
        # One token per node; positions are the depth positions, which key the Gumbel noise.
        node_row_tokens, processed = sampler.sample(
            logits,
            input_batch.expanded_idx_mapping,
            input_batch.idx_mapping_np,
            input_batch.positions[rows],
            input_batch.input_ids[rows],
            input_batch.expanded_local_pos,
            return_logprobs=return_logprobs,
        )
        walk = verifier.walk_trees(step, node_row_tokens.to(torch.int64))
        verifier.compact_kv(input_batch)
        verify_step.end()

        num_reqs = step.num_reqs
        width = 1 + min(verifier.depth, int(step.num_nodes_cpu.max(initial=0)))  # CPU data: no sync
        sampled = walk.output_token_ids[:num_reqs, :width].to(torch.int64)  # a copy: AsyncOutput reads it later
        num_sampled = walk.num_accepted[:num_reqs] + 1  # a new tensor
        logprobs = None
        if return_logprobs:
            logprobs = self._logprobs(
                input_batch,
                processed if sampler.logprobs_mode in ("processed_logprobs", "processed_logits") else logits,
                sampled,
                num_sampled,
                max_num_logprobs,
            )
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled,
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            sampler.req_states.prefill_len.gpu,
        )
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprobs_tensors=logprobs,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _logprobs(self, input_batch, logits, sampled, num_sampled, max_num_logprobs: int):
        """Logprobs as vLLM's RejectionSampler lays them out: output j of request r comes from logits row
        ``cu[r] + j``, so rows are first put in path order (row cu[r] + j <- cu[r] + acc[r, j])."""
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        verifier = self.verifier
        num_reqs = sampled.shape[0]
        num_logits = logits.shape[0]
        row_starts = verifier.rows.row_starts
        order = chain_order(verifier.walk.accepted_node_ids[:num_reqs], row_starts, num_logits)
        width = sampled.shape[1]
        j = torch.arange(width, device=sampled.device)
        dest = torch.where(j[None, :] < num_sampled[:, None], row_starts[:, None] + j[None, :], num_logits)
        flat_sampled = torch.zeros(num_logits + 1, dtype=sampled.dtype, device=sampled.device)
        flat_sampled.scatter_(0, dest.reshape(-1), sampled.reshape(-1))
        expanded_logits = num_logits != input_batch.idx_mapping.shape[0]
        return compute_topk_scores(
            logits.index_select(0, order),
            max_num_logprobs,
            flat_sampled[:num_logits],
            input_batch.cu_num_logits_np.tolist() if expanded_logits else None,
            logits_mode=self.sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )
