"""Where a verify step's tree nodes sit among the target's token rows, for both runners, one kernel launch each way.

A request that verifies a tree owns ``1 + n`` consecutive rows: its root (the last sampled token), then the drafts it
was fed, which are nodes 1..n of its tree in tree order, at slots ``s .. s + n`` (slots stay linear: vLLM derives
them from positions before we touch the positions).

Before the forward (``prepare_rows``), per request of the batch:

- the guard: it verifies its tree only if the tree was filed by the latest draft step (``stamp == epoch``: a tree
  serves the one verify step after its propose, and is consumed by it), it was fed drafts, and every fed row equals
  the tree's token at that node (resumed or new requests are fed placeholder drafts while their slot may hold an
  older tree);
- its tree, gathered from its request slot into batch order (what the attention kernel and the walk read), with
  ``num_nodes`` the drafts fed (0 without a tree), and ``tree_rows[r]`` = r, or -1;
- depth positions: a tree row's position becomes ``s + depth(node)`` in place (M-RoPE: all three rows);
- per logits row its request and node, and per request its root's token row and first logits row.

A chain step (``chains`` given: the chain fallback, ``verify_core``) verifies each request's DFlash chain instead:
the guard is the same (the runner fed the tree's first drafts), then the chain's tokens overwrite the fed drafts
(the same tokens where the drafter knew and filed only the chain, ``tree.build.build_chain``), the verify tree is
the chain (node i: parent i - 1, depth i, so positions stay linear) and ``tree_rows`` stays -1,
so attention is causal: vLLM's own kernel. The walk needs nothing else; compaction and linearisation are skipped.

After the walk (``linearise_rows``), for the drafter: the linear positions back, and the row permutation that puts
each accepted path right after its root (``chain_order``), so the drafter (and logprobs) see a plain chain.

On an H200 at batch 1 these were ~25 and ~11 small torch ops costing 0.76 ms and 0.25 ms of launches per step with
the GPU idle (benchmarks/README.md, 2026-11-30); one Triton program per request does each in a single launch. The
``*_torch`` functions are the plain-PyTorch references the kernels are tested against (and the CPU engine's path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_ddtree.tree.build import fill_chains
from vllm_ddtree.tree.layout import TreeBatch

TREE_FIELDS = ("token_ids", "parents", "depths", "ancestor_bits")


@dataclass
class RowInputs:
    """A verify step's target rows, as the runner laid them out (device tensors, views of its static buffers)."""

    slots: torch.Tensor  # [R] int32/int64: each request's persistent slot (where its tree was filed)
    cu_num_logits: torch.Tensor  # [R + 1] int32: logits rows of request r are cu[r] .. cu[r+1] (root, then drafts)
    logits_indices: torch.Tensor  # [L] int: token row of each logits row
    input_ids: torch.Tensor  # [>= T] int: the fed tokens
    positions: torch.Tensor  # [>= T] int64, rewritten in place
    mrope_positions: torch.Tensor | None  # [3, >= T] int64 for M-RoPE targets, rewritten in place
    num_reqs: int
    num_tokens: int


@dataclass
class PreparedRows:
    """One step's row layout, on the device (views of static buffers on the Triton path)."""

    shift: torch.Tensor  # [L] int64: depth position - linear position, 0 outside verified trees
    row_request: torch.Tensor  # [L] int64 batch row of each logits row
    row_node: torch.Tensor  # [L] int64 node of each logits row (0 = root)
    root_rows: torch.Tensor  # [R] int64 token row of each request's root
    row_starts: torch.Tensor  # [R] int64 first logits row of each request
    has_tree: torch.Tensor  # [R] bool: verifies its tree
    refused_fresh: torch.Tensor  # [R] bool: fed drafts of a fresh tree that differ from it (a bug; see checks)
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
        self.refused_fresh = torch.zeros(max_reqs, dtype=torch.int8, device=device)


# ---------------------------------------------------------------------------------------------- torch building blocks
def gather_trees(source: TreeBatch, index: torch.Tensor, out: TreeBatch) -> None:
    """``out[r] = source[index[r]]`` for r < len(index), every field but ``num_nodes`` (set by the caller)."""
    num_reqs = index.shape[0]
    index = index.to(torch.int64)
    for name in TREE_FIELDS:
        torch.index_select(getattr(source, name), 0, index, out=getattr(out, name)[:num_reqs])


