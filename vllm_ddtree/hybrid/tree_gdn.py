"""Gated delta-rule recurrence over a draft tree: vLLM's fused sigmoid-gating decode kernel, parent-aware.

vLLM's ``fused_sigmoid_gating_delta_rule_update`` (``third_party/flash_linear_attention/ops/fused_sigmoid_gating.py``)
keeps one running state per sequence in registers, so token t always continues from token t-1. Here node t
continues from its parent: when the parent is t-1 (a chain stretch) the registers are reused; otherwise the
parent's state is reloaded from the per-node state buffer, which every node writes after its update. The per-node
states are also what lets the accepted path's last state be selected after the walk (relayout.py).

The math per node is vLLM's, line for line (softplus gate, sigmoid beta, in-kernel q/k L2 norm, decay, delta
update, read-out), in float32. Reloading a parent is lossless only if the node-state buffer is float32; with a
bf16 buffer, nodes whose parent is not t-1 would see a rounded state that vLLM's chain never rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _token_inputs(q, k, v, a, b, parents, node_state_indices, token_index, tok, i_h, i_hv, o_k, o_v, mask_k, mask_v,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  HAS_TOKEN_INDEX: tl.constexpr):
    """Token ``tok``'s parent, node-state row and q, k, v, b, a (gathered from ``token_index[tok]`` in a replay)."""
    if HAS_TOKEN_INDEX:  # inputs gathered from other rows (the replay of an accepted path)
        src = tl.load(token_index + tok).to(tl.int64)
    else:
        src = tok
    par = tl.load(parents + tok).to(tl.int64)
    s_idx = tl.load(node_state_indices + tok).to(tl.int64)
    b_q, b_k, b_v, b_b, b_a = _qkvba(q, k, v, a, b, src, i_h, i_hv, o_k, o_v, mask_k, mask_v, H, HV, K, V)
    return par, s_idx, b_q, b_k, b_v, b_b, b_a


@triton.jit
def _qkvba(q, k, v, a, b, src, i_h, i_hv, o_k, o_v, mask_k, mask_v,
           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Row ``src``'s q, k (head ``i_h``), v block, b and a (value head ``i_hv``), in float32."""
    b_q = tl.load(q + (src * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_k = tl.load(k + (src * H + i_h) * K + o_k, mask=mask_k, other=0).to(tl.float32)
    b_v = tl.load(v + (src * HV + i_hv) * V + o_v, mask=mask_v, other=0).to(tl.float32)
    b_b = tl.load(b + src * HV + i_hv).to(tl.float32)
    b_a = tl.load(a + src * HV + i_hv).to(tl.float32)
    return b_q, b_k, b_v, b_b, b_a


@triton.jit
def _state_tile(i_v, i_hv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A program's [BV, BK] tile of one value head's state: offsets within the k and v axes, their masks, and the
    tile's offsets within a [HV, V, K] state."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V
    mask_h = mask_v[:, None] & mask_k[None, :]
    h_off = i_hv * V * K + o_v[:, None] * K + o_k[None, :]
    return o_k, o_v, mask_k, mask_v, mask_h, h_off


@triton.jit
def _gdn_update(b_h, b_q, b_k, b_v, b_b, b_a, A, dtb, softplus_beta, threshold, scale,
                USE_QK_L2NORM_IN_KERNEL: tl.constexpr):
    """One token's update of a state tile ``b_h`` [BV, BK] and its output, in vLLM's arithmetic (softplus gate,
    sigmoid beta, in-kernel q/k L2 norm, decay, delta update, read-out): returns (new state, output)."""
    x = b_a + dtb
    softplus_x = tl.where(
        softplus_beta * x <= threshold, (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x)), x
    )
    b_g = -A * softplus_x
    b_beta = tl.sigmoid(b_b)
    if USE_QK_L2NORM_IN_KERNEL:
        b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q) + 1e-6))
        b_k = b_k * (tl.rsqrt(tl.sum(b_k * b_k) + 1e-6))
    b_q = b_q * scale
    b_h *= tl.exp(b_g)
    b_v -= tl.sum(b_h * b_k[None, :], 1)
    b_v *= b_beta
    b_h += b_v[:, None] * b_k[None, :]
    b_o = tl.sum(b_h * b_q[None, :], 1)
    return b_h, b_o


