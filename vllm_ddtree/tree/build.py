"""Device-side DDTree tree build: the authors' best-first heap (docs/algorithm.md §2.2) as static-shape tensor ops.

The heap pops the B best prefixes under a total order; this module computes the same B prefixes, in the same
order, with one width-B beam step per depth (<= L static iterations) and one final merge, so the whole build is
a fixed sequence of gathers and sorts that a CUDA graph can capture. ``tree/reference.py`` holds the heap it
must equal.

Scores. Per depth d, ``lp[d, r]`` is the r-th best float32 log-probability (``per_depth_topk``); a prefix with
ranks (r_1..r_d) has ``score = fl32(...fl32(fl32(lp[1, r_1]) + lp[2, r_2]) ... + lp[d, r_d])``, i.e. the parent's
score plus one term, rounded to float32. (The authors accumulate in Python floats and derive a sibling's score
as ``logw - lp[r] + lp[r+1]``; that is the same number up to rounding, but makes a score depend on the push
path. Ours is a function of the prefix alone, which is what lets a parallel build match bit for bit.)

Total order (the tie-break). Prefixes are ranked by ``key(u) = (-score(u), depth(u), key(parent(u)), rank(u))``
compared lexicographically (key(root) = ()). So: higher score first; on an exact score tie, shallower first; at
equal depth, the child of the earlier parent first; among siblings, the lower top-k rank first. Token ties
inside one depth's top-k are ordered by token id (``per_depth_topk``). The authors break ties on the rank tuple
alone; ours differs only on exact float ties and is chosen because it survives float rounding (see below).

Why a width-B beam is exact. Let T_d be the B smallest keys among depth-d prefixes. If u = p+r is in T_d then p
is in T_{d-1}: otherwise B depth-(d-1) prefixes p' precede p, each has score >= score(p), and each child p'+0
has score fl(s(p') + lp[0]) >= fl(s(p) + lp[r]) = score(u) (rounding is monotone); on equality the tie-break
compares the parents, and p' precedes p. So B prefixes precede u, a contradiction. Hence T_d = the best B of
(T_{d-1} x ranks), and the global best B (what the heap pops: every prefix's heap "generator", its parent or
its previous sibling, precedes it in the order) is the best B of the union of T_1..T_L. Candidate (p, r) (parent
at beam position p) is preceded by every (p', r') with p' <= p, r' <= r, so only pairs with (p+1)(r+1) <= B can
make the beam: about B ln B candidates per depth, a static set. Beam sizes min(B, K^d) and the node count
min(B, sum_d min(B, K^d)) are static too, so no shape depends on data.

Stable sorts give the order for free: candidates are laid out in (parent position, rank) order and the final
merge in (depth, beam position) order, and a stable descending sort on score keeps that order among ties.

Output (TreeBatch, see layout.py): nodes 1..N in pop order, N = min(B, sum_d min(B, K^d)) for every row; columns
N+1..out.budget are padding (token 0, parent -1, depth -1, ancestor bits all zero). Rows beyond the live batch
are not touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_ddtree.tree.layout import BITS_PER_WORD, TreeBatch, num_ancestor_words
from vllm_ddtree.tree.logsumexp import row_logsumexp


def per_depth_topk(draft_logits: torch.Tensor, k: int, method: str | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k float32 log-probs per depth, best first, equal values ordered by token id (deterministic ranks).

    draft_logits [R, L, V] (any float dtype) -> (top_logp [R, L, k] float32, top_ids [R, L, k] int64).
    The top k are taken on the logits as they come (a row's log-softmax is the row shifted by its log-sum-exp:
    the same order and ties, in half the bytes for bf16), and only those k are normalised (logsumexp.py): no
    float32 log-softmax of the whole vocabulary first. On an H200 (Qwen3-8B's vocabulary, bf16, 15 depths, CUDA
    graphs, bench_tree_core.py build_topk against build_topk_log_softmax, one call) that took this step from 146 /
    550 / 1472 / 2706 us to 134 / 321 / 753 / 1309 at batch 1 / 8 / 32 / 64. Which of several tokens tied at the
    k-th value gets in is torch.topk's choice; the order inside the k is ours. ``method`` (one of ``TOPK_METHODS``;
    by default ``topk_method``'s): "torch" as above, "chunks" or "threshold" the same in Triton (topk_triton.py;
    ties at the k-th: the lowest ids).
    """
    method = method or topk_method(draft_logits, k)
    if method == "chunks":
        from vllm_ddtree.tree.topk_triton import per_depth_topk_triton

        return per_depth_topk_triton(draft_logits, k)
    if method == "threshold":
        from vllm_ddtree.tree.topk_triton import per_depth_topk_threshold

        return per_depth_topk_threshold(draft_logits, k)
    if method != "torch":
        raise ValueError(f"top-k method {method!r}: expected one of {TOPK_METHODS}")
    values, ids = torch.topk(draft_logits, k, dim=-1, sorted=True)
    return order_topk(values.float() - row_logsumexp(draft_logits).unsqueeze(-1), ids)


