"""The tree walk (``sampler.walk_tree``) in one Triton launch: one program per request.

``walk_tree`` is about 25 small torch kernels (gathers, a bit-word reduction, a scatter-amax, the output assembly);
inside the walk's CUDA graph they cost 90 us of device time per decode step on an H200 at batch 1 (Qwen3-8B shape,
2026-12-02), each kernel mostly launch latency, against one kernel here. The rule is the same: node i is on the
accepted path iff every edge from the root down to it is good (its token is what the target drew at its parent, and
it is a live node), checked as ``ancestor_bits[i] & ~good == 0``; the path's nodes have distinct depths, the deepest
accepted one (at most ``max_depth``) gives the bonus token. Outputs and padding as ``walk_tree`` writes them;
``walk_tree`` is the reference the tests hold this to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.sampler import TreeWalkOutput
from vllm_ddtree.tree.layout import TreeBatch


@triton.jit
def _walk_kernel(
    drawn_ptr, stride_drawn, tok_ptr, stride_tok, par_ptr, stride_par, dep_ptr, stride_dep, num_nodes_ptr,
    bits_ptr, stride_bits0, stride_bits1,
    out_tok_ptr, stride_out_tok, out_acc_ptr, stride_out_acc, num_acc_ptr,
    WIDTH: tl.constexpr, NODE_PAD: tl.constexpr, WORDS: tl.constexpr, WORD_PAD: tl.constexpr,
    MAX_DEPTH: tl.constexpr, OUT_PAD: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    node = tl.arange(0, NODE_PAD)
    in_row = node < WIDTH
    parent = tl.load(par_ptr + r * stride_par + node, mask=in_row, other=-1)
    token = tl.load(tok_ptr + r * stride_tok + node, mask=in_row, other=0).to(tl.int64)
    depth = tl.load(dep_ptr + r * stride_dep + node, mask=in_row, other=-1)
    live = in_row & (node <= tl.load(num_nodes_ptr + r)) & (parent >= 0)
    drawn_at_parent = tl.load(drawn_ptr + r * stride_drawn + tl.maximum(parent, 0), mask=live, other=-1)
    edge_ok = (live & (token == drawn_at_parent.to(tl.int64))) | (node == 0)

    # The good edges as bit words, then: on the path iff no ancestor-or-self bit falls outside them.
    word = tl.arange(0, WORD_PAD)
    good = tl.zeros([WORD_PAD], dtype=tl.int64)
    for w in tl.static_range(WORDS):
        bits = tl.where(edge_ok & (node // 32 == w), tl.full([NODE_PAD], 1, tl.int64) << (node % 32), 0)
        good = tl.where(word == w, tl.sum(bits, axis=0), good)  # distinct bits: the sum is the or
    ancestors = tl.load(bits_ptr + r * stride_bits0 + node[:, None] * stride_bits1 + word[None, :],
                        mask=in_row[:, None] & (word < WORDS)[None, :], other=0).to(tl.int64) & 0xFFFFFFFF
    outside = tl.sum(((ancestors & ~good[None, :]) != 0).to(tl.int32), axis=1)
    on_path = edge_ok & (outside == 0) & in_row & (depth <= MAX_DEPTH)

    # Position p of the output: the path's node at depth p (p <= a), the token of its node at depth p + 1 (p < a),
    # the bonus at p = a, -1 past it.
    accepted = tl.max(tl.where(on_path, depth, 0), axis=0)
    pos = tl.arange(0, OUT_PAD)
    at = on_path[None, :] & (depth[None, :] == pos[:, None])  # [OUT_PAD, NODE_PAD]
    node_at = tl.max(tl.where(at, node[None, :], -1), axis=1)
    next_at = on_path[None, :] & (depth[None, :] == pos[:, None] + 1)
    token_next = tl.max(tl.where(next_at, token[None, :], -1), axis=1)
    deepest = tl.max(tl.where(on_path & (depth == accepted), node, 0), axis=0)
    bonus = tl.load(drawn_ptr + r * stride_drawn + deepest).to(tl.int64)
    out_token = tl.where(pos < accepted, token_next, tl.where(pos == accepted, bonus, -1))
    in_out = pos <= MAX_DEPTH
    tl.store(out_acc_ptr + r * stride_out_acc + pos, node_at.to(tl.int32), mask=in_out)
    tl.store(out_tok_ptr + r * stride_out_tok + pos, out_token.to(tl.int32), mask=in_out)
    tl.store(num_acc_ptr + r, accepted.to(tl.int32))


def walk_tree_triton(
    node_tokens: torch.Tensor, tree: TreeBatch, max_depth: int, out: TreeWalkOutput | None = None
) -> TreeWalkOutput:
    """``sampler.walk_tree``, same arguments and outputs, in one launch."""
    rows, width = node_tokens.shape
    if out is None:
        out = TreeWalkOutput.allocate(rows, max_depth, node_tokens.device)
    words = tree.ancestor_bits.shape[-1]
    _walk_kernel[(rows,)](
        node_tokens, node_tokens.stride(0), tree.token_ids, tree.token_ids.stride(0), tree.parents,
        tree.parents.stride(0), tree.depths, tree.depths.stride(0), tree.num_nodes,
        tree.ancestor_bits, tree.ancestor_bits.stride(0), tree.ancestor_bits.stride(1),
        out.output_token_ids, out.output_token_ids.stride(0), out.accepted_node_ids, out.accepted_node_ids.stride(0),
        out.num_accepted,
        WIDTH=width, NODE_PAD=triton.next_power_of_2(width), WORDS=words, WORD_PAD=triton.next_power_of_2(words),
        MAX_DEPTH=max_depth, OUT_PAD=triton.next_power_of_2(max_depth + 1),
    )
    return out