@triton.jit(do_not_specialize=["T"])
def _tree_gdn_kernel(
    A_log, a, b, dt_bias, q, k, v, o, h0, hs,
    cu_seqlens, parents, ssm_state_indices, num_accepted_tokens, node_state_indices, token_index, main_order,
    main_start, softplus_beta, threshold, scale, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    stride_h0: tl.constexpr, stride_hs: tl.constexpr, stride_idx_seq: tl.constexpr,
    IS_SPEC_DECODING: tl.constexpr, USE_QK_L2NORM_IN_KERNEL: tl.constexpr, HAS_TOKEN_INDEX: tl.constexpr,
    DEFER_LEAVES: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    if T == 0:
        return
    if IS_SPEC_DECODING:
        i_t0 = tl.load(num_accepted_tokens + i_n).to(tl.int64) - 1
    else:
        i_t0 = 0
    state_idx = tl.load(ssm_state_indices + i_n * stride_idx_seq + i_t0).to(tl.int64)
    if state_idx <= 0:  # vLLM's NULL_BLOCK_ID = 0 marks a padded sequence
        return

    o_k, o_v, mask_k, mask_v, mask_h, h_off = _state_tile(i_v, i_hv, K, V, BK, BV)
    b_h = tl.load(h0 + state_idx * stride_h0 + h_off, mask=mask_h, other=0).to(tl.float32)
    A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)

    # Token t+1's inputs are loaded before token t's update so that their memory latency overlaps its arithmetic:
    # each program runs its tokens one after another, and a layer's time is that chain of per-token latencies
    # (H200, one Qwen3.6-27B GDN layer, graphed: 25-30% less than loading each token's inputs at its turn,
    # benchmarks/README.md 2026-12-04). Both orders compute the same bits.
    if DEFER_LEAVES:  # only the roots and nodes with children (main_order); the leaves are the leaf kernel's
        m0 = tl.load(main_start + i_n).to(tl.int64)
        T = tl.load(main_start + i_n + 1).to(tl.int64) - m0
    else:
        m0 = bos
    n_tok = _nth_token(main_order, m0, 0, bos, DEFER_LEAVES)
    n_par, n_sidx, n_q, n_k, n_v, n_b, n_a = _token_inputs(
        q, k, v, a, b, parents, node_state_indices, token_index, n_tok, i_h, i_hv, o_k, o_v, mask_k, mask_v,
        H, HV, K, V, HAS_TOKEN_INDEX)
    last = bos * 0 - 1  # the token whose state b_h holds (-1: the block's)
    for i_t in range(0, T):
        tok = n_tok
        par, s_idx, b_q, b_k, b_v, b_b, b_a = n_par, n_sidx, n_q, n_k, n_v, n_b, n_a
        n_tok = _nth_token(main_order, m0, tl.minimum(i_t + 1, T - 1), bos, DEFER_LEAVES)
        n_par, n_sidx, n_q, n_k, n_v, n_b, n_a = _token_inputs(
            q, k, v, a, b, parents, node_state_indices, token_index, n_tok, i_h, i_hv, o_k, o_v, mask_k, mask_v,
            H, HV, K, V, HAS_TOKEN_INDEX)
        if par != last:  # the parent's state is not in registers: reload it (stored by the whole block)
            p_idx = tl.load(node_state_indices + bos + par).to(tl.int64)
            b_h = tl.load(hs + p_idx * stride_hs + h_off, mask=mask_h, other=0).to(tl.float32)
        b_h, b_o = _gdn_update(b_h, b_q, b_k, b_v, b_b, b_a, A, dtb, softplus_beta, threshold, scale,
                               USE_QK_L2NORM_IN_KERNEL)
        tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        if s_idx >= 0:
            tl.store(hs + s_idx * stride_hs + h_off, b_h.to(hs.dtype.element_ty), mask=mask_h)
        # A later sibling may reload this state from other threads of the block.
        tl.debug_barrier()
        last = tok - bos


@triton.jit
def _nth_token(main_order, m0, i, bos, DEFER_LEAVES: tl.constexpr):
    """The i-th token a main-kernel program runs: its request's i-th token, or its i-th root or node with children
    with the leaves deferred."""
    if DEFER_LEAVES:
        return tl.load(main_order + m0 + i).to(tl.int64)
    return bos + i


