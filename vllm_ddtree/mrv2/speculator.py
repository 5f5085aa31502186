"""DDTreeSpeculator: Model Runner V2's adapter on the drafting side (its DFlash speculator, trees instead of a chain).

Patch 0004's ``init_speculator`` hook builds it. The runner treats it as a DFlash speculator with ``K = B`` drafts
per request (config.py sets ``num_speculative_tokens`` to the budget B): it stores the B tree tokens we return in
``req_states.draft_tokens`` and feeds them to the next verify step. Inside, "steps" are DFlash positions (the depth).

- ``_generate_draft`` (in DFlash's CUDA graphs) builds the trees from the per-depth logits instead of the argmax,
  batch row r's into ``batch_trees[r]``; when the scheduler already gave the next step to the chain
  (``num_spec_tokens_to_schedule``, read in ``prepare_verify``), only the chain (``build_chain``), from a second set
  of draft graphs;
- ``propose`` linearises the verified step first (``TreeVerifyCore.linearise``: MRV2's DFlash input kernel takes every
  scheduled row as context, so each accepted path must follow its root), runs DFlash, then files each row's tree
  under its request slot for the next verify step;
- ``prepare_verify`` and ``make_rejection_sampler``, patch 0004's other hooks: the input batch becomes the core's
  ``RowInputs``; the rejection sampler's slot gets ``mrv2/sampler.py``, which shares this speculator's core.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree import LOGGER_NAME
from vllm_ddtree.attention import backend as tree_backends
from vllm_ddtree.config import budget_choices, chain_fallback, describe_runner, without_budget_schedule
from vllm_ddtree.cuda_graphs import graphs_enabled, warn_if_tensor_parallel_graphs, warn_if_trees_outgrow_graphs
from vllm_ddtree.mrv2.sampler import MRV2TreeSampler
from vllm_ddtree.synthetic_acceptance import synthetic_acceptance
from vllm_ddtree.tree.build import build_chain, build_tree
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.tree_handover import TreeHandover
from vllm_ddtree.verify_core import TreeVerifyCore, verify_widths
from vllm_ddtree.verify_rows import RowInputs

logger = logging.getLogger(LOGGER_NAME)


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        spec = vllm_config.speculative_config
        if spec.use_local_argmax_reduction:
            raise ValueError("ddtree builds its trees from the full draft logits; drop use_local_argmax_reduction")
        # The base sizes draft_tokens [max_reqs, B] and its sample buffers by K = B >= depth.
        super().__init__(vllm_config, device)
        self.tree_budget: int = spec.tree_budget
        self.tree_depth: int = spec.tree_depth
        self.num_speculative_steps = self.tree_depth
        self.num_query_per_req = 1 + self.tree_depth
        self.sample_col = torch.arange(self.tree_depth, dtype=torch.int32, device=device).repeat(self.max_num_reqs)
        # Query offset 0 of each request is the anchor: the bonus token, i.e. the tree's root.
        self._anchor_idx = torch.arange(self.max_num_reqs, dtype=torch.int64, device=device) * self.num_query_per_req
        self.batch_trees = TreeBatch.allocate(self.max_num_reqs, self.tree_budget, device)  # by batch row
        chain_depth = self.tree_depth if chain_fallback(spec) else 0
        # The chain fallback's: each batch row's DFlash chain, filed beside its tree. When the next step verifies
        # the chain, the drafter files it without a tree build (``build_chain``), from its own CUDA graphs. (The
        # chain fallback runs on MRV2 only with async scheduling: settle_budget_policy.)
        self.batch_chains = (torch.zeros(self.max_num_reqs, chain_depth, dtype=torch.int64, device=device)
                             if chain_depth else None)
        self._next_num_drafts: int | None = None  # this step's num_spec_tokens_to_schedule
        self._drafting_chain = False
        self._chain_graphs = None  # DFlashCudaGraphManager of the chain-only drafts
        self.synthetic = synthetic_acceptance(spec, device)  # benchmark mode, else None
        self.core = TreeVerifyCore(
            TreeHandover(self.max_num_reqs, self.tree_budget, device, chain_depth), self.tree_depth,
            self.max_num_reqs, self.max_num_tokens, device, cuda_graphs=graphs_enabled(vllm_config, device),
            verify_widths=verify_widths(spec), synthetic=self.synthetic, choices=budget_choices(spec),
            runner_verifies_chains=self.synthetic is None)
        # Runs in the runner's __init__, before the target model is built: its layers get the tree backends.
        tree_backends.check_attention_config(vllm_config)
        tree_backends.install()
        warn_if_trees_outgrow_graphs(vllm_config, self.tree_budget)
        warn_if_tensor_parallel_graphs(vllm_config, device)
        logger.info(describe_runner(vllm_config, on_mrv2=True))

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """DFlash's, seeing no budget schedule: under one, MRV2's graph manager derives the drafter's query lengths
        as each schedule budget ``b`` plus ``1 + depth - B`` (negative for small ``b``: capture fails), while DDTree's
        drafter runs ``1 + depth`` queries per request whatever budget the next verify step gets. With the
        chain fallback (``batch_chains``), a second manager too, whose graphs draft only chains."""
        vllm_config = self.vllm_config
        if vllm_config.speculative_config.num_speculative_tokens_per_batch_size is not None:
            self.vllm_config = without_budget_schedule(vllm_config)
        try:
            super().init_cudagraph_manager(cudagraph_mode)
            if self.batch_chains is not None:  # a second set of draft graphs, chain-only (same global graph pool)
                tree_graphs = self.query_cudagraph_manager
                super().init_cudagraph_manager(cudagraph_mode)
                self._chain_graphs, self.query_cudagraph_manager = self.query_cudagraph_manager, tree_graphs
        finally:
            self.vllm_config = vllm_config

    def capture(self) -> None:
        super().capture()
        if self._chain_graphs is not None:
            with self._drafting_chains():
                super().capture()

    @contextlib.contextmanager
    def _drafting_chains(self):
        """``_generate_draft`` files chains (``build_chain``), through the chain-only graphs."""
        tree_graphs = self.query_cudagraph_manager
        self._drafting_chain, self.query_cudagraph_manager = True, self._chain_graphs
        try:
            yield
        finally:
            self._drafting_chain, self.query_cudagraph_manager = False, tree_graphs

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        model_config = self.vllm_config.model_config  # (M-RoPE and hybrid targets run on the V1 runner)
        if model_config.uses_mrope:
            raise NotImplementedError("ddtree on Model Runner V2 does not support M-RoPE targets yet")
        from vllm.model_executor.layers.attention import Attention

        forward_context = self.vllm_config.compilation_config.static_forward_context
        draft_layers = set(self.draft_attn_layer_names)
        tree_backends.prepare_target_layers(
            {n: m for n, m in forward_context.items() if isinstance(m, Attention) and n not in draft_layers},
            self.core.attention, self.device)

    # ------------------------------------------------------------------ patch 0004 hooks

    def make_rejection_sampler(self, sampler, rejection_sampler) -> MRV2TreeSampler:
        return MRV2TreeSampler(self, sampler, rejection_sampler)

    def prepare_verify(self, input_batch, scheduler_output=None) -> None:
        """Right after the slot mapping (every dummy and capture batch has no drafts: nothing to do)."""
        self._next_num_drafts = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        if input_batch.num_draft_tokens == 0:
            self.core.no_drafts()
            return
        num_reqs = input_batch.num_reqs
        rows = RowInputs(slots=input_batch.idx_mapping, cu_num_logits=input_batch.cu_num_logits,
                         logits_indices=input_batch.logits_indices, input_ids=input_batch.input_ids,
                         positions=input_batch.positions, mrope_positions=None, num_reqs=num_reqs,
                         num_tokens=input_batch.num_tokens)
        self.core.prepare(rows, np.asarray(input_batch.num_draft_tokens_per_req[:num_reqs]))

    def bind_kv_caches(self) -> None:
        """On first use: the caches are bound only after ``set_attn`` (``init_kv_cache``)."""
        self.core.bind_kv_caches(self.vllm_config.compilation_config.static_forward_context,
                                 set(self.draft_attn_layer_names), self.kv_cache_config.kv_cache_groups)

    # ------------------------------------------------------------------ drafting

    def _generate_draft(self, num_reqs: int, num_tokens_padded: int, attn_metadata: dict[str, Any] | None,
                        slot_mappings: dict[str, torch.Tensor] | None, num_tokens_across_dp: torch.Tensor | None,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE) -> None:
        """DFlash's forward, then the tree build; static shapes, no host sync, so DFlash's graphs capture it."""
        hidden_states = self._run_model(
            num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode
        )
        num_sample = num_reqs * self.tree_depth
        logits = self.model.compute_logits(hidden_states[self.sample_indices[:num_sample]])
        roots = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]].to(torch.int64)
        logits = logits.view(num_reqs, self.tree_depth, -1)
        if self.synthetic is not None:
            self.synthetic.confident_drafts(logits)
        if self._drafting_chain:
            build_chain(logits, self.batch_trees, roots, self.batch_chains)
        else:
            build_tree(logits, self.tree_budget, self.batch_trees, roots, chain_out=self.batch_chains)
        self.draft_tokens[:num_reqs] = self.batch_trees.token_ids[:num_reqs, 1:]

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, *args,
                dummy_run: bool = False, **kwargs) -> torch.Tensor:
        """DFlash's ``propose`` (the runner passes its arguments by position or by name) on the linearised step."""
        core = self.core
        step = None if dummy_run else core.take_step()
        if step is not None:
            core.timer.mark("propose")
            order = core.linearise(step)
            if order is not None:  # DFlash takes every scheduled row as context: the path must come first
                num_tokens = input_batch.num_tokens
                if aux_hidden_states:
                    # DFlash concatenates the layers before its row-wise projection: one gather of the concatenation
                    # (a list of one) is the same input in fewer launches than a gather per layer.
                    aux_hidden_states = [torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1)
                                         .index_select(0, order)]
                else:
                    last_hidden_states = last_hidden_states[:num_tokens].index_select(0, order)
            core.timer.mark("linearised")
            core.timer.mark("build")
        chain_only = (not dummy_run and self._next_num_drafts is not None
                      and core.next_step_is_chain(self._next_num_drafts))  # (False without the chain fallback)
        with self._drafting_chains() if chain_only else contextlib.nullcontext():
            draft_tokens = super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                                           aux_hidden_states, *args, dummy_run=dummy_run, **kwargs)
        if not dummy_run:  # dummy batches' slots 0..R-1 may belong to live requests
            core.handover.file(input_batch.idx_mapping, self.batch_trees, input_batch.num_reqs, self.batch_chains)
        if step is not None:
            core.timer.mark("built")
        return draft_tokens

