"""After the tree walk: lay the accepted path's GDN state out as vLLM's chain bookkeeping expects.

vLLM's next spec step reads, per request, with ``num_accepted_tokens = a + 1`` (``(output_token_ids != -1).sum(1)``
in ``gpu_model_runner._update_states_after_model_execute``):

- the recurrent state from slot ``spec_state_indices[n, a]`` (``fused_sigmoid_gating.py``: column
  ``num_accepted - 1``), i.e. the state after the a-th accepted draft;
- the conv window from columns ``a .. a + width - 2`` of slot ``spec_state_indices[n, 0]``
  (``causal_conv1d.py``: ``conv_state_token_offset = num_accepted - 1``); after a step of T tokens the slot holds
  ``[committed (width-2 cols), x_0 .. x_{T-1}]``, so column ``width - 2 + k`` must be the input of path position k.

The tree kernels leave node inputs in pop order and node states at ``node_state_indices``. For accepted nodes
``acc[0..a]`` (``acc[0] = 0`` the root, strictly increasing, so ``acc[k] >= k``) this moves conv column
``width-2+acc[k]`` to ``width-2+k`` and copies node ``acc[a]``'s state into slot column a. Nothing else is needed:
vLLM's chain bookkeeping then runs unchanged. A chain-shaped acceptance (``acc[k] == k``) is a no-op for the
conv columns and for persistent per-node slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.hybrid.tree_gdn import tree_fused_sigmoid_gating_delta_rule_update


@dataclass
class RelayoutPlan:
    """The index work of a relayout, shared by every GDN layer of one KV-cache group (same slots, same paths): each
    layer then only moves its data (``apply_relayout``), a few kernels instead of about fifteen."""

    rows: torch.Tensor  # [N, 1] int64 conv slot of each request
    conv_dst: torch.Tensor  # [N, L] int64 conv column of path position k (k = 1..L)
    conv_src: torch.Tensor  # [N, L] int64 its source column (itself off the path)
    state_src: torch.Tensor | None  # [N] int64 node-state row of the path's last node
    state_dst: torch.Tensor | None  # [N] int64 slot that must hold it


def relayout_plan(
    conv_state_indices: torch.Tensor,
    spec_state_indices: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    width: int,
    node_state_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
) -> RelayoutPlan:
    """The indices of ``relayout_accepted_path`` (arguments as there), no data touched."""
    n_req, width_acc = accepted.shape
    acc = accepted.long()
    last = (num_accepted.long() - 1).clamp(min=0)
    k = torch.arange(1, width_acc, device=acc.device)
    dst = width - 2 + k.expand(n_req, -1)
    src = torch.where(k[None, :] <= last[:, None], width - 2 + acc[:, 1:], dst)  # off-path: copy onto itself
    plan = RelayoutPlan(conv_state_indices.long()[:, None], dst, src, None, None)
    if node_state_indices is not None:
        node = acc.gather(1, last[:, None])[:, 0]
        plan.state_src = node_state_indices.long()[query_start_loc[:n_req].long() + node]
        plan.state_dst = spec_state_indices.long().gather(1, last[:, None])[:, 0]
    return plan


def apply_relayout(
    conv_state: torch.Tensor, ssm_state: torch.Tensor, plan: RelayoutPlan, node_states: torch.Tensor | None
) -> None:
    """One GDN layer's data moves; every source is read before anything is written."""
    conv_state[plan.rows, :, plan.conv_dst] = conv_state[plan.rows, :, plan.conv_src]
    if node_states is not None and plan.state_src is not None:
        ssm_state[plan.state_dst] = node_states[plan.state_src].to(ssm_state.dtype)


