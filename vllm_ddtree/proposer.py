"""DDTreeProposer: vLLM's DFlash drafter, keeping the per-depth logits and turning them into a best-first tree.

vLLM's runner drives it exactly like ``DFlashProposer`` (patch 0002 builds it instead when ``tree_budget`` is set).
Three differences:

1. The drafter always drafts ``tree_depth`` positions; the runner's ``num_speculative_tokens`` is the budget
   (config.py caps the depth by it) and only sizes vLLM's reservations.
2. Before drafting, the verify step's accepted path is made a straight chain in the target inputs the drafter reads
   (rows ``root, a1..am`` moved to the front of each request's block), so DFlash's input kernel, which takes the
   first ``1 + m`` rows as context, works unchanged.
3. The draft logits ``[R, depth, V]`` go through ``tree.build`` into a TreeBatch; the runner gets the tree's B
   tokens per request (what the scheduler schedules), the structure stays here, keyed by request id.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.attention import backend as tree_backends
from vllm_ddtree.cuda_graphs import (
    DrafterCaptureOnce,
    GraphedStep,
    largest_bucket,
    warn_if_tensor_parallel_graphs,
    warn_if_trees_outgrow_graphs,
)
from vllm_ddtree.hang_dump import arm_from_env as arm_hang_dump
from vllm_ddtree.step_timing import StepTimer
from vllm_ddtree.tree.build import build_tree
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.verifier import TreeRejectionSampler, TreeVerifier
from vllm_ddtree.verify_layout import chain_order


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        arm_hang_dump()  # VLLM_DDTREE_HANG_DUMP_S: bring-up aid, off by default
        super().__init__(vllm_config, device, runner)
        spec = vllm_config.speculative_config
        self.runner = runner
        self.tree_budget: int = spec.tree_budget
        self.tree_depth: int = spec.tree_depth
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        self.draft_trees = TreeBatch.allocate(max_reqs, self.tree_budget, device)
        self._draft_rows: dict[str, int] = {}  # request id -> its row in draft_trees
        self.timer = StepTimer(device)
        self.verifier = TreeVerifier(runner, self.tree_budget, self.tree_depth, max_reqs, device, self.timer)
        # The build replays from a CUDA graph for small batches; its inputs are copied into these static buffers.
        self._build_graphs = GraphedStep(self._build_rows, largest_bucket(max_reqs), device)
        self._graph_logits: torch.Tensor | None = None  # [graph rows, depth, vocab], allocated on first use
        self._graph_roots = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self._placeholder_drafts = torch.zeros(max_reqs * self.tree_depth, dtype=torch.int64, device=device)
        self._capture_once = DrafterCaptureOnce(vllm_config.parallel_config.tensor_parallel_size)
        # Before the target model is built: its attention layers then pick the tree-aware backend subclasses.
        tree_backends.select_tree_attention_backend(vllm_config)
        tree_backends.install()
        warn_if_trees_outgrow_graphs(vllm_config, self.tree_budget)
        warn_if_tensor_parallel_graphs(vllm_config, device)

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        from vllm.model_executor.layers.attention import Attention

        draft_layers = set(self._draft_attn_layer_names)
        forward_context = self.vllm_config.compilation_config.static_forward_context
        tree_backends.prepare_target_layers(
            {n: m for n, m in forward_context.items() if isinstance(m, Attention) and n not in draft_layers},
            self.device,
        )
        if self.vllm_config.model_config.is_hybrid:
            self.verifier.hybrid = self._hybrid_target()

    def _hybrid_target(self):
        """GatedDeltaNet layers verify trees (config.validate_ddtree_drafter allowed this target)."""
        from vllm_ddtree.config import DDTreeConfigError
        from vllm_ddtree.hybrid.target import HybridTreeTarget

        mode = self.vllm_config.cache_config.mamba_cache_mode
        if mode != "none":
            raise DDTreeConfigError(
                f"ddtree on a hybrid target keeps one state per tree node in the spec slots, which prefix caching "
                f"of recurrent state (mamba_cache_mode={mode!r}) does not: pass --no-enable-prefix-caching"
            )
        return HybridTreeTarget(self.verifier, self.runner, self.device)

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True, is_graph_capturing: bool = False,
                  slot_mappings=None) -> None:
        if is_graph_capturing and use_cudagraphs and self._capture_once.enabled:
            mode, padded, _ = self._determine_batch_execution_and_padding(min(num_tokens, self.max_query_tokens))
            use_cudagraphs = self._capture_once.use_graphs((mode, padded), num_tokens)
        super().dummy_run(num_tokens, use_cudagraphs, is_graph_capturing, slot_mappings)

    def make_tree_sampler(self, sampler) -> TreeRejectionSampler:
        fallback = RejectionSampler(sampler, self.speculative_config, self.device)
        return TreeRejectionSampler(self.verifier, sampler, fallback)

    def prepare_tree_verify(self, spec_decode_metadata, num_draft_tokens: np.ndarray, cu_num_tokens: np.ndarray):
        """Runner hook, right after the slot mapping of a step with drafts (see verifier.TreeVerifier.prepare)."""
        req_ids = self.runner.input_batch.req_ids[: len(num_draft_tokens)]
        draft_rows = np.array([self._draft_rows.get(rid, -1) for rid in req_ids], dtype=np.int64)
        # A tree serves the one verify step right after its propose. vLLM skips the drafter for a whole batch when
        # a request nears max_model_len (GPUModelRunner._input_fits_in_drafter) and schedules placeholder drafts
        # instead; the trees of the step before must then not be verified again.
        self._draft_rows = {}
        self.verifier.prepare(spec_decode_metadata, num_draft_tokens, cu_num_tokens, self.draft_trees, draft_rows)

    def propose(
        self,
        num_speculative_tokens,
        target_token_ids,
        target_positions,
        target_hidden_states,
        next_token_ids,
        token_indices_to_sample,
        common_attn_metadata,
        sampling_metadata,
        mm_embed_inputs=None,
        num_rejected_tokens_gpu=None,
        slot_mappings=None,
    ) -> torch.Tensor:
        self.timer.mark("propose")
        step = self.verifier.last_step
        self.verifier.last_step = None
        if step is not None and num_rejected_tokens_gpu is not None:
            order = self._chain_order(step, target_token_ids.shape[0])
            target_token_ids = target_token_ids[order]
            target_positions = target_positions[..., order]
            target_hidden_states = target_hidden_states[order]
        self.timer.mark("linearised")
        num_reqs = common_attn_metadata.batch_size()
        self._root_token_ids = next_token_ids
        super().propose(
            self.tree_depth,
            target_token_ids,
            target_positions,
            target_hidden_states,
            next_token_ids,
            token_indices_to_sample,
            common_attn_metadata,
            sampling_metadata,
            mm_embed_inputs,
            num_rejected_tokens_gpu,
            slot_mappings,
        )
        self._draft_rows = {rid: i for i, rid in enumerate(self.runner.input_batch.req_ids[:num_reqs])}
        # num_speculative_tokens is this step's budget: B, or what vLLM's dynamic speculative decoding schedule picks
        # for the batch size (the adaptive budget). Best-first order makes the first b nodes the tree of budget b.
        return self.draft_trees.token_ids[:num_reqs, 1 : 1 + min(num_speculative_tokens, self.tree_budget)]

    def _chain_order(self, step, num_tokens: int) -> torch.Tensor:
        """Row permutation putting each request's accepted path right after its root (rows root+k <- root+acc[k])."""
        root = torch.from_numpy(step.root_rows_cpu).to(self.device, non_blocking=True)
        return chain_order(self.verifier.walk.accepted_node_ids[: step.num_reqs], root, num_tokens)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """Parallel drafting's sampling step: build the trees from the logits instead of taking the argmax."""
        self.timer.mark("build")
        logits = self.model.compute_logits(hidden_states)
        num_reqs = logits.shape[0] // self.tree_depth
        logits = logits.view(num_reqs, self.tree_depth, -1)
        if self._build_graphs.replays(num_reqs):
            if self._graph_logits is None:
                self._graph_logits = torch.zeros(
                    (self._build_graphs.max_rows, *logits.shape[1:]), dtype=logits.dtype, device=logits.device
                )
            self._graph_logits[:num_reqs].copy_(logits)
            self._graph_roots[:num_reqs].copy_(self._root_token_ids)
            self._build_graphs(num_reqs)
        else:
            build_tree(logits, self.tree_budget, self.draft_trees, self._root_token_ids)
        self.timer.mark("built")
        return self._placeholder_drafts[: num_reqs * self.tree_depth], None

    def _build_rows(self, rows: int) -> None:
        """The graphed build: rows [:rows] of the static logits/roots buffers into ``draft_trees``."""
        build_tree(self._graph_logits[:rows], self.tree_budget, self.draft_trees, self._graph_roots[:rows])
