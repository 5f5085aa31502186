"""Model Runner V2's row bookkeeping around a verify forward, one kernel launch each way.

Before the forward (``prepare_rows``), for every request of the batch (its logits rows are its root, then the
drafts it was fed):

- the stale-tree guard: it verifies its tree only if it has drafts and every fed row equals the tree's token at
  that node (resumed or new requests are fed zeroed drafts while their slot may hold an older request's tree);
- its tree, gathered from its request slot into batch order (what the attention kernel and the walk read), with
  ``num_nodes`` the drafts fed, or 0 without a tree, and ``tree_rows[r]`` = r, or -1;
- depth positions: a tree row's position becomes ``s + depth(node)`` in place (slots stay linear);
- per logits row its request and node, and per request its root's token row and first logits row.

After the walk, for the drafter (``linearise_rows``): the linear positions back, and the row permutation that puts
each accepted path right after its root (``verify_layout.chain_order``).

On an H200 at batch 1 these were ~25 and ~11 small torch ops costing 0.76 ms and 0.25 ms of launches per step with
the GPU idle (benchmarks/README.md, 2026-11-30, fourth session), about half of DDTree's step overhead over the chain
there; one Triton program per request does each in a single launch. The ``*_torch`` functions are the plain-PyTorch
references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_ddtree.tree.layout import TreeBatch
from vllm_ddtree.verify_layout import TREE_FIELDS, chain_order, depth_position_shift, gather_trees


@dataclass
class PreparedRows:
    """One step's row layout, on the device (views of static buffers on the Triton path)."""

    shift: torch.Tensor  # [L] int64: depth position - linear position, 0 outside verified trees
    row_request: torch.Tensor  # [L] int64 batch row of each logits row
    row_node: torch.Tensor  # [L] int64 node of each logits row (0 = root)
    root_rows: torch.Tensor  # [R] int64 token row of each request's root
    row_starts: torch.Tensor  # [R] int64 first logits row of each request
    has_tree: torch.Tensor  # [R] bool: verifies its tree
    block_nodes: int  # next power of two of B + 1: a request's most logits rows (the kernels' lane count)


class RowBuffers:
    """The static outputs of ``prepare_rows_triton`` for up to ``max_reqs`` requests and ``max_rows`` logits rows."""

    def __init__(self, max_reqs: int, max_rows: int, device: torch.device):
        self.shift = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.row_request = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.row_node = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.root_rows = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.row_starts = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self.has_tree = torch.zeros(max_reqs, dtype=torch.int8, device=device)


