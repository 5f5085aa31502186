"""The target side of a DDTree step: lay the trees out for the verify forward, walk them, compact the KV cache.

``prepare`` runs inside vLLM's ``_prepare_inputs`` right after the slot mapping (runner hook, patch 0002): it
gathers each request's tree (built by the drafter one step earlier, under another batch order) into this step's
rows and rewrites the tree rows' positions to ``root position + depth``. Slots stay linear (node i of a request
lives at logical index s + i), which is why positions must change only after the slot mapping.

``TreeRejectionSampler`` takes the place of vLLM's ``RejectionSampler``: one target token per node (argmax or a
draw with the request's sampling parameters), the walk, then, before anything else reads the cache, the accepted
nodes' K/V move to the path slots s+1..s+m so the next step sees a plain chain.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree import verify_step
from vllm_ddtree.cuda_graphs import GraphedStep, largest_bucket
from vllm_ddtree.sampler import TreeWalkOutput, sample_node_tokens, walk_tree
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.verify_layout import depth_position_shift, gather_trees

if TYPE_CHECKING:
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata


# Set to 1 to compare every step's accepted paths across tensor-parallel ranks (one small all-gather and a host
# sync per step): each rank compacts its own KV shard, so ranks that disagree would silently diverge.
CHECK_RANKS_ENV = "VLLM_DDTREE_CHECK_RANKS"


# Set to 1 to check every verify step's trees against the tokens vLLM scheduled (one gather and a host sync per
# step; the engine tests turn it on): a tree whose nodes are not the scheduled drafts would be walked over inputs
# the target never saw.
CHECK_TREES_ENV = "VLLM_DDTREE_CHECK_TREES"


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
    checksums = gathered.sum(dim=1)
    if not bool((gathered == gathered[0]).all()):
        raise RuntimeError(
            f"ddtree: tensor-parallel ranks accepted different tree paths (checksums {checksums.tolist()}); "
            "their KV caches would diverge"
        )


class TreeVerifier:
    """Per-worker verify state; ``runner`` is vLLM's GPUModelRunner (or its CPU subclass)."""

    def __init__(self, runner, budget: int, depth: int, max_reqs: int, device: torch.device, timer):
        self.runner = runner
        self.timer = timer  # step_timing.StepTimer
        self.budget = budget
        self.depth = depth
        self.device = device
        self.trees = TreeBatch.allocate(max_reqs, budget, device)
        self.walk = TreeWalkOutput.allocate(max_reqs, depth, device)
        self.node_tokens = torch.zeros(max_reqs, budget + 1, dtype=torch.int64, device=device)
        self.tree_rows = torch.full((max_reqs,), -1, dtype=torch.int32, device=device)
        verify_step.publish_static_inputs(verify_step.StaticTreeInputs(self.trees.ancestor_bits, self.tree_rows))
        # The walk reads only static buffers (node_tokens, trees) and writes ``walk``: it replays from a graph.
        self._walk_graphs = GraphedStep(self._walk_rows, largest_bucket(max_reqs), device)
        self._compact = None  # built on first use: the KV caches exist only after vLLM allocated them
        self.check_ranks = os.environ.get(CHECK_RANKS_ENV, "0") == "1"
        self.check_trees = os.environ.get(CHECK_TREES_ENV, "0") == "1"
        self.last_step: verify_step.VerifyStep | None = None  # the walked step, for the drafter's linearisation
        self.hybrid = None  # hybrid.target.HybridTreeTarget on a GatedDeltaNet target (set by the proposer)

    # ------------------------------------------------------------------ before the target forward

    def prepare(
        self,
        spec_decode_metadata: SpecDecodeMetadata,
        num_draft_tokens: np.ndarray,
        cu_num_tokens: np.ndarray,
        draft_trees: TreeBatch,
        draft_rows: np.ndarray,
    ) -> None:
        """Gather this step's trees (``draft_rows[r]``: row of request r's tree in ``draft_trees``) and write the
        tree rows' depth positions in place; publish the step for the attention backend and the sampler."""
        self.timer.mark("prepare")
        num_reqs = len(num_draft_tokens)
        # A request whose drafts came from an older tree (it sat out the last draft step, e.g. preempted, and the
        # tree's row was reused since) verifies no tree: accepting nothing is always lossless.
        has_tree = (draft_rows >= 0) & (num_draft_tokens > 0)
        index = torch.from_numpy(np.maximum(draft_rows, 0)).to(self.device, non_blocking=True)
        gather_trees(draft_trees, index, self.trees)
        num_nodes = torch.from_numpy(np.where(has_tree, num_draft_tokens, 0).astype(np.int32))
        self.trees.num_nodes[:num_reqs].copy_(num_nodes, non_blocking=True)

        # Logits rows are each request's last 1 + drafts tokens: the root, then its nodes in tree order.
        num_rows = num_draft_tokens + 1
        row_request_np = np.repeat(np.arange(num_reqs), num_rows)
        row_starts = np.cumsum(num_rows) - num_rows
        row_node_np = np.arange(row_request_np.size) - np.repeat(row_starts, num_rows)
        row_request = torch.from_numpy(row_request_np).to(self.device, non_blocking=True)
        row_node = torch.from_numpy(row_node_np).to(self.device, non_blocking=True)
        row_has_tree = torch.from_numpy(np.repeat(has_tree, num_rows)).to(self.device, non_blocking=True)
        # Node i sits at slot s + i but its position is s + depth(i); rows without a tree keep chain positions.
        shift = depth_position_shift(self.trees, row_request, row_node, row_has_tree)
        rows = spec_decode_metadata.logits_indices
        runner = self.runner
        runner.positions[rows] += shift
        if getattr(runner, "uses_mrope", False):
            runner.mrope_positions.gpu[:, rows] += shift
        if self.check_trees:
            scheduled = runner.input_ids.gpu[rows].to(torch.int64)
            expected = self.trees.token_ids[row_request, row_node].to(torch.int64)
            if bool((row_has_tree & (scheduled != expected)).any()):
                raise RuntimeError("ddtree: a verified tree's tokens are not the drafts vLLM scheduled for it")

        tree_rows = np.where(has_tree, np.arange(num_reqs), -1).astype(np.int32)
        self.tree_rows[:num_reqs].copy_(torch.from_numpy(tree_rows), non_blocking=True)
        step = verify_step.VerifyStep(
            trees=self.trees,
            num_reqs=num_reqs,
            num_nodes_cpu=num_draft_tokens.copy(),
            has_tree_cpu=has_tree,
            root_rows_cpu=cu_num_tokens - num_rows,
            row_starts_cpu=row_starts,
            row_request=row_request,
            row_node=row_node,
        )
        verify_step.begin(step)
        self.timer.mark("prepared")

    # ------------------------------------------------------------------ after the target forward

    def sample(
        self,
        spec_decode_metadata: SpecDecodeMetadata,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Walk every tree; returns vLLM's ``[num_reqs, 1 + max drafts]`` token output (accepted, bonus, -1)."""
        step = verify_step.current()
        assert step is not None, "tree sampler called outside a verify step"
        self.timer.mark("sample")
        num_reqs = step.num_reqs
        row_tokens = self._sample_rows(logits, step, sampling_metadata)
        node_tokens = self.node_tokens[:num_reqs]
        node_tokens.zero_()
        node_tokens[step.row_request, step.row_node] = row_tokens
        self._walk_graphs(num_reqs)
        self.tree_rows[:num_reqs].fill_(-1)  # the target forward is done: later forwards are causal again
        walk = self.walk
        self.timer.mark("walked")
        if self.check_ranks:
            check_ranks_agree(walk.accepted_node_ids[:num_reqs])
        self._compact_kv(step, walk)
        if self.hybrid is not None:
            self.hybrid.relayout(num_reqs, walk.accepted_node_ids, walk.num_accepted)
        self.timer.mark("compacted")
        verify_step.end()
        self.last_step = step

        width = 1 + int(step.num_nodes_cpu.max(initial=0))
        out = torch.full((num_reqs, width), -1, dtype=torch.int32, device=self.device)
        n = min(width, self.depth + 1)
        out[:, :n] = walk.output_token_ids[:num_reqs, :n]
        return out

    def _walk_rows(self, rows: int) -> None:
        walk_tree(self.node_tokens[:rows], self.trees, self.depth, self.walk)

    def _sample_rows(
        self, logits: torch.Tensor, step: verify_step.VerifyStep, sampling_metadata: SamplingMetadata
    ) -> torch.Tensor:
        """One token per logits row with its request's sampling parameters (vLLM's semantics, sampler.py).

        min_p and logit_bias need no handling: vLLM refuses them for every speculative method."""
        md = sampling_metadata
        req = step.row_request
        if md.allowed_token_ids_mask is not None:
            logits = logits.masked_fill(md.allowed_token_ids_mask[req], float("-inf"))
        if md.all_greedy:
            return logits.argmax(dim=-1)

        def per_row(x):
            return None if x is None else x[req]

        # Seeded requests draw every one of their rows from their own generator, in row order.
        generators = {}
        if md.generators:
            starts = step.row_starts_cpu
            for r, gen in md.generators.items():
                for row in range(starts[r], starts[r] + step.num_nodes_cpu[r] + 1):
                    generators[int(row)] = gen
        tokens = sample_node_tokens(
            logits[:, None, :],
            all_greedy=False,
            all_random=md.all_random,
            temperature=per_row(md.temperature),
            top_k=per_row(md.top_k),
            top_p=per_row(md.top_p),
            generators=generators,
        )
        return tokens.view(-1)

    def _compact_kv(self, step: verify_step.VerifyStep, walk: TreeWalkOutput) -> None:
        """Move accepted nodes' K/V from s + node to s + depth in every target attention layer."""
        runner = self.runner
        if self._compact is None:
            from vllm_ddtree.kv_layout import TargetKVCompaction

            self._compact = TargetKVCompaction(
                runner.compilation_config.static_forward_context,
                getattr(runner.drafter, "_draft_attn_layer_names", ()) or (),
                runner.kv_cache_config.kv_cache_groups,
            )
        num_reqs = step.num_reqs
        num_rows = torch.from_numpy(step.num_nodes_cpu + 1).to(self.device, non_blocking=True)
        ctx_lens = runner.seq_lens[:num_reqs] - num_rows
        block_table = runner.input_batch.block_table[self._compact.group].get_device_tensor(num_reqs)
        self._compact(block_table, ctx_lens, walk.accepted_node_ids[:num_reqs])


class TreeRejectionSampler(torch.nn.Module):
    """Drop-in for vLLM's ``RejectionSampler`` in the runner (same call signature and output)."""

    def __init__(self, verifier: TreeVerifier, sampler, fallback: torch.nn.Module):
        super().__init__()
        self.verifier = verifier
        self.sampler = sampler  # vLLM's Sampler: its logprobs helpers and mode
        self.fallback = fallback  # vLLM's RejectionSampler for its own dummy/profiling runs, which carry no trees

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        step = verify_step.current()
        if step is None:
            return self.fallback(metadata, draft_probs, logits, sampling_metadata)
        tokens = self.verifier.sample(metadata, logits, sampling_metadata)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(step, logits, tokens, sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=logprobs)

    def _logprobs(self, step: verify_step.VerifyStep, logits: torch.Tensor, tokens: torch.Tensor, k: int):
        """Logprobs of every output slot: output j was drawn at accepted node j, i.e. logits row start + acc[j].

        Padding slots get row 0 / token 0 and are dropped by vLLM's parse_output (it filters on the -1 tokens)."""
        num_reqs, width = tokens.shape
        starts = torch.from_numpy(step.row_starts_cpu).to(logits.device, non_blocking=True)
        acc = self.verifier.walk.accepted_node_ids[:num_reqs, : min(width, self.verifier.depth + 1)].to(torch.int64)
        acc = torch.nn.functional.pad(acc, (0, width - acc.shape[1]), value=-1)
        rows = torch.where(acc >= 0, starts[:, None] + acc, 0).flatten()
        chosen = logits[rows].to(torch.float32)
        if not self.sampler.logprobs_mode.endswith("logits"):
            chosen = self.sampler.compute_logprobs(chosen)
        return self.sampler.gather_logprobs(chosen, k, tokens.clamp(min=0).flatten().to(torch.int64))