@triton.jit
def _tree_gdn_leaves_kernel(
    A_log, a, b, dt_bias, q, k, v, o, hs, leaf_state_rows,
    softplus_beta, threshold, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    stride_hs: tl.constexpr, USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
):
    """Program (v block, token, value head): a deferred leaf's output, one update of its parent's stored state (the
    main kernel's arithmetic; a leaf's own state is never needed). No leaf waits on another, siblings included;
    siblings' programs are adjacent, so their parent's tile is read from L2 after the first."""
    i_v, tok, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(leaf_state_rows + tok).to(tl.int64)
    if row < 0:  # not a deferred leaf
        return
    i_h = i_hv // (HV // H)
    o_k, o_v, mask_k, mask_v, mask_h, h_off = _state_tile(i_v, i_hv, K, V, BK, BV)
    b_h = tl.load(hs + row * stride_hs + h_off, mask=mask_h, other=0).to(tl.float32)
    A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    b_q, b_k, b_v, b_b, b_a = _qkvba(q, k, v, a, b, tok.to(tl.int64), i_h, i_hv, o_k, o_v, mask_k, mask_v, H, HV, K,
                                     V)
    _, b_o = _gdn_update(b_h, b_q, b_k, b_v, b_b, b_a, A, dtb, softplus_beta, threshold, scale,
                         USE_QK_L2NORM_IN_KERNEL)
    tl.store(o + (tok * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)


@dataclass
class DeferredLeaves:
    """A step's split of tree tokens into the main kernel's (roots and nodes with children, every one's state
    stored) and the leaf kernel's (``deferred_leaves``); built once per step and shared by every GDN layer.

    A best-first tree is bushy (the trained SmolLM2 drafter's B=64 trees: 51.6 leaves and 13.4 nodes with children
    of 65, 3.1 deep; benchmarks/tree_shapes.py), and the main kernel runs a request's tokens one after another:
    deferring the leaves leaves it the nodes with children, while every leaf's output comes from its parent's state
    in a program of its own. The verify forward's split in the replay layout (``ReplayStash.record_step``). H200,
    one Qwen3.6-27B GDN layer, graphed, us (batch 1 B=16 / B=64, batch 8 B=16 / B=64): 29.2 / 86.6 / 112.5 / 393.6
    in one kernel, 22.7 / 57.2 / 116.0 / 388.3 deferred (``bench_tree_core.py gdn_tree,gdn_tree_deferred``,
    benchmarks/README.md 2026-12-04). A first version with one program per parent over its leaves lost (52 / 148 /
    162 / 561): a root's dozens of leaves then ran one after another."""

    node_state_indices: torch.Tensor  # [T] int32, the token itself for every node with children, else -1
    main_order: torch.Tensor  # [T] int32 tokens: each request's roots and nodes with children in order, then leaves
    main_start: torch.Tensor  # [N + 1] int32, request n's are main_order[main_start[n]:main_start[n + 1]]
    leaf_state_rows: torch.Tensor  # [T] int32, a deferred leaf's parent's node-state row, else -1

    @property
    def deferred(self) -> torch.Tensor:
        """[T] bool, the leaves the leaf kernel computes."""
        return self.leaf_state_rows >= 0


def deferred_leaves(parents: torch.Tensor, query_start_loc: torch.Tensor) -> DeferredLeaves:
    """The leaf split for sequence-relative ``parents`` [T] (root -1) of requests at ``query_start_loc`` [N+1]
    (device ops, static shapes, no host sync). Roots are never deferred (their parent state is the block's)."""
    t, n = parents.shape[0], query_start_loc.shape[0] - 1
    dev = parents.device
    tok = torch.arange(t, device=dev)
    seq = torch.searchsorted(query_start_loc[1:], tok, right=True)
    par = parents.long()
    abs_parent = torch.where(par >= 0, query_start_loc[seq].long() + par.clamp(min=0), t)
    children = torch.zeros(t + 1, dtype=torch.int32, device=dev)
    children.scatter_add_(0, abs_parent, torch.ones(t, dtype=torch.int32, device=dev))
    internal = children[:t] > 0
    leaf = (par >= 0) & ~internal
    rows = torch.where(internal, tok, -1).to(torch.int32)
    main_count = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    main_count.scatter_add_(0, torch.where(leaf, n, seq), torch.ones(t, dtype=torch.int32, device=dev))
    main_start = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    torch.cumsum(main_count[:n], 0, out=main_start[1:])
    parent_rows = torch.cat([rows, rows.new_full((1,), -1)])
    return DeferredLeaves(
        node_state_indices=rows,
        main_order=torch.sort(torch.where(leaf, n, seq), stable=True).indices.to(torch.int32),
        main_start=main_start,
        leaf_state_rows=torch.where(leaf, parent_rows[abs_parent], -1).to(torch.int32),
    )


def tree_fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    parents: torch.Tensor,
    beta: float = 1.0,
    threshold: float = 20.0,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    node_states: torch.Tensor | None = None,
    node_state_indices: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    token_index: torch.Tensor | None = None,
    leaves: DeferredLeaves | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_sigmoid_gating_delta_rule_update`` (varlen, continuous batching) over trees.

    Same tensors as vLLM: q, k ``[1, T, H, K]``; v ``[1, T, HV, V]``; a, b ``[T, HV]``; initial_state
    ``[slots, HV, V, K]``; cu_seqlens ``[N+1]``; ssm_state_indices ``[N]`` or ``[N, >=1]`` with the initial state
    read from column ``num_accepted_tokens - 1`` (column 0 without it); index <= 0 skips the sequence. New:
    parents ``[T]`` (sequence-relative, root -1, ``parents[i] < i``); node_states ``[S, HV, V, K]`` receives node
    t's state at row ``node_state_indices[t]`` (< 0: not stored; every node with a child other than the next
    token must be stored). Pass vLLM's own cache plus the spec slot ids to keep per-node states persistent, or
    leave both None for a transient float32 workspace ``[T, HV, V, K]``. Returns (o ``[1, T, HV, V]``,
    node_states). Unlike vLLM, initial_state is never written. token_index ``[T']`` (optional): token t reads its
    q, k, v, a, b from row ``token_index[t]``, so a path through earlier tokens runs without copying them
    (``relayout.replay_accepted_path``); T is then T' and every other per-token tensor is T' long. leaves
    (optional, ``deferred_leaves``; not with token_index): the leaves' outputs computed by the leaf kernel from
    their parents' states; node_state_indices must then be ``leaves.node_state_indices``, the states of leaves are
    not stored, and node_states must be given.
    """
    _, T, H, K = k.shape
    if token_index is not None:
        T = token_index.shape[0]
    HV, V = v.shape[2], v.shape[3]
    assert q.shape[0] == 1 and cu_seqlens is not None and ssm_state_indices is not None and initial_state is not None
    assert HV % H == 0 and parents.shape[0] == T
    N = cu_seqlens.shape[0] - 1
    BK, BV = triton.next_power_of_2(K), min(triton.next_power_of_2(V), 32)
    scale = K**-0.5 if scale is None else scale
    if node_states is None:
        node_states = torch.empty(T, HV, V, K, dtype=torch.float32, device=q.device)
        node_state_indices = torch.arange(T, dtype=torch.int32, device=q.device)
    assert node_state_indices is not None and node_state_indices.shape[0] == T
    assert node_states.is_contiguous() or node_states.stride()[1:] == (V * K, K, 1)
    stride_idx_seq = ssm_state_indices.stride(0) if ssm_state_indices.ndim == 2 else 1
    if ssm_state_indices.ndim == 1:
        assert num_accepted_tokens is None, "1-D ssm_state_indices has a single column"
    o = q.new_empty(1, T, HV, V)
    a, b, q, k, v = (t.contiguous() for t in (a, b, q, k, v))  # once: the leaf kernel reads them too
    _tree_gdn_kernel[(triton.cdiv(V, BV), N * HV)](
        A_log, a, b, dt_bias, q, k, v, o,
        initial_state, node_states, cu_seqlens, parents, ssm_state_indices, num_accepted_tokens, node_state_indices,
        parents if token_index is None else token_index, parents if leaves is None else leaves.main_order,
        cu_seqlens if leaves is None else leaves.main_start, beta, threshold, scale, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        stride_h0=initial_state.stride(0), stride_hs=node_states.stride(0), stride_idx_seq=stride_idx_seq,
        IS_SPEC_DECODING=num_accepted_tokens is not None, USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        HAS_TOKEN_INDEX=token_index is not None, DEFER_LEAVES=leaves is not None, num_warps=4,
    )
    if leaves is not None:
        assert token_index is None and node_state_indices is leaves.node_state_indices
        _tree_gdn_leaves_kernel[(triton.cdiv(V, BV), T, HV)](
            A_log, a, b, dt_bias, q, k, v, o,
            node_states, leaves.leaf_state_rows, beta, threshold, scale,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, stride_hs=node_states.stride(0),
            USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel, num_warps=4,
        )
    return o, node_states
