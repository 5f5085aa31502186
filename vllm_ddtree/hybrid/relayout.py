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
import triton
import triton.language as tl

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


@triton.jit
def _move_conv_columns_kernel(
    conv_ptr, slots_ptr, accepted_ptr, kept_ptr, dim, stride_seq, stride_dim, stride_tok, stride_acc,
    WIDTH: tl.constexpr, L: tl.constexpr, LP2: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (request, feature block): column ``width - 2 + accepted[k]`` to ``width - 2 + k`` for path positions
    k = 1..kept-1 that moved; all of the program's sources are read before any is written."""
    n = tl.program_id(0)
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fmask = feats < dim
    slot = tl.load(slots_ptr + n).to(tl.int64)
    last = tl.load(kept_ptr + n) - 1
    ks = 1 + tl.arange(0, LP2)
    on_path = (ks <= last) & (ks <= L)
    src = tl.load(accepted_ptr + n * stride_acc + ks, mask=on_path, other=0)
    move = on_path & (src != ks)
    row = conv_ptr + slot * stride_seq + feats * stride_dim
    mask = move[:, None] & fmask[None, :]
    vals = tl.load(row[None, :] + ((WIDTH - 2 + src.to(tl.int64)) * stride_tok)[:, None], mask=mask, other=0.0)
    tl.debug_barrier()  # a destination may be another position's source, read by other threads of the block
    tl.store(row[None, :] + ((WIDTH - 2 + ks.to(tl.int64)) * stride_tok)[:, None], vals, mask=mask)


def move_conv_columns(conv_state: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, kept: torch.Tensor,
                      width: int) -> None:
    """One GDN layer's conv columns onto the accepted path in one launch (the replay layout's relayout: what
    ``apply_relayout`` does with ``relayout_plan(..., node_state_indices=None)``, its reference). conv_state
    ``(slots, dim, state_len)``; slots ``[N]`` each request's block (no two live requests share one; a row with
    ``kept`` 1 moves nothing, so padding rows may all name the null block); accepted ``[N, L+1]`` path node ids;
    kept ``[N]`` path length. Replaces a gather and a scatter over every request's L columns (H200, Qwen3.6-27B
    B=64: 9 us per layer at batch 1, 19 at batch 8, 2026-12-04 profile)."""
    n, width_acc = accepted.shape
    assert accepted.stride(1) == 1
    dim = conv_state.shape[1]
    block_n = 256
    _move_conv_columns_kernel[(n, triton.cdiv(dim, block_n))](
        conv_state, slots, accepted, kept, dim, *conv_state.stride(), accepted.stride(0),
        WIDTH=width, L=width_acc - 1, LP2=triton.next_power_of_2(max(width_acc - 1, 1)), BLOCK_N=block_n,
    )


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


@dataclass
class ReplayPlan:
    """The index work of a replay (``replay_plan``), shared by every GDN layer whose tokens sit in the same rows: each
    layer then runs one kernel (``apply_replay``)."""

    cu_seqlens: torch.Tensor  # [N+1] int32 the paths packed one after another
    token_index: torch.Tensor  # [N * (L+1)] int32 the input row of each packed path position
    parents: torch.Tensor  # [N * (L+1)] int32 chain parents (position - 1, root -1)
    initial_slots: torch.Tensor  # [N, 1] int32 slot the path starts from (<= 0: the request is skipped)
    final_slots: torch.Tensor  # [N * (L+1)] int32 the path's last position -> its slot, every other -1


def replay_plan(
    initial_slots: torch.Tensor,
    final_slots: torch.Tensor,
    accepted: torch.Tensor,
    num_accepted: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> ReplayPlan:
    """Indices to recompute each request's accepted path as a chain (device ops, static shapes, no host sync).

    initial_slots ``[N]``: the slot holding the state the step started from (<= 0 skips the request, as vLLM's null
    block); final_slots ``[N]``: where the path's last state goes; accepted ``[N, L+1]`` node ids (-1 past the
    path); num_accepted ``[N]`` = a + 1; query_start_loc ``[>=N]``: each request's first row in the inputs.
    """
    n_req, width_acc = accepted.shape
    dev = accepted.device
    num = num_accepted.long()
    cu = torch.zeros(n_req + 1, dtype=torch.int32, device=dev)
    torch.cumsum(num, 0, out=cu[1:])
    i = torch.arange(width_acc, device=dev)[None, :]
    valid = i < num[:, None]
    total = n_req * width_acc  # static size: positions past cu[-1] are never read; position `total` takes the padding
    dst = torch.where(valid, cu[:-1, None].long() + i, total).reshape(-1)
    src = (query_start_loc[:n_req, None].long().clamp(min=0) + accepted.long().clamp(min=0)).reshape(-1)

    def packed(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(total + 1, dtype=torch.int32, device=dev)
        out.index_copy_(0, dst, values.to(torch.int32))
        return out[:total]

    chain = (i - 1).expand(n_req, -1).reshape(-1)
    last = torch.where(i == num[:, None] - 1, final_slots.long()[:, None], -1).reshape(-1)
    return ReplayPlan(cu, packed(src), packed(chain), initial_slots.to(torch.int32)[:, None], packed(last))


def apply_replay(
    plan: ReplayPlan,
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ssm_state: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = True,
) -> None:
    """One GDN layer: its accepted paths rerun from their initial slots, the last state written to the final slot.

    q, k, v ``[1, T, ...]`` and a, b ``[T, HV]``: the tree step's own inputs of this layer (post conv), read in place
    through the plan's token index; the same float32 arithmetic as the tree kernel, so the state equals the tree's
    node state bit for bit."""
    tree_fused_sigmoid_gating_delta_rule_update(
        A_log, a, b, dt_bias, q, k, v, plan.parents, initial_state=ssm_state, cu_seqlens=plan.cu_seqlens,
        ssm_state_indices=plan.initial_slots, node_states=ssm_state, node_state_indices=plan.final_slots,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, token_index=plan.token_index,
    )


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
    Several layers: ``replay_plan`` once, ``apply_replay`` per layer.
    """
    idx = spec_state_indices.long()
    initial = idx.gather(1, (prev_num_accepted.long() - 1)[:, None])[:, 0]
    final = idx.gather(1, (num_accepted.long() - 1).clamp(min=0)[:, None])[:, 0]
    plan = replay_plan(initial, final, accepted, num_accepted, query_start_loc)
    apply_replay(plan, A_log, a, b, dt_bias, q, k, v, ssm_state, use_qk_l2norm_in_kernel)
