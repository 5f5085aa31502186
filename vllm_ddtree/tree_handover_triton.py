"""``TreeHandover.file`` in one Triton launch: one program per drafted row copies its tree (and chain) to its slot.

The torch version (``file_trees_torch``, the reference the tests hold this to and the CPU engine's path) is an index
copy per tree field, the chains' and the stamps': about nine launches and as many host dispatches a decode step,
which the small SmolLM2 pair, host-bound on an H100 (2026-12-06), showed as 4.4% of a step's host samples.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_ddtree.tree.layout import TreeBatch


@triton.jit
def _file_trees_kernel(
    slots_ptr, epoch_ptr, stamp_ptr,
    src_tok_ptr, dst_tok_ptr, src_par_ptr, dst_par_ptr, src_dep_ptr, dst_dep_ptr, src_bits_ptr, dst_bits_ptr,
    src_nodes_ptr, dst_nodes_ptr, src_chain_ptr, dst_chain_ptr,
    NODES: tl.constexpr, NODE_PAD: tl.constexpr, BITS: tl.constexpr, BIT_PAD: tl.constexpr,
    DEPTH: tl.constexpr, DEPTH_PAD: tl.constexpr,
):
    # Contiguous rows on both sides (TreeBatch.allocate, the hand-over's chains): row r of the source, row slot of
    # the destination.
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    node = tl.arange(0, NODE_PAD)
    in_row = node < NODES
    tl.store(dst_tok_ptr + slot * NODES + node, tl.load(src_tok_ptr + r * NODES + node, mask=in_row), mask=in_row)
    tl.store(dst_par_ptr + slot * NODES + node, tl.load(src_par_ptr + r * NODES + node, mask=in_row), mask=in_row)
    tl.store(dst_dep_ptr + slot * NODES + node, tl.load(src_dep_ptr + r * NODES + node, mask=in_row), mask=in_row)
    word = tl.arange(0, BIT_PAD)
    in_bits = word < BITS
    tl.store(dst_bits_ptr + slot * BITS + word, tl.load(src_bits_ptr + r * BITS + word, mask=in_bits), mask=in_bits)
    tl.store(dst_nodes_ptr + slot, tl.load(src_nodes_ptr + r))
    if DEPTH > 0:
        d = tl.arange(0, DEPTH_PAD)
        in_chain = d < DEPTH
        tl.store(dst_chain_ptr + slot * DEPTH + d, tl.load(src_chain_ptr + r * DEPTH + d, mask=in_chain),
                 mask=in_chain)
    tl.store(stamp_ptr + slot, tl.load(epoch_ptr))


def file_trees_triton(slots: torch.Tensor, batch_trees: TreeBatch, num_reqs: int, trees: TreeBatch,
                      chains: torch.Tensor | None, batch_chains: torch.Tensor | None, stamp: torch.Tensor,
                      epoch: torch.Tensor) -> None:
    """``trees[slots[r]] = batch_trees[r]``, ``chains[slots[r]] = batch_chains[r]`` (with chains) and
    ``stamp[slots[r]] = epoch`` for ``r < num_reqs``, as ``file_trees_torch``; slots of any integer dtype."""
    if num_reqs == 0:
        return
    nodes = trees.token_ids.shape[1]
    bits = nodes * trees.ancestor_bits.shape[2]
    depth = chains.shape[1] if chains is not None else 0
    for src, dst in ((batch_trees.token_ids, trees.token_ids), (batch_trees.parents, trees.parents),
                     (batch_trees.depths, trees.depths), (batch_trees.ancestor_bits, trees.ancestor_bits),
                     (batch_chains, chains)):
        assert src is None or (src.is_contiguous() and dst.is_contiguous() and src.shape[1:] == dst.shape[1:]), \
            "the hand-over's rows are contiguous and shaped alike"
    _file_trees_kernel[(num_reqs,)](
        slots, epoch, stamp,
        batch_trees.token_ids, trees.token_ids, batch_trees.parents, trees.parents, batch_trees.depths, trees.depths,
        batch_trees.ancestor_bits, trees.ancestor_bits, batch_trees.num_nodes, trees.num_nodes,
        batch_chains if depth else stamp, chains if depth else stamp,
        NODES=nodes, NODE_PAD=triton.next_power_of_2(nodes), BITS=bits, BIT_PAD=triton.next_power_of_2(bits),
        DEPTH=depth, DEPTH_PAD=triton.next_power_of_2(max(depth, 1)),
    )
