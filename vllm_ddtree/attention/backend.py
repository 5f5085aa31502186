"""vLLM attention backends that mask a verify step's tree rows: each tree node sees its ancestors only.

``install()`` (when a ddtree drafter is built, before the target model) points vLLM's FLASH_ATTN, TRITON_ATTN and
CPU_ATTN registry entries at the subclasses below. Every layer keeps the backend vLLM picks (FlashAttention 3 on
Hopper); only the target's layers (``prepare_target_layers``) ever leave vLLM's kernel, and only for tree rows:

- a full verify batch (every request's query is ``1 + B`` rows, the shape vLLM captures in full CUDA graphs) runs
  our tree kernel on every row: tree requests with the ancestor mask, the rest causally (``tree_rows = -1``), all
  read from static buffers, so the graph replays with each step's trees (eagerly only with a verify step in flight:
  a prefill batch of the same query length is vLLM's);
- any other forward (prefill, plain decode, mixed batches, which vLLM runs eagerly or between piecewise graphs) runs
  vLLM's kernel on every row; when a verify step is in flight, the tree kernel then recomputes only the rows of
  requests that verify a tree. The prefill of a ddtree engine is no-spec's, and so is a chain step's attention
  (the chain fallback, ``verify_core``: causal, its width is not a verify width).

On FLASH_ATTN with FlashAttention 3 a full verify batch splits like vLLM's cascade attention: FlashAttention
attends every query to its request's committed prefix (non-causal, returning the log-sum-exp), and the tree kernel
reads only the keys of this step's block and merges them into that output in place. The prefix, nearly all of the
keys, then runs on vLLM's kernel, as the chain's verify does (``VLLM_DDTREE_TREE_KERNEL_PREFIX=1``: the tree kernel
reads the prefix too, as before; for A/B benchmarks).

vLLM writes each step's K/V into the cache before attention (``forward_includes_kv_cache_update`` is False for
these backends), so the tree kernel reads every key, tree nodes included, from the paged cache. FLASH_ATTN and
TRITON_ATTN share the cache layout (``[blocks, Hkv, block_size, 2D]`` logical), which the tree kernel reads.
"""

from __future__ import annotations

import os

import torch
import vllm.envs as vllm_envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from vllm_ddtree.attention.torch_tree import cpu_attn_kv_views, tree_attention_torch

GPU_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN")
TREE_KERNEL_PREFIX_ENV = "VLLM_DDTREE_TREE_KERNEL_PREFIX"


def install() -> None:
    """Point vLLM's FLASH_ATTN, TRITON_ATTN and CPU_ATTN at the tree subclasses (before the target is built)."""
    register_backend(AttentionBackendEnum.FLASH_ATTN, f"{__name__}.TreeFlashAttentionBackend")
    register_backend(AttentionBackendEnum.TRITON_ATTN, f"{__name__}.TreeTritonAttentionBackend")
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.TreeCPUAttentionBackend")


def check_attention_config(vllm_config) -> None:
    """At start-up: the tree kernels read K/V in the model's dtype (no quantized KV cache), and on GPU the target
    must run on a backend they extend (FLASH_ATTN or TRITON_ATTN; unset lets vLLM pick, FLASH_ATTN on Hopper)."""
    from vllm.platforms import current_platform

    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype != "auto":
        raise ValueError(f"ddtree does not support a quantized KV cache yet (--kv-cache-dtype {kv_dtype}); drop it")
    backend = vllm_config.attention_config.backend
    if current_platform.is_cuda_alike() and backend is not None and backend.name not in GPU_BACKENDS:
        raise ValueError(
            f"ddtree verifies trees on the FLASH_ATTN or TRITON_ATTN backend; got --attention-backend {backend.name}. "
            "Drop --attention-backend (vLLM then picks FLASH_ATTN on Hopper) or set it to FLASH_ATTN or TRITON_ATTN."
        )


def unsupported_feature(impl) -> str | None:
    """What of this attention layer the tree kernels cannot do, or None."""
    if not isinstance(impl, TreeRowsMixin | TreeCPUAttentionImpl):
        return (f"the {type(impl).__name__} attention backend (ddtree extends {' and '.join(GPU_BACKENDS)} on GPU: "
                "pass --attention-backend FLASH_ATTN)")
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


def prepare_target_layers(layers: dict, inputs, device: torch.device) -> None:
    """At start-up: refuse a target whose attention the tree path cannot mask, then hand its layers (``layers``:
    name -> Attention) the verify core's ``TreeAttentionInputs`` and allocate the tree kernel's split-KV workspace
    before any graph is captured."""
    for name, layer in layers.items():
        problem = unsupported_feature(layer.impl)
        if problem is not None:
            raise NotImplementedError(f"ddtree does not support {problem} yet (target layer {name})")
    for layer in layers.values():
        layer.impl.tree_inputs = inputs
        if isinstance(layer.impl, TreeRowsMixin):
            from vllm_ddtree.attention.triton_tree import allocate_workspace

            allocate_workspace(layer.impl.num_heads, layer.impl.head_size, device)


