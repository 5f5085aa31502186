"""Experiment (not wired into the engine): the tree GDN recurrence by depth level, to time against the node-by-node
tree kernel (``vllm_ddtree/hybrid/tree_gdn.py``).

The tree kernel runs each request's 1 + B tokens one after another inside a program: at batch 1 a layer costs about
1.7 us per token (benchmarks/README.md, 2026-12-03 third session), so B=64 costs 3.3x B=16 although the tree is at
most 16 levels deep. Nodes of one depth depend only on the level above, so here a program takes up to ``W`` nodes of
a level at once (a ``[W, BV, K]`` state tile: each node's parent state loaded from a float32 workspace that holds
every node's state, or the request's block for the root), then the next level: about ``depth + (1 + B) / W``
sequential steps instead of ``1 + B``. The arithmetic per node is the tree kernel's; reductions over a 3-D tile may
round differently in the last bit, so it is checked against the float64 reference within a tolerance
(tests/unit/test_gdn_levels.py), not bit for bit.

    bench_tree_core.py --what gdn_tree,gdn_tree_levels --batches 1,8 --budgets 16,64 --graph
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_level_kernel(
    A_log, a, b, dt_bias, q, k, v, o, h0, hs, cu_seqlens, parents, order, level_start, ssm_state_indices,
    softplus_beta, threshold, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, LEVELS: tl.constexpr, stride_h0: tl.constexpr, stride_hs: tl.constexpr,
    stride_idx_seq: tl.constexpr, USE_QK_L2NORM_IN_KERNEL: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    state_idx = tl.load(ssm_state_indices + i_n * stride_idx_seq).to(tl.int64)
    if state_idx <= 0:
        return
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_w = tl.arange(0, W)
    mask_k = o_k < K
    mask_v = o_v < V
    h_off = (i_hv * V * K + o_v[:, None] * K + o_k[None, :])[None, :, :]  # [1, BV, BK]
    mask_h = (mask_v[:, None] & mask_k[None, :])[None, :, :]
    A = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    dtb = tl.load(dt_bias + i_hv).to(tl.float32)
    for d in range(LEVELS):
        lo = tl.load(level_start + i_n * (LEVELS + 1) + d)
        hi = tl.load(level_start + i_n * (LEVELS + 1) + d + 1)
        for c in range(lo, hi, W):
            valid = c + o_w < hi
            node = tl.load(order + bos + c + o_w, mask=valid, other=0).to(tl.int64)
            tok = bos + node
            par = tl.load(parents + tok, mask=valid, other=-1).to(tl.int64)
            root = (par < 0)[:, None, None]
            live = valid[:, None, None] & mask_h
            h_parent = tl.load(hs + (bos + tl.maximum(par, 0))[:, None, None] * stride_hs + h_off,
                               mask=live & ~root, other=0)
            h_root = tl.load(h0 + state_idx * stride_h0 + h_off + 0 * tok[:, None, None], mask=live & root, other=0)
            b_h = tl.where(root, h_root, h_parent).to(tl.float32)
            b_q = tl.load(q + ((tok * H + i_h) * K)[:, None] + o_k[None, :], mask=valid[:, None] & mask_k[None, :],
                          other=0).to(tl.float32)
            b_k = tl.load(k + ((tok * H + i_h) * K)[:, None] + o_k[None, :], mask=valid[:, None] & mask_k[None, :],
                          other=0).to(tl.float32)
            b_v = tl.load(v + ((tok * HV + i_hv) * V)[:, None] + o_v[None, :], mask=valid[:, None] & mask_v[None, :],
                          other=0).to(tl.float32)
            b_b = tl.load(b + tok * HV + i_hv, mask=valid, other=0).to(tl.float32)
            x = tl.load(a + tok * HV + i_hv, mask=valid, other=0).to(tl.float32) + dtb
            softplus_x = tl.where(
                softplus_beta * x <= threshold, (1 / softplus_beta) * tl.log(1 + tl.exp(softplus_beta * x)), x
            )
            b_g = -A * softplus_x
            b_beta = tl.sigmoid(b_b)
            if USE_QK_L2NORM_IN_KERNEL:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
            b_q = b_q * scale
            b_h *= tl.exp(b_g)[:, None, None]
            b_v -= tl.sum(b_h * b_k[:, None, :], 2)
            b_v *= b_beta[:, None]
            b_h += b_v[:, :, None] * b_k[:, None, :]
            b_o = tl.sum(b_h * b_q[:, None, :], 2)
            tl.store(o + ((tok * HV + i_hv) * V)[:, None] + o_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=valid[:, None] & mask_v[None, :])
            tl.store(hs + tok[:, None, None] * stride_hs + h_off, b_h, mask=live)
        tl.debug_barrier()  # the next level reads this level's states from other threads of the block


def level_order(parents: torch.Tensor, cu_seqlens: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's nodes by depth (stable, request-relative ids, ``[T]``) and each level's first position in that
    order, ``[N, levels + 1]``. Device ops, static shapes: ``levels`` bounds the depth (tree depth + 1)."""
    t, n = parents.shape[0], cu_seqlens.shape[0] - 1
    tok = torch.arange(t, device=parents.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), tok, right=True)
    bos = cu_seqlens.long()[seq]
    par = parents.long()
    depth = torch.zeros(t, dtype=torch.long, device=parents.device)
    for _ in range(levels - 1):  # parents come first: depth settles within the tree's depth
        depth = torch.where(par >= 0, depth[(bos + par).clamp(min=0)] + 1, 0)
    key = (seq * levels + depth) * t + tok
    order = (torch.argsort(key) - bos).to(torch.int32)  # a request's nodes stay within its own rows
    counts = torch.zeros(n * levels, dtype=torch.int32, device=parents.device)
    counts.scatter_add_(0, seq * levels + depth, torch.ones_like(seq, dtype=torch.int32))
    starts = torch.zeros(n, levels + 1, dtype=torch.int32, device=parents.device)
    starts[:, 1:] = torch.cumsum(counts.view(n, levels), 1)
    return order, starts


