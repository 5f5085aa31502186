"""Causal-conv1d update over a draft tree: vLLM's spec-decode conv kernel with ancestor windows.

vLLM's ``causal_conv1d_update(..., num_accepted_tokens=...)`` (``model_executor/layers/mamba/ops/causal_conv1d.py``)
gives token t the window ``[committed columns, x_0..x_t][-width:]``. In a tree, node t's window must instead be
``[..., x_grandparent, x_parent, x_t]``, continuing into the committed columns once the walk passes the root.
The window sources depend only on the tree, so ``tree_conv_window`` computes them once per step and every GDN
layer reuses them; the kernel then does ``width`` masked loads per node.

The conv-state slot is updated exactly as vLLM does (``[row[a..a+width-3], x_0..x_{T-1}]`` with a the previous
step's accepted count - 1, nodes in pop order), so a chain-shaped tree leaves the same slot as vLLM, and the
post-accept relayout (relayout.py) only has to permute node columns into path order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def flat_token_parents(tree_parents: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Token-level parents ``[num_tokens]`` from per-request rows (``TreeBatch.parents`` of the spec requests).

    Request n's tokens ``query_start_loc[n]..[n+1]`` are its nodes 0.. in pop order (the scheduler may cut a tree
    to any prefix, which is still a tree). num_tokens comes from the host-side token count, so no sync.
    """
    tok = torch.arange(num_tokens, device=tree_parents.device)
    seq = torch.searchsorted(query_start_loc[1:], tok, right=True)
    return tree_parents[seq, tok - query_start_loc[seq]].to(torch.int32)


def tree_conv_window(parents: torch.Tensor, query_start_loc: torch.Tensor, width: int) -> torch.Tensor:
    """``[T, width-1]`` int32 window sources per token, oldest first (no host sync).

    parents: ``[T]`` sequence-relative parent per token (root -1). Entry >= 0: a node of the same sequence
    (sequence-relative); entry < 0: committed column, -1 the newest (vLLM column ``a + width - 2``).
    """
    num_tokens = parents.shape[0]
    tok = torch.arange(num_tokens, device=parents.device)
    bos = query_start_loc[torch.searchsorted(query_start_loc[1:], tok, right=True)].long()
    pos = tok - bos
    cols = []
    for _ in range(width - 1):
        up = parents.long()[bos + pos.clamp(min=0)]
        pos = torch.where(pos >= 0, up, pos - 1)
        cols.append(pos)
    return torch.stack(cols[::-1], 1).to(torch.int32).contiguous()


@triton.jit
def _sequence_rows(x_ptr, conv_state_ptr, conv_state_indices_ptr, num_accepted_ptr, qsl_ptr, dim, stride_csi,
                   stride_x_dim, stride_cs_seq, stride_cs_dim, BLOCK_N: tl.constexpr):
    """A program's sequence and feature block, for both kernels: the features and their mask, the conv slot, the
    sequence's first token and length, the previous step's accepted count - 1, and the feature rows of its conv
    slot and of x."""
    n = tl.program_id(0)
    feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    fmask = feats < dim
    slot = tl.load(conv_state_indices_ptr + n * stride_csi).to(tl.int64)
    bos = tl.load(qsl_ptr + n).to(tl.int64)
    seqlen = tl.load(qsl_ptr + n + 1).to(tl.int64) - bos
    offset = tl.load(num_accepted_ptr + n).to(tl.int64) - 1
    row = conv_state_ptr + slot * stride_cs_seq + feats * stride_cs_dim  # [BLOCK_N]
    x_rows = x_ptr + feats * stride_x_dim
    return feats, fmask, slot, bos, seqlen, offset, row, x_rows


@triton.jit
def _tree_conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, conv_state_ptr, conv_state_indices_ptr, num_accepted_ptr, qsl_ptr, window_ptr, o_ptr,
    dim, stride_csi, stride_x_tok, stride_x_dim, stride_w_dim, stride_w_width,
    stride_cs_seq, stride_cs_dim, stride_cs_tok, stride_win, stride_o_tok, stride_o_dim,
    null_block_id,
    HAS_BIAS: tl.constexpr, KERNEL_WIDTH: tl.constexpr, SILU: tl.constexpr, HAS_NULL_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (sequence, feature block, token block): the outputs of BLOCK_T tokens at once. No output depends on
    another's, so a sequence's tokens need not run one after another as in vLLM's kernel (where each program loops
    over its tokens: at B=64 on Qwen3.6-27B that loop made the tree conv 5x the chain's, H200 profile 2026-12-04)."""
    feats, fmask, slot, bos, seqlen, offset, row, x_rows = _sequence_rows(
        x_ptr, conv_state_ptr, conv_state_indices_ptr, num_accepted_ptr, qsl_ptr, dim, stride_csi, stride_x_dim,
        stride_cs_seq, stride_cs_dim, BLOCK_N)
    if HAS_NULL_BLOCK:
        if slot == null_block_id:
            return
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < seqlen
    if tl.program_id(2) * BLOCK_T >= seqlen:
        return
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + feats, mask=fmask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32) + acc0[None, :]
    for j in tl.static_range(KERNEL_WIDTH):
        if j == KERNEL_WIDTH - 1:
            pos = t
        else:
            pos = tl.load(window_ptr + (bos + t) * stride_win + j, mask=tmask, other=0).to(tl.int64)
        in_tree = pos >= 0
        xv = tl.load(x_rows[None, :] + ((bos + tl.maximum(pos, 0)) * stride_x_tok)[:, None],
                     mask=(tmask & in_tree)[:, None] & fmask[None, :], other=0.0)
        col = offset + KERNEL_WIDTH - 1 + tl.minimum(pos, -1)
        sv = tl.load(row[None, :] + (col * stride_cs_tok)[:, None], mask=(tmask & (pos < 0))[:, None] & fmask[None, :],
                     other=0.0)
        wv = tl.load(w_ptr + feats * stride_w_dim + j * stride_w_width, mask=fmask, other=0.0)
        acc += tl.where(in_tree[:, None], xv.to(sv.dtype), sv) * wv[None, :]
    if SILU:
        acc = acc / (1 + tl.exp(-acc))
    tl.store(o_ptr + ((bos + t) * stride_o_tok)[:, None] + (feats * stride_o_dim)[None, :], acc,
             mask=tmask[:, None] & fmask[None, :])