class TreeRowsMixin:
    """The GPU rule of the module docstring, over the backend's own ``forward`` (FlashAttention or Triton)."""

    tree_inputs = None  # verify_core.TreeAttentionInputs, on the target's layers only
    _rows_only_compiled = False  # per layer: the tree-rows-only kernel variant has run once
    _full_compiled = False  # per layer: the full-verify-batch variant has run once outside a capture

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        inputs = self.tree_inputs
        if inputs is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if any(a is not None for a in args) or any(v is not None for v in kwargs.values()):
            raise NotImplementedError("ddtree tree attention: fused output quantization is not supported")
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        full_width = attn_metadata.max_query_len in inputs.verify_widths
        # A verify step in flight, or a full graph being captured (its replays are verify steps): the tree kernel on
        # every row. A prefill batch whose longest query merely has a verify width is vLLM's, as without ddtree.
        if full_width and (inputs.step is not None or capturing):
            self._tree_attention(query, kv_cache, attn_metadata, output, inputs, tree_rows_only=False)
            return output
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        if capturing or not kv_cache.numel():
            return output
        if full_width and not self._full_compiled:
            # vLLM's warm-up passes before each full-graph capture: compile the variant the capture records, into a
            # scratch output (the batch's own is vLLM's), so no Triton JIT runs inside the capture.
            self._tree_attention(query, kv_cache, attn_metadata, torch.empty_like(output), inputs,
                                 tree_rows_only=False)
            self._full_compiled = True
        if (inputs.step is not None and not inputs.step.chain) or not self._rows_only_compiled:
            # Without a step in flight every tree row is -1 and the kernel writes nothing: the first such call (vLLM's
            # warm-up passes) only compiles the tree-rows variant, which mid-serving JIT'd otherwise (H200,
            # 2026-12-01: vLLM's JIT monitor flagged _tree_attn_kernel at the first mixed batch).
            self._tree_attention(query, kv_cache, attn_metadata, output, inputs, tree_rows_only=True)
            self._rows_only_compiled = True
        return output

    def _tree_attention(self, query, kv_cache, attn_metadata, output, inputs, *, tree_rows_only: bool,
                        prefix_lse: torch.Tensor | None = None) -> None:
        """``prefix_lse``: ``output`` already holds the prefix's attention (TreeFlashAttentionImpl); merge the block."""
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
            # Tree rows only: their queries are at most 1 + B wide whatever else the batch holds (a prefill chunk),
            # so the tile shape, and the one compiled variant, follow the tree.
            max_query_len=inputs.ancestor_bits.shape[1] if tree_rows_only else attn_metadata.max_query_len,
            tree_rows_only=tree_rows_only, prefix_lse=prefix_lse,
        )


class TreeFlashAttentionImpl(TreeRowsMixin, FlashAttentionImpl):
    """Full verify batches: FlashAttention over the prefix, the tree kernel over the step's block (module
    docstring)."""

    def _tree_attention(self, query, kv_cache, attn_metadata, output, inputs, *, tree_rows_only: bool) -> None:
        if tree_rows_only or not self._prefix_on_flash_attention():
            return super()._tree_attention(query, kv_cache, attn_metadata, output, inputs,
                                           tree_rows_only=tree_rows_only)
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
        from vllm.v1.attention.backends import flash_attn

        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        n, r = attn_metadata.num_actual_tokens, attn_metadata.seq_lens.shape[0]
        prefix_lens, schedule = _prefix_split(self, inputs, attn_metadata, key_cache.shape[1], query.dtype)
        _, prefix_lse = flash_attn.flash_attn_varlen_func(
            q=query[:n].view(n, self.num_heads, self.head_size),
            # FlashAttention 3 reads the cache through TMA, which needs 16-byte strides (as vLLM's own forward does).
            k=canonicalize_singleton_dim_strides(key_cache), v=canonicalize_singleton_dim_strides(value_cache),
            out=output[:n].view(n, self.num_heads, self.head_size),
            cu_seqlens_q=attn_metadata.query_start_loc[: r + 1], max_seqlen_q=attn_metadata.max_query_len,
            seqused_k=prefix_lens, max_seqlen_k=attn_metadata.max_seq_len,
            softmax_scale=self.scale, causal=False, block_table=attn_metadata.block_table,
            return_softmax_lse=True, scheduler_metadata=schedule, fa_version=self.vllm_flash_attn_version,
            num_splits=attn_metadata.max_num_splits,
        )
        super()._tree_attention(query, kv_cache, attn_metadata, output, inputs, tree_rows_only=False,
                                prefix_lse=prefix_lse)

    def _prefix_on_flash_attention(self) -> bool:
        """FlashAttention 3 (the version measured: FA2 returns the same log-sum-exp, but no GPU here has run the
        split on it; FA4's interface differs); context parallelism splits the keys."""
        return (self.vllm_flash_attn_version == 3 and getattr(self, "dcp_world_size", 1) == 1
                and os.environ.get(TREE_KERNEL_PREFIX_ENV, "0") != "1")


