"""DDTreeSpeculator: Model Runner V2's DFlash speculator, turning its one draft pass into a best-first tree
(docs/model-runner-v2.md §2.1, §2.2, §2.7).

The runner treats it as a DFlash speculator with ``K = B`` drafts per request (config.py sets
``num_speculative_tokens`` to the budget B and caps the depth by it): it stores the B tree tokens we return in
``req_states.draft_tokens`` and feeds them to the next verify step. Inside, "steps" are DFlash positions, i.e. the
tree depth. Differences from DFlash:

- ``_generate_draft`` (captured in DFlash's CUDA graphs) builds the trees from the per-depth logits instead of
  taking the argmax; the tree of batch row r lands in ``batch_trees[r]``;
- ``propose`` first linearises the verified step (positions back to linear, accepted path's hidden rows right
  after the root), runs DFlash unchanged, then files each batch row's tree under its request slot
  (``req_trees``), where the next ``prepare_verify`` finds it;
- ``prepare_verify`` and ``make_rejection_sampler`` are patch 0004's hooks into the verifier.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.attention import backend as tree_backends
from vllm_ddtree.cuda_graphs import warn_if_trees_outgrow_graphs
from vllm_ddtree.hang_dump import arm_from_env as arm_hang_dump
from vllm_ddtree.mrv2.verifier import MRV2TreeSampler, MRV2TreeVerifier
from vllm_ddtree.step_timing import StepTimer
from vllm_ddtree.tree.build import build_tree
from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.verify_layout import TREE_FIELDS

TREE_STATE_FIELDS = (*TREE_FIELDS, "num_nodes")


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        arm_hang_dump()  # VLLM_DDTREE_HANG_DUMP_S: bring-up aid, off by default
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
        self.req_trees = TreeBatch.allocate(self.max_num_reqs, self.tree_budget, device)  # by request slot
        self.timer = StepTimer(device)
        self.verifier = MRV2TreeVerifier(self.req_trees, self.tree_depth, self.max_num_tokens, device, self.timer)
        # Runs in the runner's __init__, before the target model is built: its layers get the tree backends.
        tree_backends.select_tree_attention_backend(vllm_config)
        tree_backends.install()
        warn_if_trees_outgrow_graphs(vllm_config, self.tree_budget)

    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        model_config = self.vllm_config.model_config  # (hybrid targets were refused with the config)
        if model_config.uses_mrope:
            raise NotImplementedError("ddtree on Model Runner V2 does not support M-RoPE targets yet")
        from vllm.model_executor.layers.attention import Attention

        forward_context = self.vllm_config.compilation_config.static_forward_context
        draft_layers = set(self.draft_attn_layer_names)
        tree_backends.prepare_target_layers(
            {n: m for n, m in forward_context.items() if isinstance(m, Attention) and n not in draft_layers},
            self.device,
        )
        self.verifier.forward_context = forward_context
        self.verifier.draft_layer_names = draft_layers

    def set_attn(self, model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups):
        super().set_attn(model_state, kv_cache_config, block_tables, target_input_buffers, target_attn_groups)
        self.verifier.block_tables = block_tables
        self.verifier.kv_cache_config = kv_cache_config

    # ------------------------------------------------------------------ patch 0004 hooks

    def make_rejection_sampler(self, sampler, rejection_sampler) -> MRV2TreeSampler:
        return MRV2TreeSampler(self.verifier, sampler, rejection_sampler)

    def prepare_verify(self, input_batch) -> None:
        self.verifier.prepare(input_batch)

    # ------------------------------------------------------------------ drafting

    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        """DFlash's forward, then the tree build; static shapes, no host sync, so DFlash's graphs capture it."""
        hidden_states = self._run_model(
            num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp, cudagraph_runtime_mode
        )
        num_sample = num_reqs * self.tree_depth
        logits = self.model.compute_logits(hidden_states[self.sample_indices[:num_sample]])
        roots = self.input_buffers.input_ids[self._anchor_idx[:num_reqs]].to(torch.int64)
        build_tree(logits.view(num_reqs, self.tree_depth, -1), self.tree_budget, self.batch_trees, roots)
        self.draft_tokens[:num_reqs] = self.batch_trees.token_ids[:num_reqs, 1:]

    def propose(
        self,
        input_batch,
        attn_metadata,
        slot_mappings,
        last_hidden_states,
        aux_hidden_states,
        num_sampled,
        num_rejected,
        last_sampled,
        next_prefill_tokens,
        temperature,
        seeds,
        num_tokens_across_dp=None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs=None,
        is_profile: bool = False,
    ) -> torch.Tensor:
        verifier = self.verifier
        timed = verifier.rows is not None and not dummy_run
        if timed:
            self.timer.mark("propose")
            # DFlash takes every scheduled row as context: the accepted path must be the first 1 + m rows.
            if aux_hidden_states:
                aux_hidden_states = verifier.linearise(input_batch, aux_hidden_states)
            else:
                [last_hidden_states] = verifier.linearise(input_batch, [last_hidden_states])
            self.timer.mark("linearised")
            self.timer.mark("build")
        verifier.finish_step()
        draft_tokens = super().propose(
            input_batch,
            attn_metadata,
            slot_mappings,
            last_hidden_states,
            aux_hidden_states,
            num_sampled,
            num_rejected,
            last_sampled,
            next_prefill_tokens,
            temperature,
            seeds,
            num_tokens_across_dp=num_tokens_across_dp,
            dummy_run=dummy_run,
            skip_attn_for_dummy_run=skip_attn_for_dummy_run,
            mm_inputs=mm_inputs,
            is_profile=is_profile,
        )
        if not dummy_run:  # dummy batches' slots 0..R-1 may belong to live requests
            self.file_trees(input_batch)
        if timed:
            self.timer.mark("built")
        return draft_tokens

    def file_trees(self, input_batch) -> None:
        """``req_trees[slot] = batch_trees[row]``: the next verify step finds each tree by its request's slot."""
        num_reqs = input_batch.num_reqs
        slots = input_batch.idx_mapping.to(torch.int64)
        for name in TREE_STATE_FIELDS:
            getattr(self.req_trees, name).index_copy_(0, slots, getattr(self.batch_trees, name)[:num_reqs])
