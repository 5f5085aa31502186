"""Tree-masked attention over vLLM's paged KV cache: Triton kernel (GPU) and plain-PyTorch path (reference, CPU)."""

from vllm_ddtree.attention.torch_tree import (
    ancestor_mask,
    cpu_attn_kv_views,
    tree_attention_torch,
    triton_attn_kv_views,
)

__all__ = [
    "ancestor_mask",
    "cpu_attn_kv_views",
    "tree_attention",
    "tree_attention_torch",
    "triton_attn_kv_views",
    "split_workspace",
    "auto_kv_splits",
]


def __getattr__(name):
    # Triton is imported lazily so the CPU path works where triton is absent or broken.
    if name in ("tree_attention", "split_workspace", "auto_kv_splits"):
        from vllm_ddtree.attention import triton_tree

        return getattr(triton_tree, name)
    raise AttributeError(name)