@triton.jit(do_not_specialize=["num_reqs"])  # one compiled variant whatever the batch size (no JIT mid-serving)
def _prepare_rows_kernel(
    idx_mapping_ptr, cu_ptr, logits_idx_ptr, input_ids_ptr, positions_ptr,
    src_tok_ptr, src_par_ptr, src_dep_ptr, src_bits_ptr, src_nn_ptr,
    dst_tok_ptr, dst_par_ptr, dst_dep_ptr, dst_bits_ptr, dst_nn_ptr,
    tree_rows_ptr, has_tree_ptr, root_rows_ptr, row_starts_ptr, shift_ptr, row_req_ptr, row_node_ptr,
    num_reqs,
    N: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program r: request r of the batch (r >= num_reqs: only tree_rows[r] = -1). Lane j: node j of its tree,
    which is also its j-th logits row while j < its row count."""
    r = tl.program_id(0)
    live = r < num_reqs
    j = tl.arange(0, BLOCK_N)
    in_tree = (j < N) & live
    slot = tl.load(idx_mapping_ptr + r, mask=live, other=0).to(tl.int64)
    start = tl.load(cu_ptr + r, mask=live, other=0)
    n_rows = tl.load(cu_ptr + r + 1, mask=live, other=0) - start  # root + drafts fed
    fed_lane = (j < n_rows) & live

    # The guard: every fed row is the tree's token at its node, and no node past the tree's end is fed.
    tok = tl.load(src_tok_ptr + slot * N + j, mask=in_tree, other=0)
    row = tl.load(logits_idx_ptr + start + j, mask=fed_lane, other=0).to(tl.int64)
    fed = tl.load(input_ids_ptr + row, mask=fed_lane, other=0).to(tl.int64)
    num_nodes = tl.load(src_nn_ptr + slot, mask=live, other=0)
    row_ok = (fed == tok) & (j <= num_nodes)
    all_ok = tl.min(tl.where(fed_lane, row_ok.to(tl.int32), 1), axis=0)
    has_tree = (all_ok > 0) & (n_rows > 1) & live

    # The tree into batch row r (stale ones too: num_nodes 0 makes the walk ignore them).
    depth = tl.load(src_dep_ptr + slot * N + j, mask=in_tree, other=-1)
    tl.store(dst_tok_ptr + r * N + j, tok, mask=in_tree)
    tl.store(dst_par_ptr + r * N + j, tl.load(src_par_ptr + slot * N + j, mask=in_tree, other=-1), mask=in_tree)
    tl.store(dst_dep_ptr + r * N + j, depth, mask=in_tree)
    w = tl.arange(0, BLOCK_W)
    bits_at = j[:, None] * W + w[None, :]
    bits_mask = in_tree[:, None] & (w[None, :] < W)
    bits = tl.load(src_bits_ptr + slot * (N * W) + bits_at, mask=bits_mask, other=0)
    tl.store(dst_bits_ptr + r * (N * W) + bits_at, bits, mask=bits_mask)
    tl.store(dst_nn_ptr + r, tl.where(has_tree, n_rows - 1, 0), mask=live)
    tl.store(tree_rows_ptr + r, tl.where(has_tree, r, -1))
    tl.store(has_tree_ptr + r, has_tree.to(tl.int8), mask=live)

    # Depth positions (nodes past a tree's end, depth -1, keep their chain position) and the row layout.
    shift = tl.where(has_tree & (depth >= 0), depth - j, 0).to(tl.int64)
    position = tl.load(positions_ptr + row, mask=fed_lane, other=0)
    tl.store(positions_ptr + row, position + shift, mask=fed_lane & has_tree)
    tl.store(shift_ptr + start + j, shift, mask=fed_lane)
    tl.store(row_req_ptr + start + j, (j * 0 + r).to(tl.int64), mask=fed_lane)
    tl.store(row_node_ptr + start + j, j.to(tl.int64), mask=fed_lane)
    tl.store(root_rows_ptr + r, tl.sum(tl.where(j == 0, row, 0), axis=0), mask=live)
    tl.store(row_starts_ptr + r, start.to(tl.int64), mask=live)


def prepare_rows_triton(
    input_batch, source: TreeBatch, verify: TreeBatch, tree_rows: torch.Tensor, out: RowBuffers
) -> PreparedRows:
    """The Triton path: one launch over ``tree_rows``'s length (rows past the batch get -1 there)."""
    num_reqs = input_batch.num_reqs
    num_logits = input_batch.logits_indices.shape[0]
    for tree in (source, verify):
        assert all(getattr(tree, name).is_contiguous() for name in TREE_FIELDS)
    n = source.token_ids.shape[1]
    words = source.ancestor_bits.shape[2]
    block_nodes = triton.next_power_of_2(n)
    _prepare_rows_kernel[(tree_rows.shape[0],)](
        input_batch.idx_mapping, input_batch.cu_num_logits, input_batch.logits_indices, input_batch.input_ids,
        input_batch.positions,
        source.token_ids, source.parents, source.depths, source.ancestor_bits, source.num_nodes,
        verify.token_ids, verify.parents, verify.depths, verify.ancestor_bits, verify.num_nodes,
        tree_rows, out.has_tree, out.root_rows, out.row_starts, out.shift, out.row_request, out.row_node,
        num_reqs,
        N=n, BLOCK_N=block_nodes, W=words, BLOCK_W=triton.next_power_of_2(words),
    )
    return PreparedRows(
        shift=out.shift[:num_logits],
        row_request=out.row_request[:num_logits],
        row_node=out.row_node[:num_logits],
        root_rows=out.root_rows[:num_reqs],
        row_starts=out.row_starts[:num_reqs],
        has_tree=out.has_tree[:num_reqs].view(torch.bool),
        block_nodes=block_nodes,
    )


def prepare_rows_torch(
    input_batch, source: TreeBatch, verify: TreeBatch, tree_rows: torch.Tensor, out: RowBuffers | None = None
) -> PreparedRows:
    """The plain-PyTorch reference (fresh output tensors; ``out`` is ignored)."""
    device = tree_rows.device
    num_reqs = input_batch.num_reqs
    rows = input_batch.logits_indices
    num_logits = rows.shape[0]
    cu = input_batch.cu_num_logits[: num_reqs + 1]
    num_drafts = (cu[1:] - cu[:-1] - 1).to(torch.int32)
    row_request = torch.searchsorted(cu[1:], torch.arange(num_logits, dtype=cu.dtype, device=device), right=True)
    slot = input_batch.expanded_idx_mapping.to(torch.int64)
    node = input_batch.expanded_local_pos.to(torch.int64)

    fed = input_batch.input_ids[rows].to(torch.int64)
    row_ok = (fed == source.token_ids[slot, node]) & (node <= source.num_nodes[slot].to(torch.int64))
    all_ok = torch.ones(num_reqs, dtype=torch.int32, device=device)
    all_ok.scatter_reduce_(0, row_request, row_ok.to(torch.int32), reduce="amin")
    has_tree = (all_ok > 0) & (num_drafts > 0)

    gather_trees(source, input_batch.idx_mapping, verify)
    verify.num_nodes[:num_reqs] = torch.where(has_tree, num_drafts, 0)
    tree_rows.fill_(-1)
    tree_rows[:num_reqs] = torch.where(has_tree, torch.arange(num_reqs, dtype=torch.int32, device=device), -1)

    shift = depth_position_shift(verify, row_request, node, has_tree[row_request])
    input_batch.positions[rows] += shift
    return PreparedRows(
        shift=shift,
        row_request=row_request.to(torch.int64),
        row_node=node,
        root_rows=rows[cu[:-1].to(torch.int64)].to(torch.int64),
        row_starts=cu[:-1].to(torch.int64),
        has_tree=has_tree,
        block_nodes=triton.next_power_of_2(source.token_ids.shape[1]),
    )


@triton.jit
def _linearise_rows_kernel(
    cu_ptr, logits_idx_ptr, shift_ptr, positions_ptr, acc_ptr, root_rows_ptr, order_ptr,
    stride_acc, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, WALKED: tl.constexpr,
):
    """Program r: request r's logits rows get their linear positions back; once walked, its accepted path's rows
    land right after its root in ``order`` (which holds the identity before the launch)."""
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    start = tl.load(cu_ptr + r)
    fed = j < tl.load(cu_ptr + r + 1) - start
    row = tl.load(logits_idx_ptr + start + j, mask=fed, other=0).to(tl.int64)
    shift = tl.load(shift_ptr + start + j, mask=fed, other=0)
    position = tl.load(positions_ptr + row, mask=fed, other=0)
    tl.store(positions_ptr + row, position - shift, mask=fed & (shift != 0))
    if WALKED:
        accepted = tl.load(acc_ptr + r * stride_acc + j, mask=j < WIDTH, other=-1).to(tl.int64)
        root = tl.load(root_rows_ptr + r)
        tl.store(order_ptr + root + j, root + accepted, mask=(j < WIDTH) & (accepted >= 0))


def linearise_rows_triton(
    input_batch, rows: PreparedRows, accepted: torch.Tensor | None, identity: torch.Tensor
) -> torch.Tensor | None:
    """Undo the depth positions of ``input_batch``; with ``accepted`` ([R, L+1] node ids, -1 padded, L+1 <= B+1)
    return the chain order of its ``num_tokens`` rows. ``identity``: ``arange`` of at least ``num_tokens``."""
    order = identity[: input_batch.num_tokens].clone() if accepted is not None else None
    width = accepted.shape[1] if accepted is not None else 1
    _linearise_rows_kernel[(input_batch.num_reqs,)](
        input_batch.cu_num_logits, input_batch.logits_indices, rows.shift, input_batch.positions,
        accepted if accepted is not None else rows.shift, rows.root_rows, order if order is not None else identity,
        accepted.stride(0) if accepted is not None else 0,
        WIDTH=width, BLOCK_N=rows.block_nodes, WALKED=accepted is not None,
    )
    return order


def linearise_rows_torch(
    input_batch, rows: PreparedRows, accepted: torch.Tensor | None, identity: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The plain-PyTorch reference."""
    input_batch.positions[input_batch.logits_indices] -= rows.shift
    if accepted is None:
        return None
    return chain_order(accepted, rows.root_rows, input_batch.num_tokens)