TOPK_METHODS = ("torch", "chunks", "threshold")

# Which top-k by default. On an H200 (Qwen3-8B's vocabulary, 15 depths, bf16, CUDA graphs, bench_tree_core.py
# build_topk*, 2026-12-03; device us per step at batch 1 / 8 / 32 / 64 for k = 16 .. 64): torch's path 92-103 /
# 255-275 / 694-746 / 1231-1321, whatever k; "chunks" 38-197 / 204-900 / 782-3228 / 1550-6498, growing with k;
# "threshold" 20-23 / 54-72 / 178-254 / 344-492 on random logits. With a run of 1536 favoured consecutive ids
# (--logits clustered: its candidate buffer overflows and is cut again) "threshold" took 197 / 255-269 / 504-577 /
# 983-1129: twice torch's at batch 1, about torch's or less from batch 8. So "threshold" on CUDA wherever the
# vocabulary is long enough for it (at least 16 tokens per chunk, k chunks), else torch's.


def topk_method(draft_logits: torch.Tensor, k: int) -> str:
    """The ``per_depth_topk`` method by default here: "threshold" on CUDA where the vocabulary allows, else "torch"."""
    if not draft_logits.is_cuda:
        return "torch"
    from vllm_ddtree.tree.topk_triton import threshold_chunk_size

    return "threshold" if threshold_chunk_size(draft_logits.shape[-1], k) else "torch"