@triton.jit
def _tree_conv_roll_kernel(
    x_ptr, conv_state_ptr, conv_state_indices_ptr, num_accepted_ptr, qsl_ptr,
    dim, stride_csi, stride_x_tok, stride_x_dim, stride_cs_seq, stride_cs_dim, stride_cs_tok,
    null_block_id,
    KERNEL_WIDTH: tl.constexpr, HAS_NULL_BLOCK: tl.constexpr, NP2_STATELEN: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Roll the slot exactly like vLLM (``[row[a..a+width-3], x_0..x_{T-1}]``); a launch of its own so that it runs
    after every window read of the committed columns (``_tree_conv_update_kernel``, any program)."""
    feats, fmask, slot, bos, seqlen, offset, row, x_rows = _sequence_rows(
        x_ptr, conv_state_ptr, conv_state_indices_ptr, num_accepted_ptr, qsl_ptr, dim, stride_csi, stride_x_dim,
        stride_cs_seq, stride_cs_dim, BLOCK_N)
    if HAS_NULL_BLOCK:
        if slot == null_block_id:
            return
    if seqlen == 0:
        return
    idx = tl.arange(0, NP2_STATELEN)
    keep = idx < KERNEL_WIDTH - 2
    new_len = KERNEL_WIDTH - 2 + seqlen
    old = tl.load(row[None, :] + ((offset + 1 + idx) * stride_cs_tok)[:, None], mask=keep[:, None] & fmask[None, :],
                  other=0.0)
    xi = tl.maximum(idx - (KERNEL_WIDTH - 2), 0)
    xs = tl.load(x_rows[None, :] + ((bos + xi) * stride_x_tok)[:, None],
                 mask=(~keep & (idx < new_len))[:, None] & fmask[None, :], other=0.0)
    tl.store(row[None, :] + (idx * stride_cs_tok)[:, None], tl.where(keep[:, None], old, xs.to(old.dtype)),
             mask=(idx < new_len)[:, None] & fmask[None, :])


def tree_causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: bool | str | None,
    conv_state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    window: torch.Tensor,
    null_block_id: int | None = None,
) -> torch.Tensor:
    """Tree version of vLLM's varlen spec-decode ``causal_conv1d_update``; same argument meanings, plus ``window``.

    x ``[T, dim]`` (tokens of each sequence = its tree nodes in pop order); conv_state ``(slots, dim, state_len)``
    (vLLM's kernel view: the SD cache transposed); weight ``(dim, width)``; conv_state_indices ``[N]``, any stride
    (vLLM passes ``spec_state_indices_tensor[:, 0]``, a column); num_accepted_tokens ``[N]``; query_start_loc
    ``[N+1]``; window from ``tree_conv_window``. Unlike vLLM the output is a new tensor: ancestors' inputs are re-read
    after their own outputs are written, so x cannot be overwritten in place. Returns ``[T, dim]`` in x's dtype.
    """
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    assert activation in (None, "silu", "swish")
    dim, width = weight.shape
    assert width >= 2 and conv_state.shape[1] == dim and x.shape[1] == dim and window.shape[1] == width - 1
    assert conv_state.shape[2] >= width - 2 + max_query_len, "conv slot too short for the tree (num_spec < budget?)"
    xs = x.to(conv_state.dtype)
    out = torch.empty_like(xs)
    batch = conv_state_indices.shape[0]
    null = null_block_id if null_block_id is not None else 0
    # Sizes from the slot's length, not from max_query_len: vLLM passes spec_state_indices_tensor.size(-1), which is
    # 1 + B only on its full-CUDA-graph path; elsewhere (a verify batched with a prefill, or more verify tokens than
    # the largest decode graph) the replay layout's one-column block table makes it 1. A tree has at most
    # state_len - (width - 2) tokens (the slot is width - 1 + B long).
    state_len = conv_state.shape[2]
    block_t, block_n = 16, 128
    _tree_conv_update_kernel[(batch, triton.cdiv(dim, block_n), triton.cdiv(state_len - (width - 2), block_t))](
        xs, weight, bias, conv_state, conv_state_indices, num_accepted_tokens, query_start_loc, window, out,
        dim, conv_state_indices.stride(0), xs.stride(0), xs.stride(1), weight.stride(0), weight.stride(1),
        *conv_state.stride(), window.stride(0), out.stride(0), out.stride(1), null,
        HAS_BIAS=bias is not None, KERNEL_WIDTH=width, SILU=activation is not None,
        HAS_NULL_BLOCK=null_block_id is not None, BLOCK_T=block_t, BLOCK_N=block_n,
    )
    _tree_conv_roll_kernel[(batch, triton.cdiv(dim, 256))](
        xs, conv_state, conv_state_indices, num_accepted_tokens, query_start_loc,
        dim, conv_state_indices.stride(0), xs.stride(0), xs.stride(1), *conv_state.stride(), null,
        KERNEL_WIDTH=width, HAS_NULL_BLOCK=null_block_id is not None,
        NP2_STATELEN=triton.next_power_of_2(state_len), BLOCK_N=256,
    )
    return out.to(x.dtype)
