"""The tree build's beam and merge (``build.build_tree_from_topk``) as one Triton launch: one program per request.

The PyTorch build runs a gather, an add and a stable sort per depth, then a merge and the ancestor bits: about a
hundred small kernels per step (0.6 ms on an H200 at B = 64, twice the DFlash forward on the SmolLM2 pair). This
kernel computes the same trees, bit for bit, ties included (tests/unit/test_tree_build.py holds both builds to the
heap reference; ``bench_tree_core.py build_triton`` checks it on the GPU). Its ranking is quadratic in a depth's
candidates, so the default takes it for small budgets only (build.py ``TRITON_BEAM_MAX_BUDGET``).

How it matches:

- scores are the same float32 sums (parent's score + the candidate's log-prob, one rounding per depth);
- build.py's stable descending sorts order by (score, -position); here that pair is one int64 key (the float's
  bits mapped to an order-preserving int32 above, 2^32 - 1 - position below), distinct per entry, and an entry's
  place in the order is the number of larger keys (``_ranks``). Positions are the candidate's place in build.py's
  (parent position, rank) layout and, in the merge, the member's place in (depth, beam position) order, so equal
  scores keep the order build.py's stable sorts keep;
- an entry ranked r < n lands in slot r of the beam (or becomes node r + 1 in the merge), no sort needed.

Per-program state between depths (the beam's scores and candidates, the keys being ranked, the merge's node numbers)
goes through a small global workspace with a barrier after each write, since a program's threads read each other's
entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW_WORD = tl.constexpr(4294967295)  # 2^32 - 1
_EMPTY_KEY = tl.constexpr(-9223372036854775808)  # below every real key (the lowest real one is -inf's)


@triton.jit
def _descending_key(score, position):
    """int64 key: larger for a higher score; on an exact tie, larger for the earlier position."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | -(position.to(tl.int64) - _LOW_WORD)


@triton.jit
def _ranks(key, key_ws, PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Each entry's place in descending key order: how many keys are larger (real keys are distinct; padding shares
    the lowest key and the caller masks it). A comparison count, not a sort: a few vector compares per chunk, where
    tl.sort's bitonic network takes seconds per call to interpret in tests."""
    offs = tl.arange(0, PAD)
    tl.store(key_ws + offs, key)
    tl.debug_barrier()
    rank = tl.zeros([PAD], dtype=tl.int32)
    for j in range(0, PAD, CHUNK):
        other = tl.load(key_ws + j + tl.arange(0, CHUNK))
        rank += tl.sum((other[None, :] > key[:, None]).to(tl.int32), axis=1)
    tl.debug_barrier()  # (the next call's store must not overtake these loads)
    return rank