def relayout_accepted_path(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_state_indices: torch.Tensor,
    spec_state_indices: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    width: int,
    node_states: torch.Tensor | None,
    node_state_indices: torch.Tensor | None,
    query_start_loc: torch.Tensor,
) -> None:
    """In place, one GDN layer, no host sync (see module docstring).

    conv_state ``(slots, dim, state_len)`` (the kernel view); ssm_state ``[slots, HV, V, K]``;
    conv_state_indices ``[N]``; spec_state_indices ``[N, >=a+1]``; accepted ``[N, L+1]`` node ids (-1 past the
    path); num_accepted ``[N]`` = a + 1; node_states / node_state_indices / query_start_loc as given to
    ``tree_fused_sigmoid_gating_delta_rule_update`` (both None: conv columns only, for ``replay_accepted_path``).
    Every source is read before anything is written. Several layers of one KV-cache group: ``relayout_plan`` once,
    then ``apply_relayout`` per layer.
    """
    plan = relayout_plan(conv_state_indices, spec_state_indices, accepted, num_accepted, width,
                         node_state_indices if node_states is not None else None, query_start_loc)
    apply_relayout(conv_state, ssm_state, plan, node_states)


def branch_node_indices(parents: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """node_state_indices storing only nodes the tree kernel must reload: those with a child other than the next node.

    ``[T]`` int32, -1 for nodes whose state is never reloaded (their only child, if any, is the next token, which
    keeps the state in registers). For the replay path (``replay_accepted_path``) this cuts the per-layer workspace
    traffic to the branch points; the workspace rows stay indexed by token, so its size is unchanged.
    """
    t = parents.shape[0]
    tok = torch.arange(t, device=parents.device)
    seq_start = query_start_loc[torch.searchsorted(query_start_loc[1:], tok, right=True)].long()
    par = parents.long()
    far = (par >= 0) & (par != tok - seq_start - 1)
    need = torch.zeros(t, dtype=torch.bool, device=parents.device)
    need[(seq_start + par.clamp(min=0))[far]] = True
    return torch.where(need, tok, -1).to(torch.int32)


def replay_accepted_path(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ssm_state: torch.Tensor,
    spec_state_indices: torch.Tensor,
    prev_num_accepted: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
) -> None:
    """Memory-light alternative to keeping every node's state: recompute the accepted path as a chain.

    Inputs are the tree step's own per-token q, k, v (post conv), a, b of this layer (``[1, T, ...]`` / ``[T, HV]``)
    and its ``prev_num_accepted`` (the verify step's num_accepted_tokens). The recurrence restarts from slot
    column ``prev_num_accepted - 1`` and runs along ``accepted`` with the same float32 arithmetic as the tree kernel,
    writing the final state into slot column ``num_accepted - 1`` as vLLM expects. The tree step then needs per-node
    states only inside one layer's kernel call (one transient workspace shared by all layers) instead of all layers'
    node states until the walk. The conv columns still need ``relayout_accepted_path`` (its ssm copy is then moot).
    """
    n_req, width_acc = accepted.shape
    dev = accepted.device
    num = num_accepted.long()
    cu = torch.zeros(n_req + 1, dtype=torch.int32, device=dev)
    torch.cumsum(num, 0, out=cu[1:])
    i = torch.arange(width_acc, device=dev)[None, :]
    valid = i < num[:, None]
    total = n_req * width_acc  # static size: rows past cu[-1] are never read; row `total` takes the padding
    dst = torch.where(valid, cu[:-1, None].long() + i, total).reshape(-1)
    src = (query_start_loc[:n_req, None].long() + accepted.long().clamp(min=0)).reshape(-1)

    def pack(x: torch.Tensor, dim: int, values: torch.Tensor | None = None) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = total + 1
        out = x.new_zeros(shape)
        out.index_copy_(dim, dst, x.index_select(dim, src) if values is None else values)
        return out.narrow(dim, 0, total)

    chain = (i - 1).expand(n_req, -1).reshape(-1).to(torch.int32)
    last = torch.where(i == num[:, None] - 1, spec_state_indices[:, :width_acc].long(), -1).reshape(-1)
    tree_fused_sigmoid_gating_delta_rule_update(
        A_log, pack(a, 0), pack(b, 0), dt_bias, pack(q, 1), pack(k, 1), pack(v, 1), pack(chain, 0, chain),
        initial_state=ssm_state, cu_seqlens=cu, ssm_state_indices=spec_state_indices,
        num_accepted_tokens=prev_num_accepted, node_states=ssm_state,
        node_state_indices=pack(last.to(torch.int32), 0, last.to(torch.int32)),
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )
