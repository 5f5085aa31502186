"""The replay layout of GDN state on GPU: one state block per request instead of 1 + B (docs/hybrid-state-layout.md).

vLLM keeps ``1 + num_speculative_tokens`` recurrent states per request and GDN layer for a hybrid target's spec
decode (the chain's token t writes column t). With num_speculative_tokens = B that is 13 GiB per request on
Qwen3.6-27B at B=64. The node states are needed only inside one layer's tree kernel (a parent reloaded by a later
sibling) and, for the accepted path's last node, after the walk. So in this layout:

- every GDN layer gets ``num_speculative_blocks = 0`` (``one_state_block``): vLLM allocates one block per request
  (its conv row stays ``width - 1 + B`` wide: vLLM sizes it from num_speculative_tokens separately), and its GDN
  metadata names that block in every spec column;
- the verify forward reads the committed state from the block, keeps branch nodes' states in one float32
  workspace shared by all layers (``ReplayStash.node_states``, rows by token) and stashes each layer's post-conv
  q, k, v and a, b (``ReplayStash.keep``); the block is never written;
- after the walk, each layer reruns its accepted path as a chain from the block over the stash
  (``relayout.apply_replay``: the tree kernel's own float32 arithmetic, so the state is the verified node's bit for
  bit) and writes the last state into the block, where vLLM's chain bookkeeping reads it next step.

The stash and workspace are sized by the most speculative tokens one step can hold (``max_num_seqs x (1 + B)``,
at most ``max_num_batched_tokens``) and allocated when the model loads, before vLLM's memory profile counts them.

This is the GPU worker's only layout: an H200 ran the engine's teacher-forced lossless test through it with CUDA
graphs on 2026-12-03 (``tests/gpu/test_hybrid_replay_capture.py`` captures the hooks and the relayout as the engine
does). The CPU engine keeps vLLM's layout: its C++ chain op writes node t's state into spec column t.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import triton
import triton.language as tl

from vllm_ddtree import LOGGER_NAME
from vllm_ddtree.hybrid.tree_gdn import DeferredLeaves, deferred_leaves

logger = logging.getLogger(LOGGER_NAME)


def one_state_block(layer) -> None:
    """Make a GDN layer's KV-cache spec reserve one state block per request (``num_speculative_blocks = 0``).

    Wraps the instance's ``MambaBase.get_kv_cache_spec`` (listed in the patch manifest's overrides), which the
    runner calls after the model loads; the state shapes, the conv row's width included, are vLLM's."""
    original = layer.get_kv_cache_spec

    def get_kv_cache_spec(vllm_config):
        spec = original(vllm_config)
        return dataclasses.replace(spec, num_speculative_blocks=0) if spec is not None else None

    layer.get_kv_cache_spec = get_kv_cache_spec


class ReplayStash:
    """Per worker: this step's GDN inputs of every layer, the shared node-state workspace, and where each batch
    row's spec tokens start (static buffers: the verify forward and the relayout are CUDA-graph captured)."""

    def __init__(self, layers: list, max_tokens: int, max_rows: int, dtype: torch.dtype, device: torch.device):
        """``layers``: the target's GDN layer modules; the stash row of a layer is its place in this list."""
        first = layers[0]
        heads_k, heads_v = first.num_k_heads // first.tp_size, first.num_v_heads // first.tp_size
        dim_k, dim_v = first.head_k_dim, first.head_v_dim
        n = len(layers)
        self.max_tokens = max_tokens
        self.index = {layer.A_log.data_ptr(): i for i, layer in enumerate(layers)}
        self.q = torch.zeros(n, max_tokens, heads_k, dim_k, dtype=dtype, device=device)
        self.k = torch.zeros_like(self.q)
        self.v = torch.zeros(n, max_tokens, heads_v, dim_v, dtype=dtype, device=device)
        self.a = torch.zeros(n, max_tokens, heads_v, dtype=dtype, device=device)
        self.b = torch.zeros_like(self.a)
        self.node_states = torch.zeros(max_tokens, heads_v, dim_v, dim_k, dtype=torch.float32, device=device)
        self.row_start = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        total = sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.a, self.b, self.node_states))
        logger.info("ddtree: GDN replay layout: one state block per request; stash and node-state workspace for %d "
                    "speculative tokens per step, %.2f GiB (max_num_seqs x (1 + B), at most max_num_batched_tokens: "
                    "lower either to shrink it)", max_tokens, total / 2**30)

    def layer(self, A_log: torch.Tensor) -> int:
        """The stash row of the GDN layer whose ``A_log`` this is."""
        index = self.index.get(A_log.data_ptr())
        if index is None:
            raise RuntimeError("ddtree: a GDN layer outside the replay stash ran a tree verify (the stash is built "
                               "from the target's GDN layers when the model loads)")
        return index

    def record_step(self, spec_sequence_masks: torch.Tensor, spec_query_start_loc: torch.Tensor,
                    parents: torch.Tensor) -> DeferredLeaves:
        """Once per forward: each batch row's first spec token (-1: not a spec sequence), and the tree kernel's split
        of this step's nodes (``tree_gdn.deferred_leaves``: the nodes with children run one after another and store
        their states, rows by token; each leaf is computed from its parent's state on its own). Shared by every
        layer."""
        rows = spec_sequence_masks.shape[0]
        mask = spec_sequence_masks.to(torch.bool)
        spec_index = (torch.cumsum(mask.to(torch.int64), 0) - 1).clamp(min=0)
        starts = spec_query_start_loc.to(torch.int64)[spec_index.clamp(max=spec_query_start_loc.shape[0] - 1)]
        self.row_start[:rows].copy_(torch.where(mask, starts, -1))
        self.row_start[rows:].fill_(-1)
        plan = deferred_leaves(parents, spec_query_start_loc)
        # Tokens past the stash are graph padding (no spec sequence holds them): never stored, never read.
        stored, leaf_rows = plan.node_state_indices, plan.leaf_state_rows
        return dataclasses.replace(plan, node_state_indices=torch.where(stored < self.max_tokens, stored, -1),
                                   leaf_state_rows=torch.where(leaf_rows < self.max_tokens, leaf_rows, -1))

    def keep(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor) -> None:
        """One layer's spec-token inputs (q, k, v ``[1, T, ...]``, a, b ``[T, HV]``) until the relayout: one launch
        for the five (``_keep_rows_kernel``), where five copies were 5 x 48 launches per step on Qwen3.6-27B
        (``memcpy32_post``, +260 us of device time at batch 1 in the 2026-12-04 profile, benchmarks/README.md)."""
        n = min(q.shape[1], self.max_tokens)
        if n == 0:
            return
        sources = (q[0, :n], k[0, :n], v[0, :n], a[:n], b[:n])
        targets = (self.q[layer], self.k[layer], self.v[layer], self.a[layer], self.b[layer])
        if not all(x[0].is_contiguous() and x.dtype == self.q.dtype for x in sources) or a.shape[1] > 1024:
            for target, source in zip(targets, sources):  # a layout the kernel does not take: plain copies
                target[:n].copy_(source)
            return
        width_qk, width_v, width_ab = (x[0].numel() for x in (q[0], v[0], a))
        _keep_rows_kernel[(n,)](
            *sources, *targets, *(x.stride(0) for x in sources),
            WIDTH_QK=width_qk, WIDTH_V=width_v, WIDTH_AB=width_ab, BLOCK=1024, num_warps=4,
        )