def _prefix_split(impl, inputs, attn_metadata, page_size: int, dtype: torch.dtype):
    """(committed keys per request, FlashAttention 3's scheduler metadata for the prefix call), once per forward.

    The keys are ``seq_lens - q_len``, at least 0 (vLLM's graph warm-up runs seq_lens 1). The scheduler metadata is
    what vLLM's FlashAttention builder computes for its own call (``get_scheduler_metadata``), here for the prefix
    call's arguments (non-causal, the prefix lengths): without it FlashAttention 3 schedules inside every call, a
    kernel per layer (36 x 2.2 us per step on Qwen3-8B at batch 1, H200 profile of 2026-12-02). The layers of a
    KV-cache group share one metadata object, and vLLM builds a new one for every forward, captured graphs included
    (MRV2 and V1 both prepare a capture's inputs afresh), so the first layer's tensors are the forward's, recorded in
    the same graph as their readers. Keyed on capture too, so a warm-up's eager tensor never reaches a graph."""
    capturing = attn_metadata.seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = inputs.prefix_of_forward
    if cached is None or cached[0] is not attn_metadata or cached[1] != capturing:
        from vllm.v1.attention.backends import flash_attn

        r = attn_metadata.seq_lens.shape[0]
        qsl = attn_metadata.query_start_loc[: r + 1]
        lens = (attn_metadata.seq_lens - (qsl[1:] - qsl[:-1])).clamp_(min=0)
        schedule = None
        if not vllm_envs.VLLM_BATCH_INVARIANT:  # (vLLM's builder schedules ahead only then)
            schedule = flash_attn.get_scheduler_metadata(
                batch_size=r, max_seqlen_q=attn_metadata.max_query_len, max_seqlen_k=attn_metadata.max_seq_len,
                num_heads_q=impl.num_heads, num_heads_kv=impl.num_kv_heads, headdim=impl.head_size,
                cache_seqlens=lens, qkv_dtype=dtype, cu_seqlens_q=qsl, page_size=page_size, causal=False,
                num_splits=attn_metadata.max_num_splits,
            )
        cached = inputs.prefix_of_forward = (attn_metadata, capturing, lens, schedule)
    return cached[2], cached[3]


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl


class TreeTritonAttentionImpl(TreeRowsMixin, TritonAttentionImpl):
    pass


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeTritonAttentionImpl


def vector_cache_isa(isa: str) -> str:
    """The CPU attention ISA of a ddtree engine: vLLM's pick, but the vector kernels where it picks AMX (bf16 on a
    CPU with AMX tiles). ``cpu_attn_kv_views`` reads the VEC cache layout, and AMX's packs K otherwise: on a Sapphire
    Rapids the tree rows of the tiny Qwen3.5 (bf16) left their references by 3.16 against a tolerance of 1.69
    (2026-12-05). The ISA sets the cache layout, so the builder and every layer take the same one."""
    return "vec" if isa == "amx" else isa


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.isa = vector_cache_isa(self.isa)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, then the rows of requests that verify a tree again with the ancestor mask (PyTorch)."""

    tree_inputs = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.isa = vector_cache_isa(self.isa)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        inputs = self.tree_inputs
        step = inputs.step if inputs is not None else None
        if step is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        key_cache, value_cache = cpu_attn_kv_views(kv_cache)
        q = query.view(query.shape[0], self.num_heads, self.head_size)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        root_rows = step.prepared.root_rows.tolist()  # the CPU engine: host tensors, nothing waits
        for r in _tree_requests(inputs, step.num_reqs):
            row0, q_len = root_rows[r], int(step.num_drafts_cpu[r]) + 1
            tree_attention_torch(
                q[row0 : row0 + q_len],
                key_cache,
                value_cache,
                out[row0 : row0 + q_len],
                torch.tensor([0, q_len]),
                attn_metadata.seq_lens[r : r + 1],
                attn_metadata.block_table[r : r + 1],
                inputs.ancestor_bits[r : r + 1],
                self.scale,
            )
        return output


def _tree_requests(inputs, num_reqs: int) -> list[int]:
    """Batch rows that verify a tree, ``tree_rows >= 0`` (CPU engine: host memory; a chain step has none)."""
    return [r for r, row in enumerate(inputs.tree_rows[:num_reqs].tolist()) if row >= 0]


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
