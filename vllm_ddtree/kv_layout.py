"""Find the target model's attention KV caches and compact them after a tree walk (either runner).

vLLM keeps one cache tensor per attention layer (``static_forward_context[name].kv_cache``), laid out by the
layer's backend. Both runners hand over that context, the drafter's layer names and the KV cache groups, and pass
each step's batch-ordered block table of the target's group (``group``). This maps each cache to views
``[num_blocks, block_size, H, E]`` (kv_compact.py's contract) and picks the compaction path: the Triton kernel (one
launch for all layers) on GPU, the PyTorch one on CPU. The drafter's own layers are left alone: DFlash rewrites its
context K/V from the (linearised) target hidden states.
"""

from __future__ import annotations

import torch

from vllm_ddtree.attention.backend import TreeCPUAttentionImpl, TreeRowsMixin
from vllm_ddtree.attention.torch_tree import cpu_attn_kv_views
from vllm_ddtree.kv_compact import KVCompactor, kv_compact_torch


class TargetKVCompaction:
    def __init__(self, forward_context: dict, draft_layer_names, kv_cache_groups):
        draft_layers = set(draft_layer_names)
        groups = kv_cache_groups
        from vllm.v1.kv_cache_interface import MambaSpec

        target_groups = [  # a hybrid target's GDN state groups are laid out by hybrid.target instead
            gid
            for gid, g in enumerate(groups)
            if any(name not in draft_layers for name in g.layer_names) and not isinstance(g.kv_cache_spec, MambaSpec)
        ]
        if len(target_groups) != 1:
            raise NotImplementedError(
                f"ddtree supports targets whose attention layers share one KV cache group; this one has "
                f"{len(target_groups)} (sliding-window targets are not supported yet)"
            )
        self.group = target_groups[0]
        views: list[torch.Tensor] = []
        kinds = set()
        for name in groups[self.group].layer_names:
            if name in draft_layers:
                continue
            layer = forward_context[name]
            impl = layer.impl
            if isinstance(impl, TreeCPUAttentionImpl):
                views.extend(cpu_attn_kv_views(layer.kv_cache))
                kinds.add("cpu")
            elif isinstance(impl, TreeRowsMixin):  # FLASH_ATTN / TRITON_ATTN: [blocks, Hkv, block_size, 2D] logical
                views.append(layer.kv_cache.transpose(1, 2))  # K and V packed in the last dim: one row moves both
                kinds.add("gpu")
            else:
                raise NotImplementedError(
                    f"ddtree needs the target on its tree attention backends; layer {name} uses "
                    f"{type(impl).__name__} (on GPU pass --attention-backend FLASH_ATTN)"
                )
        self.views = views
        self.kernel = KVCompactor(views) if kinds == {"gpu"} else None

    def __call__(self, block_table: torch.Tensor, ctx_lens: torch.Tensor, accepted: torch.Tensor) -> None:
        """``block_table [>= R, max_blocks]`` of group ``self.group`` in batch order, ``ctx_lens [R]`` (the roots'
        positions), ``accepted [R, L+1]`` (the walk's node ids)."""
        if self.kernel is not None:
            self.kernel(block_table, ctx_lens, accepted)
        else:
            kv_compact_torch(self.views, block_table, ctx_lens, accepted)