def depth_position_shift(
    trees: TreeBatch, row_request: torch.Tensor, row_node: torch.Tensor, row_has_tree: torch.Tensor
) -> torch.Tensor:
    """Per logits row, ``depth(node) - node`` for rows of requests that verify a tree, else 0 (int64).

    ``row_request`` indexes ``trees`` rows; nodes past a tree's end (depth -1) keep their chain position."""
    depth = trees.depths[row_request, row_node].to(torch.int64)
    return torch.where(row_has_tree & (depth >= 0), depth - row_node.to(torch.int64), 0)


def chain_order(accepted: torch.Tensor, root_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Row permutation [num_rows] putting each accepted path right after its root: ``order[root + k] = root + acc[k]``
    for every accepted k (``accepted [R, L+1]``, -1 padded), identity elsewhere. ``root_rows [R]`` is on the device."""
    acc = accepted.to(torch.int64)
    device = acc.device
    root = root_rows.to(torch.int64)[:, None]
    k = torch.arange(acc.shape[1], device=device)[None, :]
    dest = torch.where(acc >= 0, root + k, num_rows)  # invalid entries land in a spill slot
    order = torch.arange(num_rows + 1, device=device)
    order.scatter_(0, dest.reshape(-1), torch.where(acc >= 0, root + acc, num_rows).reshape(-1))
    return order[:num_rows]


# ---------------------------------------------------------------------------------------------- prepare
# One compiled variant whatever the batch size or step kind (no JIT mid-serving): ints equal to 1 would specialise.
@triton.jit(do_not_specialize=["num_reqs", "chain_step"])
def _prepare_rows_kernel(
    slots_ptr, cu_ptr, logits_idx_ptr, input_ids_ptr, positions_ptr, mrope_ptr, stride_mrope,
    src_tok_ptr, src_par_ptr, src_dep_ptr, src_bits_ptr, src_nn_ptr, stamp_ptr, epoch_ptr, chains_ptr,
    dst_tok_ptr, dst_par_ptr, dst_dep_ptr, dst_bits_ptr, dst_nn_ptr,
    tree_rows_ptr, has_tree_ptr, refused_ptr, root_rows_ptr, row_starts_ptr, shift_ptr, row_req_ptr, row_node_ptr,
    num_reqs, chain_step,
    N: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr, D: tl.constexpr,
    HAS_MROPE: tl.constexpr,
):
    """Program r: request r of the batch (r >= num_reqs: only tree_rows[r] = -1). Lane j: node j of its tree,
    which is also its j-th logits row while j < its row count. ``chain_step`` != 0: verify the chains
    (``chains_ptr [slots, D]``) instead of the trees."""
    r = tl.program_id(0)
    live = r < num_reqs
    j = tl.arange(0, BLOCK_N)
    in_tree = (j < N) & live
    slot = tl.load(slots_ptr + r, mask=live, other=0).to(tl.int64)
    start = tl.load(cu_ptr + r, mask=live, other=0)
    n_rows = tl.load(cu_ptr + r + 1, mask=live, other=0) - start  # root + drafts fed
    fed_lane = (j < n_rows) & live
    has_drafts = (n_rows > 1) & live

    # The guard: a fresh tree (filed by the latest draft step), every fed row its token, none past its end.
    fresh = tl.load(stamp_ptr + slot, mask=live, other=-1) == tl.load(epoch_ptr)
    tok = tl.load(src_tok_ptr + slot * N + j, mask=in_tree, other=0)
    row = tl.load(logits_idx_ptr + start + j, mask=fed_lane, other=0).to(tl.int64)
    fed = tl.load(input_ids_ptr + row, mask=fed_lane, other=0).to(tl.int64)
    num_nodes = tl.load(src_nn_ptr + slot, mask=live, other=0)
    row_ok = (fed == tok) & (j <= num_nodes)
    all_ok = tl.min(tl.where(fed_lane, row_ok.to(tl.int32), 1), axis=0) > 0
    has_tree = fresh & all_ok & has_drafts
    tl.store(refused_ptr + r, (fresh & has_drafts & ~all_ok).to(tl.int8), mask=live)
    tl.store(stamp_ptr + slot, -1, mask=has_drafts)  # consumed: never verified twice

    # The tree (or, on a chain step, the chain: node i has parent i - 1 and depth i) into batch row r; refused
    # requests too (num_nodes 0 makes the walk ignore them).
    chain = chain_step != 0
    in_chain = (j < n_rows) & (j <= D)
    chain_tok = tl.load(chains_ptr + slot * D + j - 1, mask=in_tree & in_chain & (j >= 1) & chain, other=0)
    node_tok = tl.where(chain, tl.where(j == 0, tok, tl.where(in_chain, chain_tok, 0)), tok)
    parent = tl.load(src_par_ptr + slot * N + j, mask=in_tree, other=-1)
    parent = tl.where(chain, tl.where(in_chain, j - 1, -1), parent)
    depth = tl.load(src_dep_ptr + slot * N + j, mask=in_tree, other=-1)
    depth = tl.where(chain, tl.where(in_chain, j, -1), depth)
    tl.store(dst_tok_ptr + r * N + j, node_tok, mask=in_tree)
    tl.store(dst_par_ptr + r * N + j, parent, mask=in_tree)
    tl.store(dst_dep_ptr + r * N + j, depth, mask=in_tree)
    w = tl.arange(0, BLOCK_W)
    bits_at = j[:, None] * W + w[None, :]
    bits_mask = in_tree[:, None] & (w[None, :] < W)
    bits = tl.load(src_bits_ptr + slot * (N * W) + bits_at, mask=bits_mask, other=0)
    # A chain node's ancestors are nodes 0..j: the low min(32, j + 1 - 32 w) bits of word w (int64, then int32).
    ones = tl.minimum(tl.maximum(j[:, None] + 1 - 32 * w[None, :], 0), 32).to(tl.int64)
    chain_bits = tl.where(ones >= 32, -1, ((ones * 0 + 1) << ones) - 1)
    chain_bits = tl.where(in_chain[:, None], chain_bits, 0).to(tl.int32)
    bits = tl.where(chain, chain_bits, bits)
    tl.store(dst_bits_ptr + r * (N * W) + bits_at, bits, mask=bits_mask)
    tl.store(dst_nn_ptr + r, tl.where(has_tree, n_rows - 1, 0), mask=live)
    tl.store(tree_rows_ptr + r, tl.where(has_tree & ~chain, r, -1))  # a chain is causal: vLLM's attention
    tl.store(has_tree_ptr + r, has_tree.to(tl.int8), mask=live)
    # A chain step feeds its chain: the verified drafts over the tree's, which the runner fed.
    tl.store(input_ids_ptr + row, node_tok.to(input_ids_ptr.dtype.element_ty),
             mask=fed_lane & in_chain & (j >= 1) & has_tree & chain)

    # Depth positions (nodes past a tree's end, depth -1, keep their chain position) and the row layout.
    shift = tl.where(has_tree & (depth >= 0), depth - j, 0).to(tl.int64)
    moved = fed_lane & has_tree
    position = tl.load(positions_ptr + row, mask=fed_lane, other=0)
    tl.store(positions_ptr + row, position + shift, mask=moved)
    if HAS_MROPE:
        for axis in tl.static_range(3):
            at = mrope_ptr + axis * stride_mrope + row
            tl.store(at, tl.load(at, mask=moved, other=0) + shift, mask=moved)
    tl.store(shift_ptr + start + j, shift, mask=fed_lane)
    tl.store(row_req_ptr + start + j, (j * 0 + r).to(tl.int64), mask=fed_lane)
    tl.store(row_node_ptr + start + j, j.to(tl.int64), mask=fed_lane)
    tl.store(root_rows_ptr + r, tl.sum(tl.where(j == 0, row, 0), axis=0), mask=live)
    tl.store(row_starts_ptr + r, start.to(tl.int64), mask=live)


def prepare_rows_triton(
    rows: RowInputs, source: TreeBatch, stamp: torch.Tensor, epoch: torch.Tensor, verify: TreeBatch,
    tree_rows: torch.Tensor, out: RowBuffers, chains: torch.Tensor | None = None, chain_step: bool = False,
) -> PreparedRows:
    """The Triton path: one launch over ``tree_rows``'s length (rows past the batch get -1 there). ``chains``
    ([slots, depth], the hand-over's, whenever the chain fallback is on: one compiled variant for both kinds of
    step); ``chain_step``: verify them (module docstring)."""
    num_reqs, num_logits = rows.num_reqs, rows.logits_indices.shape[0]
    for tree in (source, verify):
        assert all(getattr(tree, name).is_contiguous() for name in TREE_FIELDS)
    n = source.token_ids.shape[1]
    words = source.ancestor_bits.shape[2]
    block_nodes = triton.next_power_of_2(n)
    mrope = rows.mrope_positions
    assert chains is not None or not chain_step, "a chain step needs the chains"
    _prepare_rows_kernel[(tree_rows.shape[0],)](
        rows.slots, rows.cu_num_logits, rows.logits_indices, rows.input_ids, rows.positions,
        mrope if mrope is not None else rows.positions, mrope.stride(0) if mrope is not None else 0,
        source.token_ids, source.parents, source.depths, source.ancestor_bits, source.num_nodes, stamp, epoch,
        chains if chains is not None else source.token_ids,
        verify.token_ids, verify.parents, verify.depths, verify.ancestor_bits, verify.num_nodes,
        tree_rows, out.has_tree, out.refused_fresh, out.root_rows, out.row_starts, out.shift, out.row_request,
        out.row_node, num_reqs, int(chain_step),
        N=n, BLOCK_N=block_nodes, W=words, BLOCK_W=triton.next_power_of_2(words),
        D=chains.shape[1] if chains is not None else 1, HAS_MROPE=mrope is not None,
    )
    return PreparedRows(
        shift=out.shift[:num_logits],
        row_request=out.row_request[:num_logits],
        row_node=out.row_node[:num_logits],
        root_rows=out.root_rows[:num_reqs],
        row_starts=out.row_starts[:num_reqs],
        has_tree=out.has_tree[:num_reqs].view(torch.bool),
        refused_fresh=out.refused_fresh[:num_reqs].view(torch.bool),
        block_nodes=block_nodes,
    )


def prepare_rows_torch(
    rows: RowInputs, source: TreeBatch, stamp: torch.Tensor, epoch: torch.Tensor, verify: TreeBatch,
    tree_rows: torch.Tensor, out: RowBuffers | None = None, chains: torch.Tensor | None = None,
    chain_step: bool = False,
) -> PreparedRows:
    """The plain-PyTorch reference (fresh output tensors; ``out`` is ignored)."""
    device = tree_rows.device
    num_reqs = rows.num_reqs
    index = rows.logits_indices.to(torch.int64)
    num_logits = index.shape[0]
    cu = rows.cu_num_logits[: num_reqs + 1].to(torch.int64)
    num_drafts = cu[1:] - cu[:-1] - 1
    row_request = torch.searchsorted(cu[1:], torch.arange(num_logits, device=device), right=True)
    row_starts = cu[:-1]
    node = torch.arange(num_logits, device=device) - row_starts[row_request]
    slots = rows.slots[:num_reqs].to(torch.int64)
    row_slot = slots[row_request]

    fed = rows.input_ids[index].to(torch.int64)
    row_ok = (fed == source.token_ids[row_slot, node]) & (node <= source.num_nodes[row_slot].to(torch.int64))
    all_ok = torch.ones(num_reqs, dtype=torch.int32, device=device)
    all_ok.scatter_reduce_(0, row_request, row_ok.to(torch.int32), reduce="amin")
    fresh = stamp[slots] == epoch
    has_drafts = num_drafts > 0
    has_tree = fresh & (all_ok > 0) & has_drafts
    refused_fresh = fresh & has_drafts & (all_ok == 0)
    stamp[slots] = torch.where(has_drafts, -1, stamp[slots])  # consumed (no boolean indexing: no host sync)

    gather_trees(source, slots, verify)
    verify.num_nodes[:num_reqs] = torch.where(has_tree, num_drafts, 0).to(verify.num_nodes.dtype)
    tree_rows.fill_(-1)
    if chain_step:
        fill_chains(chains[slots], num_drafts, verify)
        fed_drafts = has_tree[row_request] & (node >= 1) & (node <= chains.shape[1])
        rows.input_ids[index] = torch.where(fed_drafts, verify.token_ids[row_request, node],
                                            rows.input_ids[index].to(torch.int64)).to(rows.input_ids.dtype)
    else:
        tree_rows[:num_reqs] = torch.where(has_tree, torch.arange(num_reqs, dtype=torch.int32, device=device), -1)

    shift = depth_position_shift(verify, row_request, node, has_tree[row_request])
    rows.positions[index] += shift
    if rows.mrope_positions is not None:
        rows.mrope_positions[:, index] += shift
    return PreparedRows(
        shift=shift, row_request=row_request, row_node=node, root_rows=index[row_starts], row_starts=row_starts,
        has_tree=has_tree, refused_fresh=refused_fresh, block_nodes=triton.next_power_of_2(source.token_ids.shape[1]),
    )


# ---------------------------------------------------------------------------------------------- linearise
@triton.jit
def _linearise_rows_kernel(
    cu_ptr, logits_idx_ptr, shift_ptr, positions_ptr, mrope_ptr, stride_mrope, acc_ptr, root_rows_ptr, order_ptr,
    stride_acc, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr, WALKED: tl.constexpr, HAS_MROPE: tl.constexpr,
):
    """Program r: request r's logits rows get their linear positions back; once walked, its accepted path's rows
    land right after its root in ``order`` (which holds the identity before the launch)."""
    r = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    start = tl.load(cu_ptr + r)
    fed = j < tl.load(cu_ptr + r + 1) - start
    row = tl.load(logits_idx_ptr + start + j, mask=fed, other=0).to(tl.int64)
    shift = tl.load(shift_ptr + start + j, mask=fed, other=0)
    moved = fed & (shift != 0)
    position = tl.load(positions_ptr + row, mask=fed, other=0)
    tl.store(positions_ptr + row, position - shift, mask=moved)
    if HAS_MROPE:
        for axis in tl.static_range(3):
            at = mrope_ptr + axis * stride_mrope + row
            tl.store(at, tl.load(at, mask=moved, other=0) - shift, mask=moved)
    if WALKED:
        accepted = tl.load(acc_ptr + r * stride_acc + j, mask=j < WIDTH, other=-1).to(tl.int64)
        root = tl.load(root_rows_ptr + r)
        tl.store(order_ptr + root + j, root + accepted, mask=(j < WIDTH) & (accepted >= 0))


def linearise_rows_triton(
    rows: RowInputs, prepared: PreparedRows, accepted: torch.Tensor | None, identity: torch.Tensor
) -> torch.Tensor | None:
    """Undo the depth positions; with ``accepted`` ([R, L+1] node ids, -1 padded, L+1 <= B+1) return the chain
    order of the step's ``num_tokens`` rows. ``identity``: ``arange`` of at least ``num_tokens``."""
    order = identity[: rows.num_tokens].clone() if accepted is not None else None
    width = accepted.shape[1] if accepted is not None else 1
    mrope = rows.mrope_positions
    _linearise_rows_kernel[(rows.num_reqs,)](
        rows.cu_num_logits, rows.logits_indices, prepared.shift, rows.positions,
        mrope if mrope is not None else rows.positions, mrope.stride(0) if mrope is not None else 0,
        accepted if accepted is not None else prepared.shift, prepared.root_rows,
        order if order is not None else identity, accepted.stride(0) if accepted is not None else 0,
        WIDTH=width, BLOCK_N=prepared.block_nodes, WALKED=accepted is not None, HAS_MROPE=mrope is not None,
    )
    return order


def linearise_rows_torch(
    rows: RowInputs, prepared: PreparedRows, accepted: torch.Tensor | None, identity: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The plain-PyTorch reference."""
    index = rows.logits_indices.to(torch.int64)
    rows.positions[index] -= prepared.shift
    if rows.mrope_positions is not None:
        rows.mrope_positions[:, index] -= prepared.shift
    if accepted is None:
        return None
    return chain_order(accepted, prepared.root_rows, rows.num_tokens)
