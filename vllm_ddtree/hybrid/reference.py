"""Float64 plain-PyTorch references for GatedDeltaNet (GDN) layers under tree verification.

vLLM 0.26.0 verifies drafts on hybrid targets as a chain: token t's conv window ends in token t-1 and its
recurrent state starts from token t-1's (``ops/causal_conv1d.py::_causal_conv1d_update_kernel``,
``fla/ops/fused_sigmoid_gating.py``). The ``*_chain`` functions restate exactly that math for one sequence;
the ``*_tree`` functions replace "t-1" by "parent(t)". The tests check that a tree equals the chain run along
every root-to-node path, and that the chain references equal vLLM's own kernels, so the tree kernels inherit
vLLM's semantics. Slow and loop-based on purpose: these are what the Triton kernels must equal.

Layouts (one sequence, mirroring vLLM): x ``[T, dim]``; conv weight ``[dim, width]``; committed conv columns
``prior [dim, width-1]`` (oldest first); q, k ``[T, H, K]``; v ``[T, HV, V]``; a, b ``[T, HV]``; A_log, dt_bias
``[HV]``; recurrent state ``h [HV, V, K]`` (vLLM stores h[v, k]); value head hv reads q/k head ``hv // (HV // H)``.
Node 0 is the root (parent -1), ``parents[i] < i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

f64 = torch.float64


def conv_window_sources(parents: list[int], width: int) -> list[list[int]]:
    """Per node, the ``width - 1`` inputs before it, oldest first: node ids (>= 0) or committed columns (< 0).

    ``-1`` is the newest committed column, ``-(width-1)`` the oldest; the chain case gives ``[t-3, t-2, t-1]``.
    """
    out = []
    for t in range(len(parents)):
        src, pos = [], t
        for _ in range(width - 1):
            pos = parents[pos] if pos >= 0 else pos - 1  # root's parent is -1 = newest committed column
            src.append(pos)
        out.append(src[::-1])
    return out


def _conv(x, parents, prior, weight, bias, silu):
    x, prior, weight = x.to(f64), prior.to(f64), weight.to(f64)
    width = weight.shape[1]
    out = torch.empty_like(x)
    for t, src in enumerate(conv_window_sources(parents, width)):
        cols = [x[s] if s >= 0 else prior[:, width - 1 + s] for s in src] + [x[t]]
        acc = (torch.stack(cols, 1) * weight).sum(1)
        if bias is not None:
            acc = acc + bias.to(f64)
        out[t] = F.silu(acc) if silu else acc
    return out


def conv_chain_reference(x, prior, weight, bias=None, silu=True):
    """vLLM's causal_conv1d_update for one sequence: token t sees ``[prior, x_0..x_t][-width:]``."""
    return _conv(x, list(range(-1, x.shape[0] - 1)), prior, weight, bias, silu)


def conv_tree_reference(x, parents, prior, weight, bias=None, silu=True):
    """Each node's window is its ancestor chain (parent, grandparent, ...), then the committed columns."""
    return _conv(x, list(parents), prior, weight, bias, silu)


def gdn_gates(a, b, A_log, dt_bias, softplus_beta=1.0, threshold=20.0):
    """vLLM's fused sigmoid gating: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    x = a.to(f64) + dt_bias.to(f64)
    sp = torch.where(softplus_beta * x <= threshold, torch.log1p(torch.exp(softplus_beta * x)) / softplus_beta, x)
    return -torch.exp(A_log.to(f64)) * sp, torch.sigmoid(b.to(f64))


def gdn_step(h, q, k, v, g, beta, scale, l2norm=True):
    """One delta-rule token: decay, delta update, read out. h ``[HV, V, K]``; returns (h', o ``[HV, V]``)."""
    rep = v.shape[0] // q.shape[0]
    q, k = q.to(f64).repeat_interleave(rep, 0), k.to(f64).repeat_interleave(rep, 0)
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    h = h * torch.exp(g)[:, None, None]
    delta = (v.to(f64) - torch.einsum("hvk,hk->hv", h, k)) * beta[:, None]
    h = h + delta[:, :, None] * k[:, None, :]
    return h, torch.einsum("hvk,hk->hv", h, q * scale)


def _gdn(q, k, v, a, b, A_log, dt_bias, h0, parents, scale, l2norm):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    states, outs = [], []
    for t, p in enumerate(parents):
        h, o = gdn_step(h0.to(f64) if p < 0 else states[p], q[t], k[t], v[t], g[t], beta[t], scale, l2norm)
        states.append(h)
        outs.append(o)
    return torch.stack(outs), torch.stack(states)


def gdn_chain_reference(q, k, v, a, b, A_log, dt_bias, h0, scale=None, l2norm=True):
    """vLLM's recurrence for one sequence from state h0: returns (o ``[T, HV, V]``, state after each token)."""
    return _gdn(q, k, v, a, b, A_log, dt_bias, h0, list(range(-1, q.shape[0] - 1)), scale, l2norm)


def gdn_tree_reference(q, k, v, a, b, A_log, dt_bias, h0, parents, scale=None, l2norm=True):
    """Each node starts from its parent's state (the root from h0): (o ``[T, HV, V]``, per-node states)."""
    return _gdn(q, k, v, a, b, A_log, dt_bias, h0, list(parents), scale, l2norm)


def conv_roll_reference(row, x, num_accepted, width):
    """vLLM's spec-decode conv-state update for one sequence: ``[row[a..a+width-3], x_0..x_{T-1}]``, a = accepted-1.

    ``row [dim, state_len]`` is the slot before the step; returns the slot after it (columns past
    ``width - 2 + T`` keep their old values, as in vLLM).
    """
    new, off = row.clone(), num_accepted - 1
    new[:, : width - 2] = row[:, off + 1 : off + width - 1]
    new[:, width - 2 : width - 2 + x.shape[0]] = x.T.to(row.dtype)
    return new


def relayout_reference(conv_state, ssm_state, conv_state_indices, spec_state_indices, accepted, num_accepted, width,
                       node_states, node_state_indices, query_start_loc):
    """Loop version of relayout.relayout_accepted_path (see there); works on copies and returns them."""
    conv_state, ssm_state = conv_state.clone(), ssm_state.clone()
    for n in range(accepted.shape[0]):
        a, slot = int(num_accepted[n]) - 1, int(conv_state_indices[n])
        row = conv_state[slot].clone()
        for i in range(1, a + 1):
            conv_state[slot, :, width - 2 + i] = row[:, width - 2 + int(accepted[n, i])]
        src = int(node_state_indices[int(query_start_loc[n]) + int(accepted[n, a])])
        ssm_state[int(spec_state_indices[n, a])] = node_states[src]
    return conv_state, ssm_state
