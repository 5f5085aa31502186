"""vLLM attention backends that mask a verify step's tree rows: the target sees each node's ancestors only.

``install()`` (called when a ddtree drafter is built, before the target model) points vLLM's CPU_ATTN and
TRITON_ATTN registry entries at the subclasses below. On the CPU engine, outside a verify step they are exactly
vLLM's backend, and during one the rows of requests that verify a tree are recomputed with the ancestor mask after
vLLM wrote the step's K/V to the cache at linear slots. On GPU the target's layers run our tree kernel on every
forward (causal unless a request verifies a tree), so verify steps can be captured in full CUDA graphs; the
drafter's layers stay vLLM's.
"""

from __future__ import annotations

import os

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree import verify_step
from vllm_ddtree.attention.torch_tree import cpu_attn_kv_views, tree_attention_torch

# 0 = the tree kernel only in verify steps, attention outside CUDA graphs (slower; kept to diagnose the graphed path).
TREE_KERNEL_IN_GRAPHS = os.environ.get("VLLM_DDTREE_TREE_KERNEL_IN_GRAPHS", "1") == "1"


def install() -> None:
    """Point vLLM's CPU_ATTN and TRITON_ATTN at the tree subclasses (before the target model is built)."""
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.TreeCPUAttentionBackend")
    register_backend(AttentionBackendEnum.TRITON_ATTN, f"{__name__}.TreeTritonAttentionBackend")


def select_tree_attention_backend(vllm_config) -> None:
    """On GPU the target must run on TRITON_ATTN, the backend our tree kernel extends (CPU has only CPU_ATTN);
    the tree kernels read K/V in the model's dtype, so a quantized KV cache is refused."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype != "auto":
        raise ValueError(f"ddtree does not support a quantized KV cache yet (--kv-cache-dtype {kv_dtype}); drop it")
    if not current_platform.is_cuda_alike():
        return
    attention = vllm_config.attention_config
    if attention.backend is None:
        attention.backend = AttentionBackendEnum.TRITON_ATTN
    elif attention.backend != AttentionBackendEnum.TRITON_ATTN:
        raise ValueError(
            f"ddtree verifies trees on the TRITON_ATTN backend; got --attention-backend {attention.backend.name}. "
            "Drop --attention-backend or set it to TRITON_ATTN."
        )


def unsupported_feature(impl) -> str | None:
    """What of this attention layer the tree kernels cannot do, or None."""
    if not isinstance(impl, TreeCPUAttentionImpl | TreeTritonAttentionImpl):
        return f"the {type(impl).__name__} backend (ddtree needs TRITON_ATTN on GPU)"
    if impl.attn_type != AttentionType.DECODER:
        return f"{impl.attn_type} attention"
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1), [-1, -1]):
        return "sliding-window attention"
    if getattr(impl, "logits_soft_cap", None):
        return "attention logits soft-capping"
    for name in ("sinks", "alibi_slopes"):
        if getattr(impl, name, None) is not None:
            return f"attention {name.replace('_', ' ')}"
    return None


def prepare_target_layers(layers: dict, device: torch.device) -> None:
    """At start-up: refuse a target whose attention the tree path cannot mask, then route its layers
    (``layers``: name -> Attention) through the tree kernel and allocate the kernel's split-KV workspace before
    any graph is captured."""
    for name, layer in layers.items():
        problem = unsupported_feature(layer.impl)
        if problem is not None:
            raise NotImplementedError(f"ddtree does not support {problem} yet (target layer {name})")
    for layer in layers.values():
        if isinstance(layer.impl, TreeTritonAttentionImpl):
            from vllm_ddtree.attention.triton_tree import allocate_workspace

            layer.impl.tree_layer = True
            allocate_workspace(layer.impl.num_heads, layer.impl.head_size, device)


def _tree_step(impl, attn_metadata) -> verify_step.VerifyStep | None:
    """The verify step whose tree rows this decoder-attention call must mask, or None outside one."""
    step = verify_step.current()
    if step is None or attn_metadata is None or impl.attn_type != AttentionType.DECODER:
        return None
    return step


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then the tree rows again with the ancestor mask (plain PyTorch)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = _tree_step(self, attn_metadata)
        if step is None:
            return output
        key_cache, value_cache = cpu_attn_kv_views(kv_cache)
        q = query.view(query.shape[0], self.num_heads, self.head_size)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        for r in step.tree_requests:
            row0, q_len = int(step.root_rows_cpu[r]), int(step.num_nodes_cpu[r]) + 1
            tree_attention_torch(
                q[row0 : row0 + q_len],
                key_cache,
                value_cache,
                out[row0 : row0 + q_len],
                torch.tensor([0, q_len]),
                attn_metadata.seq_lens[r : r + 1],
                attn_metadata.block_table[r : r + 1],
                step.trees.ancestor_bits[r : r + 1],
                self.scale,
            )
        return output


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl


class TreeTritonAttentionImpl(TritonAttentionImpl):
    """A target layer runs every forward through our tree-masked kernel (verify steps mask tree requests by
    ``tree_rows``; prefill chunks and plain decodes are causal), reading the trees from static buffers, so vLLM can
    capture the whole target forward, verify steps included, in full CUDA graphs. Other layers (the drafter's) are
    vLLM's Triton attention unchanged.

    vLLM writes this step's K/V to the cache before ``forward`` (``forward_includes_kv_cache_update`` is False
    for this backend), so the kernel reads every key, tree nodes included, from the paged cache."""

    tree_layer = False  # set on the target's layers by prepare_target_layers

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        inputs = verify_step.static_inputs()
        use_tree_kernel = (
            self.tree_layer
            and inputs is not None
            and attn_metadata is not None  # vLLM's profiling run
            and (TREE_KERNEL_IN_GRAPHS or verify_step.current() is not None)
        )
        if not use_tree_kernel:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
            raise NotImplementedError("ddtree tree attention: fused output quantization is not supported")
        from vllm_ddtree.attention.triton_tree import tree_attention

        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        # vLLM pads the batch of a captured graph with empty requests; the kernel skips them.
        n, r = attn_metadata.num_actual_tokens, attn_metadata.seq_lens.shape[0]
        tree_attention(
            query[:n].view(n, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            output[:n].view(n, self.num_heads, self.head_size),
            attn_metadata.query_start_loc[: r + 1],
            attn_metadata.seq_lens,
            attn_metadata.block_table[:r],
            inputs.ancestor_bits,
            self.scale,
            tree_rows=inputs.tree_rows[:r],
            max_query_len=attn_metadata.max_query_len,
        )
        return output


class TreeTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """With the tree kernel inside graphs (the default), vLLM's own support level (ALWAYS) holds. Without it the
    tree pass is chosen in Python per step, which a captured graph would freeze, so attention runs eagerly between
    piecewise graphs (NEVER): the slow but simple path, kept for diagnosis."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        return AttentionCGSupport.ALWAYS if TREE_KERNEL_IN_GRAPHS else AttentionCGSupport.NEVER


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeTritonAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeTritonAttentionMetadataBuilder
