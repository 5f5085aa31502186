"""DDTreeProposer: the V1 runner's adapter on the drafting side (vLLM's DFlash drafter, trees instead of a chain).

Patch 0002 builds it instead of ``DFlashProposer``; the runner drives it exactly like DFlash. Differences:

1. Before drafting, the verified step is linearised (``TreeVerifyCore.linearise``): the accepted path's rows move
   right after each root in the target inputs the drafter reads, so DFlash's input kernel, which takes the first
   ``1 + m`` rows as context, works unchanged.
2. The drafter always drafts ``tree_depth`` positions; the per-depth logits ``[R, depth, V]`` become a best-first
   tree per request (``tree.build``, replayed from a CUDA graph for small batches), filed under the request's slot
   for the next verify step (``TreeHandover``); when the scheduler gave that step to the chain fallback, only the
   chain is filed, as a chain-shaped tree (``build_chain``). The runner gets the tree's first B (or this step's
   budget) tokens, which is what the scheduler schedules.

It owns the worker's ``TreeVerifyCore``, which the verifying side (``v1/sampler.py``) is handed by patch 0002.
"""

from __future__ import annotations

import logging

import torch
from vllm.config import VllmConfig
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree import LOGGER_NAME
from vllm_ddtree.attention import backend as tree_backends
from vllm_ddtree.config import budget_choices, chain_fallback, describe_runner
from vllm_ddtree.cuda_graphs import (
    DrafterCaptureOnce,
    GraphedStep,
    graphs_enabled,
    largest_bucket,
    warn_if_budget_schedule_drops_full_graphs,
    warn_if_tensor_parallel_graphs,
    warn_if_trees_outgrow_graphs,
)
from vllm_ddtree.synthetic_acceptance import synthetic_acceptance
from vllm_ddtree.tree.build import build_chain, build_tree
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree_handover import RequestSlots, TreeHandover
from vllm_ddtree.verify_core import TreeVerifyCore, verify_widths

logger = logging.getLogger(LOGGER_NAME)