def tree_gdn_by_level(A_log, a, b, dt_bias, q, k, v, parents, initial_state, cu_seqlens, ssm_state_indices,
                      levels: int, workspace: torch.Tensor | None = None, width: int = 4,
                      use_qk_l2norm_in_kernel: bool = True,
                      order_and_starts: tuple[torch.Tensor, torch.Tensor] | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree kernel's contract (q, k ``[1, T, H, K]``, v ``[1, T, HV, V]``, a, b ``[T, HV]``, the initial state
    from ``ssm_state_indices`` column 0), by level; returns (o ``[1, T, HV, V]``, every node's state ``[T, HV, V, K]``).
    ``width``: nodes of a level per program step; ``order_and_starts``: ``level_order``'s result, computed once per
    forward for every layer (None: computed here)."""
    _, t, h, kd = k.shape
    hv, vd = v.shape[2], v.shape[3]
    n = cu_seqlens.shape[0] - 1
    bk, bv = triton.next_power_of_2(kd), min(triton.next_power_of_2(vd), 8)
    if workspace is None:
        workspace = torch.empty(t, hv, vd, kd, dtype=torch.float32, device=q.device)
    order, starts = order_and_starts or level_order(parents, cu_seqlens, levels)
    o = q.new_empty(1, t, hv, vd)
    idx = ssm_state_indices if ssm_state_indices.ndim == 2 else ssm_state_indices[:, None]
    _gdn_level_kernel[(triton.cdiv(vd, bv), n * hv)](
        A_log, a.contiguous(), b.contiguous(), dt_bias, q.contiguous(), k.contiguous(), v.contiguous(), o,
        initial_state, workspace, cu_seqlens, parents, order, starts, idx, 1.0, 20.0, kd**-0.5,
        H=h, HV=hv, K=kd, V=vd, BK=bk, BV=bv, W=width, LEVELS=levels, stride_h0=initial_state.stride(0),
        stride_hs=workspace.stride(0), stride_idx_seq=idx.stride(0), USE_QK_L2NORM_IN_KERNEL=use_qk_l2norm_in_kernel,
        num_warps=4,
    )
    return o, workspace