def order_topk(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (float32 log-probs, token ids) in the build's rank order: descending value, equal values by token id."""
    values = values + 0.0  # -0.0 -> +0.0, so radix sorts on the device see one zero
    ids, by_id = torch.sort(ids, dim=-1)
    values = torch.gather(values, -1, by_id)
    values, by_value = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, torch.gather(ids, -1, by_value)


@dataclass(frozen=True)
class _BuildPlan:
    """Static index tensors for one (budget, top-k, depth, device): built once, then reused (graph-safe).

    Candidates of all depths live in one flat table (depth 1's are (root, rank r) for r < n_1); a beam member
    is named by its flat candidate index, so tokens, parents and depths are gathered once, after the loop.
    """

    beam_sizes: tuple[int, ...]  # n_d = min(B, K^d), d = 1..L
    cand_starts: tuple[int, ...]  # where depth d's candidates start in the flat table
    cand_parent_pos: tuple[torch.Tensor, ...]  # per depth d >= 2: [M_d] parent's position in beam d-1
    cand_logp_index: torch.Tensor  # [M] index into top_logp.view(R, L*K): (depth - 1) * K + rank
    cand_parent_member: torch.Tensor  # [M] parent's member index in the merged list (root = 0, members from 1)
    cand_depth: torch.Tensor  # [M] int32
    member_cand_start: torch.Tensor  # [sum n_d] cand_starts of each member's depth
    depth1_order: torch.Tensor  # [n_1] 0..n_1-1: depth 1 needs no sort
    num_nodes: int  # N = min(B, sum n_d)


_PLANS: dict[tuple, _BuildPlan] = {}
_SELF_BITS: dict[tuple, torch.Tensor] = {}
_CHAINS: dict[tuple, TreeBatch] = {}


def _build_plan(budget: int, k: int, depth: int, device: torch.device) -> _BuildPlan:
    key = (budget, k, depth, str(device))
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    beam_sizes = [min(budget, k)]
    per_depth_pairs = [[(0, r) for r in range(beam_sizes[0])]]
    for _ in range(2, depth + 1):
        prev = beam_sizes[-1]
        # (p, r) is preceded by every (p' <= p, r' <= r): only (p + 1)(r + 1) <= B can make the beam.
        pairs = [(p, r) for p in range(prev) for r in range(min(k, budget // (p + 1)))]
        per_depth_pairs.append(pairs)
        beam_sizes.append(min(budget, prev * k, len(pairs)))
    member_starts = [1]
    for n in beam_sizes:
        member_starts.append(member_starts[-1] + n)
    cand_starts, logp_index, parent_member, cand_depth, member_cand_start = [], [], [], [], []
    for d, pairs in enumerate(per_depth_pairs, start=1):
        cand_starts.append(len(logp_index))
        logp_index += [(d - 1) * k + r for _, r in pairs]
        parent_member += [0 if d == 1 else member_starts[d - 2] + p for p, _ in pairs]
        cand_depth += [d] * len(pairs)
        member_cand_start += [cand_starts[-1]] * beam_sizes[d - 1]

    def as_tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    plan = _BuildPlan(
        beam_sizes=tuple(beam_sizes),
        cand_starts=tuple(cand_starts),
        cand_parent_pos=tuple(as_tensor([p for p, _ in pairs]) for pairs in per_depth_pairs[1:]),
        cand_logp_index=as_tensor(logp_index),
        cand_parent_member=as_tensor(parent_member),
        cand_depth=as_tensor(cand_depth, torch.int32),
        member_cand_start=as_tensor(member_cand_start),
        depth1_order=as_tensor(list(range(beam_sizes[0]))),
        num_nodes=min(budget, member_starts[-1] - 1),
    )
    _PLANS[key] = plan
    return plan


def self_bits_table(num_nodes_with_root: int, device: torch.device | str) -> torch.Tensor:
    """[N+1, W] int32: row i has only node i's own bit (bit 31 stored as a negative int32). Cached."""
    key = (num_nodes_with_root, str(device))
    table = _SELF_BITS.get(key)
    if table is None:
        words = num_ancestor_words(num_nodes_with_root)
        rows = []
        for i in range(num_nodes_with_root):
            row = [0] * words
            bit = 1 << (i % BITS_PER_WORD)
            row[i // BITS_PER_WORD] = bit - (1 << 32) if bit >= 1 << 31 else bit
            rows.append(row)
        table = torch.tensor(rows, dtype=torch.int32, device=device)
        _SELF_BITS[key] = table
    return table


def ancestor_bits_from_parents(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self bit words [R, N+1, W] from parents [R, N+1] (parent < child, -1 = root/padding).

    Pointer doubling: after j rounds a node holds the bits of itself and its 2^j - 1 nearest ancestors, so
    ceil(log2(max_depth + 1)) rounds cover any path (<= 5 for depth 16). Padding rows (parent -1, index > 0)
    come out as the root's bits plus their own; callers zero them.
    """
    rows, width = parents.shape
    table = self_bits_table(width, parents.device)
    bits = table.unsqueeze(0).expand(rows, -1, -1).clone()
    jump = parents.to(torch.int64).clamp(min=0)  # the root (and padding) jump to the root, a fixed point
    for _ in range(max(1, math.ceil(math.log2(max_depth + 1)))):
        bits = bits | torch.gather(bits, 1, jump.unsqueeze(-1).expand(-1, -1, bits.shape[-1]))
        jump = torch.gather(jump, 1, jump)
    return bits


# The one-launch beam's ranking compares every candidate of a depth with every other in one program per request,
# so it wins where trees are small. Whole builds, CUDA graphs, H200, Qwen3-8B's vocabulary (bench_tree_core.py
# build / build_triton, 2026-12-02, fourth session, one lease; the PyTorch beam with its sorts in Triton), us at
# batch 1 / 8 / 64: B = 16 151 / 429 / 1549 with the PyTorch beam against 84 / 340 / 1397 with this one, B = 32
# 213 / 463 / 1560 against 164 / 342 / 1403, B = 64 261 / 518 / 1610 against 781 / 966 / 2029.
TRITON_BEAM_MAX_BUDGET = 32


def sort_descending(scores: torch.Tensor, keep: int, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``keep`` columns of ``torch.sort(scores, dim=1, descending=True, stable=True)``: the order ties
    keep is the layout's, which the total order needs (module docstring)."""
    if use_triton:
        from vllm_ddtree.tree.sort_triton import sort_desc_triton

        return sort_desc_triton(scores, keep)
    values, order = torch.sort(scores, dim=1, descending=True, stable=True)
    return values[:, :keep], order[:, :keep]


def triton_beam(budget: int, device: torch.device) -> bool:
    """Whether the default build of ``budget`` nodes on ``device`` runs the one-launch Triton beam."""
    return torch.device(device).type == "cuda" and budget <= TRITON_BEAM_MAX_BUDGET


def build_tree(
    draft_logits: torch.Tensor, budget: int, out: TreeBatch, root_token_ids: torch.Tensor,
    use_triton: bool | None = None, triton_sort: bool | None = None, chain_out: torch.Tensor | None = None,
) -> None:
    """Fill ``out[:R]`` with the DDTree of each row of draft logits [R, L, V] under a budget of B nodes.

    B <= out.budget, L <= 16 (any L works; cost is linear in L). root_token_ids [R] becomes node 0's token.
    No host synchronisation; after the first call for a given (B, K, L, device) everything is graph-capturable.
    ``use_triton`` runs the beam and merge as one launch (build_triton.py), the same trees bit for bit. By default
    CUDA builds of at most ``TRITON_BEAM_MAX_BUDGET`` nodes take it and the rest the PyTorch beam (``triton_beam``);
    the CPU engine always the PyTorch one (Triton there is the interpreter). ``triton_sort``: the PyTorch beam's
    sorts in one Triton launch each (sort_triton.py; by default on CUDA), the same order as ``torch.sort``'s.
    ``chain_out [>= R, L]``, if given, gets each depth's most likely token (rank 0 of the top-k: the argmax, the
    lowest id among equals), i.e. the DFlash chain, which a chain step verifies instead of the tree.
    """
    k = min(budget, draft_logits.shape[-1])
    top_logp, top_ids = per_depth_topk(draft_logits, k)
    if chain_out is not None:
        chain_out[: top_ids.shape[0]].copy_(top_ids[:, :, 0])
    build_tree_from_topk(top_logp, top_ids, budget, out, root_token_ids, use_triton, triton_sort)


def build_chain(draft_logits: torch.Tensor, out: TreeBatch, root_token_ids: torch.Tensor,
                chain_out: torch.Tensor) -> None:
    """What the drafter files when the scheduler has already given the next step to the chain fallback: ``chain_out``
    as ``build_tree`` writes it (each depth's argmax, lowest id among equals) and, in ``out[:R]``, that chain as a
    tree (node i: parent i - 1, depth i; the rest padding), without the tree build's top-k and beam, which cost
    about 3% of a chain step on the Qwen3-8B shape (docs/cost-aware-budget.md). The chain-shaped tree keeps the
    hand-over's invariant: the fed drafts are the filed tree's tokens, and any step that verifies it is lossless."""
    rows, depth, _ = draft_logits.shape
    if depth > out.budget:
        raise ValueError(f"a chain of {depth} drafts does not fit a TreeBatch of budget {out.budget}")
    template = _chain_template(out.budget, depth, draft_logits.device)
    chain_out[:rows] = draft_logits.argmax(dim=-1)
    out.token_ids[:rows, 0] = root_token_ids
    out.token_ids[:rows, 1 : depth + 1] = chain_out[:rows]
    out.token_ids[:rows, depth + 1 :] = 0
    out.parents[:rows] = template.parents
    out.depths[:rows] = template.depths
    out.ancestor_bits[:rows] = template.ancestor_bits
    out.num_nodes[:rows] = depth


def _chain_template(budget: int, depth: int, device: torch.device) -> TreeBatch:
    """One row: the tree of ``budget`` nodes whose first ``depth`` form a chain (its tokens 0). Cached. Written by
    ``fill_chains``, so a filed chain and the chain a chain step verifies have one writer."""
    key = (budget, depth, str(device))
    template = _CHAINS.get(key)
    if template is None:
        template = TreeBatch.allocate(1, budget, device)
        fill_chains(torch.zeros(1, depth, dtype=torch.int64, device=device),
                    torch.tensor([depth], device=device), template)
        template.num_nodes[0] = depth
        _CHAINS[key] = template
    return template


def fill_chains(chains: torch.Tensor, num_drafts: torch.Tensor, verify: TreeBatch) -> None:
    """Rows ``[:R]`` of ``verify`` become chains: node i (1 <= i <= num_drafts[r]) is ``chains[r, i - 1]`` with
    parent i - 1 and depth i, the rest padding; the roots' tokens stay. The one writer of chain-shaped trees: the
    tree a chain step verifies (``verify_rows.prepare_rows_torch``, the kernel's reference) and ``build_chain``'s."""
    num_reqs, depth = chains.shape
    n = verify.token_ids.shape[1]
    device = chains.device
    node = torch.arange(n, device=device)[None, :]
    in_chain = (node <= num_drafts[:, None]) & (node <= depth)
    padded = torch.cat([verify.token_ids[:num_reqs, :1], chains, chains.new_zeros(num_reqs, max(n - 1 - depth, 0))],
                       dim=1)[:, :n]
    verify.token_ids[:num_reqs] = torch.where(in_chain, padded, 0)
    verify.parents[:num_reqs] = torch.where(in_chain, node - 1, -1).to(verify.parents.dtype)
    verify.depths[:num_reqs] = torch.where(in_chain, node, -1).to(verify.depths.dtype)
    bits = ancestor_bits_from_parents(verify.parents[:num_reqs], max(depth, 1))
    verify.ancestor_bits[:num_reqs] = torch.where(in_chain[:, :, None], bits, 0)


def build_tree_from_topk(
    top_logp: torch.Tensor,
    top_ids: torch.Tensor,
    budget: int,
    out: TreeBatch,
    root_token_ids: torch.Tensor,
    use_triton: bool | None = None,
    triton_sort: bool | None = None,
) -> None:
    """``build_tree`` from per-depth top-k [R, L, K] (float32 log-probs sorted descending, token ids)."""
    rows, depth, k = top_logp.shape
    if not 1 <= budget <= out.budget:
        raise ValueError(f"budget {budget} must be in 1..{out.budget} (the TreeBatch's budget)")
    if rows > out.token_ids.shape[0]:
        raise ValueError(f"{rows} rows do not fit a TreeBatch of {out.token_ids.shape[0]}")
    plan = _build_plan(budget, k, depth, top_logp.device)
    if use_triton if use_triton is not None else triton_beam(budget, top_logp.device):
        from vllm_ddtree.tree.build_triton import build_tree_triton

        build_tree_triton(plan, top_logp, top_ids, out, root_token_ids)
        return

    if triton_sort is None:
        triton_sort = top_logp.device.type == "cuda"
    # Per-depth beams, each sorted by the total order: scores, and which candidate each member is.
    flat_logp = top_logp.reshape(rows, depth * k)
    cand_logp = flat_logp.index_select(1, plan.cand_logp_index)  # every candidate's own log-prob, all depths
    beam_scores = cand_logp[:, : plan.beam_sizes[0]]
    scores, orders = [beam_scores], [plan.depth1_order.expand(rows, -1)]
    for d in range(1, depth):
        start = plan.cand_starts[d]
        step_logp = cand_logp[:, start : start + plan.cand_parent_pos[d - 1].numel()]
        cand_scores = beam_scores.index_select(1, plan.cand_parent_pos[d - 1]).add_(step_logp)
        beam_scores, order = sort_descending(cand_scores, plan.beam_sizes[d], triton_sort)
        scores.append(beam_scores)
        orders.append(order)
    member_cand = torch.cat(orders, dim=1).add_(plan.member_cand_start)  # [R, sum n_d] flat candidate index

    # Merge: stable sort of the (depth, beam position)-ordered members by score = the heap's pop order.
    num_nodes = plan.num_nodes
    _, selected = sort_descending(torch.cat(scores, dim=1), num_nodes, triton_sort)  # member index - 1, pop order
    selected_cand = torch.gather(member_cand, 1, selected)
    node_of_member = torch.zeros(rows, 1 + member_cand.shape[1], dtype=torch.int64, device=top_logp.device)
    node_of_member.scatter_(1, selected + 1, torch.arange(1, num_nodes + 1, device=top_logp.device).expand(rows, -1))
    parents = torch.gather(node_of_member, 1, plan.cand_parent_member[selected_cand])
    tokens = torch.gather(top_ids.reshape(rows, depth * k), 1, plan.cand_logp_index[selected_cand])

    out.token_ids[:rows, 0] = root_token_ids
    out.token_ids[:rows, 1 : num_nodes + 1] = tokens
    out.token_ids[:rows, num_nodes + 1 :] = 0
    out.parents[:rows, 0] = -1
    out.parents[:rows, 1 : num_nodes + 1] = parents
    out.parents[:rows, num_nodes + 1 :] = -1
    out.depths[:rows, 0] = 0
    out.depths[:rows, 1 : num_nodes + 1] = plan.cand_depth[selected_cand]
    out.depths[:rows, num_nodes + 1 :] = -1
    out.num_nodes[:rows] = num_nodes
    bits = ancestor_bits_from_parents(out.parents[:rows], min(depth, num_nodes))
    bits[:, num_nodes + 1 :] = 0
    out.ancestor_bits[:rows] = bits