@triton.jit
def _keep_rows_kernel(q, k, v, a, b, sq, sk, sv, sa, sb, stride_q, stride_k, stride_v, stride_a, stride_b,
                      WIDTH_QK: tl.constexpr, WIDTH_V: tl.constexpr, WIDTH_AB: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``tok``: token tok's q, k, v, a, b rows (each row contiguous, rows at the given strides) into the
    stash's rows (contiguous)."""
    tok = tl.program_id(0).to(tl.int64)
    for start in range(0, WIDTH_QK, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < WIDTH_QK
        tl.store(sq + tok * WIDTH_QK + o, tl.load(q + tok * stride_q + o, mask=m), mask=m)
        tl.store(sk + tok * WIDTH_QK + o, tl.load(k + tok * stride_k + o, mask=m), mask=m)
    for start in range(0, WIDTH_V, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < WIDTH_V
        tl.store(sv + tok * WIDTH_V + o, tl.load(v + tok * stride_v + o, mask=m), mask=m)
    o = tl.arange(0, BLOCK)
    m = o < WIDTH_AB
    tl.store(sa + tok * WIDTH_AB + o, tl.load(a + tok * stride_a + o, mask=m), mask=m)
    tl.store(sb + tok * WIDTH_AB + o, tl.load(b + tok * stride_b + o, mask=m), mask=m)


def stash_size(vllm_config) -> tuple[int, int]:
    """(speculative tokens, batch rows) one step can hold: the stash's static sizes."""
    scheduler = vllm_config.scheduler_config
    budget = vllm_config.speculative_config.num_speculative_tokens
    rows = scheduler.max_num_seqs
    return min(scheduler.max_num_batched_tokens, rows * (1 + budget)), rows