class DDTreeProposer(DFlashProposer):
    # Test seam: ``hook(proposer, logits [R, depth, V]) -> logits`` sees the draft logits before the tree build
    # (tests/engine's oracle drafter makes trees that get accepted through it). None in production.
    draft_logits_hook = None

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config, device, runner)
        spec = vllm_config.speculative_config
        self.runner = runner
        self.tree_budget: int = spec.tree_budget
        self.tree_depth: int = spec.tree_depth
        max_reqs = vllm_config.scheduler_config.max_num_seqs
        graphs = graphs_enabled(vllm_config, device)
        self.synthetic = synthetic_acceptance(spec, device)  # benchmark mode, else None
        self.slots = RequestSlots(max_reqs)  # V1's batch rows move; trees are filed by request slot
        chain_depth = self.tree_depth if chain_fallback(spec) else 0
        self.core = TreeVerifyCore(
            TreeHandover(max_reqs, self.tree_budget, device, chain_depth), self.tree_depth, max_reqs,
            vllm_config.scheduler_config.max_num_batched_tokens, device, cuda_graphs=graphs,
            verify_widths=verify_widths(spec), synthetic=self.synthetic, choices=budget_choices(spec),
        )
        self.draft_trees = TreeBatch.allocate(max_reqs, self.tree_budget, device)  # this draft step's, batch order
        # The chain fallback's: each batch row's DFlash chain, filed beside its tree.
        self.draft_chains = (torch.zeros(max_reqs, chain_depth, dtype=torch.int64, device=device)
                             if chain_depth else None)
        self._slot_ids = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        # The build replays from a CUDA graph for small batches; its inputs are copied into these static buffers.
        self._build_graphs = GraphedStep(self._build_rows, largest_bucket(max_reqs), device, enabled=graphs)
        self._chain_graphs = GraphedStep(self._chain_rows, largest_bucket(max_reqs), device, enabled=graphs)
        self._drafting_chain = False  # the next step verifies the chain: file it, build no tree
        self._graph_logits: torch.Tensor | None = None  # [graph rows, depth, vocab], allocated on first use
        self._graph_roots = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self._placeholder_drafts = torch.zeros(max_reqs * self.tree_depth, dtype=torch.int64, device=device)
        self._capture_once = DrafterCaptureOnce(vllm_config.parallel_config.tensor_parallel_size)
        # Before the target model is built: its attention layers then pick the tree-aware backend subclasses.
        tree_backends.check_attention_config(vllm_config)
        tree_backends.install()
        warn_if_trees_outgrow_graphs(vllm_config, self.tree_budget)
        warn_if_tensor_parallel_graphs(vllm_config, device)
        warn_if_budget_schedule_drops_full_graphs(vllm_config, device)
        logger.info(describe_runner(vllm_config, on_mrv2=False))

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        from vllm.model_executor.layers.attention import Attention

        draft_layers = set(self._draft_attn_layer_names)
        forward_context = self.vllm_config.compilation_config.static_forward_context
        tree_backends.prepare_target_layers(
            {n: m for n, m in forward_context.items() if isinstance(m, Attention) and n not in draft_layers},
            self.core.attention, self.device,
        )
        if self.vllm_config.model_config.is_hybrid:
            self.core.hybrid = self._hybrid_target()

    def _hybrid_target(self):
        """GatedDeltaNet layers verify trees (config.validate_ddtree_drafter allowed this target)."""
        from vllm_ddtree.config import DDTreeConfigError
        from vllm_ddtree.hybrid.target import HybridTreeTarget

        mode = self.vllm_config.cache_config.mamba_cache_mode
        if mode != "none":
            raise DDTreeConfigError(
                f"ddtree on a hybrid target lays out each step's recurrent state itself (docs/hybrid-state-layout.md), "
                f"which prefix caching of recurrent state (mamba_cache_mode={mode!r}) does not allow: pass "
                "--no-enable-prefix-caching"
            )
        return HybridTreeTarget(self.core, self.runner, self.device)

    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True, is_graph_capturing: bool = False,
                  slot_mappings=None) -> None:
        if is_graph_capturing and use_cudagraphs and self._capture_once.enabled:
            mode, padded, _ = self._determine_batch_execution_and_padding(min(num_tokens, self.max_query_tokens))
            use_cudagraphs = self._capture_once.use_graphs((mode, padded), num_tokens)
        super().dummy_run(num_tokens, use_cudagraphs, is_graph_capturing, slot_mappings)

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
        core = self.core
        core.timer.mark("propose")
        step = core.take_step()
        if step is not None and num_rejected_tokens_gpu is not None:
            order = core.linearise(step)
            if order is not None:
                target_token_ids = target_token_ids[order]
                target_positions = target_positions[..., order]
                target_hidden_states = target_hidden_states[order]
        core.timer.mark("linearised")
        num_reqs = common_attn_metadata.batch_size()
        self._root_token_ids = next_token_ids
        self._drafting_chain = core.next_step_is_chain(num_speculative_tokens)
        super().propose(self.tree_depth, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                        token_indices_to_sample, common_attn_metadata, sampling_metadata, mm_embed_inputs,
                        num_rejected_tokens_gpu, slot_mappings)
        req_ids = self.runner.input_batch.req_ids[:num_reqs]
        slots = self.slots.lookup(req_ids, self.runner.requests)
        self._slot_ids[:num_reqs].copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
        core.handover.file(self._slot_ids, self.draft_trees, num_reqs, self.draft_chains)
        # num_speculative_tokens is this step's budget: B, or what vLLM's dynamic speculative decoding schedule picks
        # for the batch size (the adaptive budget). Best-first order makes the first b nodes the tree of budget b.
        return self.draft_trees.token_ids[:num_reqs, 1 : 1 + min(num_speculative_tokens, self.tree_budget)]

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        """Parallel drafting's sampling step: build the trees from the logits instead of taking the argmax."""
        self.core.timer.mark("build")
        logits = self.model.compute_logits(hidden_states)
        num_reqs = logits.shape[0] // self.tree_depth
        logits = logits.view(num_reqs, self.tree_depth, -1)
        if self.draft_logits_hook is not None:
            logits = type(self).draft_logits_hook(self, logits)
        if self.synthetic is not None:
            self.synthetic.confident_drafts(logits)
        graphs = self._chain_graphs if self._drafting_chain else self._build_graphs
        if graphs.replays(num_reqs):
            if self._graph_logits is None:
                self._graph_logits = torch.zeros(
                    (graphs.max_rows, *logits.shape[1:]), dtype=logits.dtype, device=logits.device
                )
            self._graph_logits[:num_reqs].copy_(logits)
            self._graph_roots[:num_reqs].copy_(self._root_token_ids)
            graphs(num_reqs)
        elif self._drafting_chain:
            build_chain(logits, self.draft_trees, self._root_token_ids, self.draft_chains)
        else:
            build_tree(logits, self.tree_budget, self.draft_trees, self._root_token_ids, chain_out=self.draft_chains)
        self.core.timer.mark("built")
        return self._placeholder_drafts[: num_reqs * self.tree_depth], None

    def _build_rows(self, rows: int) -> None:
        """The graphed build: rows [:rows] of the static logits/roots buffers into ``draft_trees``."""
        build_tree(self._graph_logits[:rows], self.tree_budget, self.draft_trees, self._graph_roots[:rows],
                   chain_out=self.draft_chains)

    def _chain_rows(self, rows: int) -> None:
        """The graphed chain-only draft (the next step verifies the chain): as ``_build_rows``, no tree build."""
        build_chain(self._graph_logits[:rows], self.draft_trees, self._graph_roots[:rows], self.draft_chains)