@triton.jit
def _beam_build_kernel(
    logp_ptr, ids_ptr, roots_ptr, depth_table_ptr,
    cand_logp_index_ptr, cand_parent_member_ptr, cand_depth_ptr,
    score_ws_ptr, cand_ws_ptr, node_ws_ptr, key_ws_ptr,
    tok_ptr, par_ptr, dep_ptr, bits_ptr, num_nodes_ptr,
    stride_tok, stride_par, stride_dep, stride_bits0, stride_bits1,
    LK: tl.constexpr, DEPTH: tl.constexpr, NUM_MEMBERS: tl.constexpr, NUM_NODES: tl.constexpr,
    OUT_BUDGET: tl.constexpr, WORDS: tl.constexpr, MAX_DEPTH: tl.constexpr,
    CAND_PAD: tl.constexpr, MEMBER_PAD: tl.constexpr, NODE_PAD: tl.constexpr, WORD_PAD: tl.constexpr,
    CAND_CHUNK: tl.constexpr, MEMBER_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logp = logp_ptr + row * LK
    scores = score_ws_ptr + row * MEMBER_PAD  # member (0-based, (depth, beam position) order) -> score
    cands = cand_ws_ptr + row * MEMBER_PAD  # member -> flat candidate index (build._BuildPlan's table)
    node_of = node_ws_ptr + row * MEMBER_PAD  # 1 + member -> tree node (0: the root)
    key_ws = key_ws_ptr + row * MEMBER_PAD  # the keys being ranked

    # Depth 1: candidate r is (root, rank r), already in score order (per_depth_topk sorts each depth).
    offs_c = tl.arange(0, CAND_PAD)
    first = offs_c < tl.load(depth_table_ptr + 3 * DEPTH)
    tl.store(scores + offs_c, tl.load(logp + offs_c, mask=first), mask=first)
    tl.store(cands + offs_c, offs_c, mask=first)
    tl.debug_barrier()
    for d in range(1, DEPTH):
        start = tl.load(depth_table_ptr + d)
        valid = offs_c < tl.load(depth_table_ptr + DEPTH + d)
        base = tl.load(depth_table_ptr + 2 * DEPTH + d)
        cand = start + offs_c
        parent = tl.load(cand_parent_member_ptr + cand, mask=valid, other=1) - 1
        step = tl.load(logp + tl.load(cand_logp_index_ptr + cand, mask=valid, other=0), mask=valid, other=0.0)
        score = tl.load(scores + parent, mask=valid, other=0.0) + step
        rank = _ranks(tl.where(valid, _descending_key(score, offs_c), _EMPTY_KEY), key_ws, CAND_PAD, CAND_CHUNK)
        beam = valid & (rank < tl.load(depth_table_ptr + 3 * DEPTH + d))
        tl.store(scores + base + rank, score, mask=beam)
        tl.store(cands + base + rank, cand, mask=beam)
        tl.debug_barrier()

    # Merge: the best NUM_NODES members over all depths; a member's rank is its node number - 1 (pop order).
    offs_m = tl.arange(0, MEMBER_PAD)
    member_valid = offs_m < NUM_MEMBERS
    key = _descending_key(tl.load(scores + offs_m, mask=member_valid, other=0.0), offs_m)
    rank = _ranks(tl.where(member_valid, key, _EMPTY_KEY), key_ws, MEMBER_PAD, MEMBER_CHUNK)
    picked = member_valid & (rank < NUM_NODES)
    node = 1 + rank
    tl.store(node_of + 1 + offs_m, tl.where(picked, node, 0), mask=member_valid)
    tl.store(node_of, 0)
    tl.debug_barrier()
    cand = tl.load(cands + offs_m, mask=picked, other=0)
    parent = tl.load(node_of + tl.load(cand_parent_member_ptr + cand, mask=picked, other=0), mask=picked, other=0)
    token = tl.load(ids_ptr + row * LK + tl.load(cand_logp_index_ptr + cand, mask=picked, other=0), mask=picked)
    tl.store(tok_ptr + row * stride_tok + node, token, mask=picked)
    tl.store(par_ptr + row * stride_par + node, parent, mask=picked)
    tl.store(dep_ptr + row * stride_dep + node, tl.load(cand_depth_ptr + cand, mask=picked, other=0), mask=picked)

    # The root and the padding past the tree (token 0, parent -1, depth -1).
    offs_n = tl.arange(0, NODE_PAD)
    is_root = offs_n == 0
    padding = (offs_n > NUM_NODES) & (offs_n <= OUT_BUDGET)
    outside = is_root | padding
    root_token = tl.load(roots_ptr + row).to(tl.int64)
    tl.store(tok_ptr + row * stride_tok + offs_n, tl.where(is_root, root_token, 0), mask=outside)
    tl.store(par_ptr + row * stride_par + offs_n, tl.full([NODE_PAD], -1, tl.int32), mask=outside)
    tl.store(dep_ptr + row * stride_dep + offs_n, tl.where(is_root, 0, -1).to(tl.int32), mask=outside)
    tl.store(num_nodes_ptr + row, NUM_NODES)
    tl.debug_barrier()

    # Ancestor-or-self bits: each node walks up to the root (at most MAX_DEPTH steps); padding rows stay 0.
    offs_w = tl.arange(0, WORD_PAD)
    at = offs_n
    live = offs_n <= NUM_NODES
    bits = tl.zeros([NODE_PAD, WORD_PAD], dtype=tl.int32)
    for _ in range(MAX_DEPTH + 1):
        hit = (offs_w[None, :] == (at // 32)[:, None]) & live[:, None]
        bits = bits | tl.where(hit, (1 << (at % 32))[:, None], 0)
        up = tl.load(par_ptr + row * stride_par + at, mask=live, other=-1)
        live = live & (up >= 0)
        at = tl.where(live, up, 0)
    tl.store(bits_ptr + row * stride_bits0 + offs_n[:, None] * stride_bits1 + offs_w[None, :], bits,
             mask=(offs_n <= OUT_BUDGET)[:, None] & (offs_w < WORDS)[None, :])


_CHUNK = 16  # keys compared per step of a ranking (at most the padded length: every loaded key is live)
_DEPTH_TABLES: dict[tuple, torch.Tensor] = {}
_WORKSPACES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def build_tree_triton(plan, top_logp: torch.Tensor, top_ids: torch.Tensor, out, root_token_ids: torch.Tensor) -> None:
    """``build.build_tree_from_topk``'s beam and merge for ``plan`` (build._BuildPlan), written into ``out[:R]``.

    The depth table and the workspace are allocated on first use per shape and reused, so a captured graph keeps
    valid addresses (call once before capture, as the drafter's warm-up does)."""
    rows, depth, k = top_logp.shape
    device = top_logp.device
    num_members = sum(plan.beam_sizes)
    counts = [plan.beam_sizes[0]] + [p.numel() for p in plan.cand_parent_pos]
    key = (plan.beam_sizes, tuple(plan.cand_starts), k, str(device))
    table = _DEPTH_TABLES.get(key)
    if table is None:
        bases = [sum(plan.beam_sizes[:d]) for d in range(depth)]
        table = torch.tensor([*plan.cand_starts, *counts, *bases, *plan.beam_sizes], dtype=torch.int32,
                             device=device)
        _DEPTH_TABLES[key] = table
    cand_pad = triton.next_power_of_2(max(counts))
    member_pad = max(triton.next_power_of_2(num_members + 1), cand_pad)
    ws_key = (out.token_ids.shape[0], member_pad, str(device))
    workspace = _WORKSPACES.get(ws_key)
    if workspace is None:
        shape = (out.token_ids.shape[0], member_pad)
        workspace = (torch.empty(shape, dtype=torch.float32, device=device),
                     torch.empty(shape, dtype=torch.int32, device=device),
                     torch.empty(shape, dtype=torch.int32, device=device),
                     torch.empty(shape, dtype=torch.int64, device=device))
        _WORKSPACES[ws_key] = workspace
    words = out.ancestor_bits.shape[-1]
    _beam_build_kernel[(rows,)](
        top_logp.contiguous(), top_ids.contiguous(), root_token_ids, table,
        plan.cand_logp_index, plan.cand_parent_member, plan.cand_depth,
        *workspace,
        out.token_ids, out.parents, out.depths, out.ancestor_bits, out.num_nodes,
        out.token_ids.stride(0), out.parents.stride(0), out.depths.stride(0),
        out.ancestor_bits.stride(0), out.ancestor_bits.stride(1),
        LK=depth * k, DEPTH=depth, NUM_MEMBERS=num_members, NUM_NODES=plan.num_nodes, OUT_BUDGET=out.budget,
        WORDS=words, MAX_DEPTH=min(depth, plan.num_nodes),
        CAND_PAD=cand_pad, MEMBER_PAD=member_pad,
        NODE_PAD=triton.next_power_of_2(out.budget + 1), WORD_PAD=triton.next_power_of_2(words),
        CAND_CHUNK=min(_CHUNK, cand_pad), MEMBER_CHUNK=min(_CHUNK, member_pad),
    )
