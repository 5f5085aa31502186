"""Tree-walk sampler: pick one target token per tree node, then follow the tree from the root (docs/algorithm.md §3).

Greedy rows take the argmax at every node; sampled rows take one independent draw per node from the target's
processed distribution (temperature, top-k, top-p, as vLLM's V1 Sampler applies them; min-p and logit bias are
refused by vLLM for every speculative method). Either way a node is
accepted iff its token equals the token drawn at its parent and its parent is accepted; the bonus is the token
drawn at the deepest accepted node. Every emitted token is therefore an exact draw from the target given the
emitted prefix, so sampling is lossless at any temperature. (``min(1, p/q)`` rejection would be wrong here:
the tree's candidates are deterministic top-B prefixes, not draws from q.)

Everything is static-shape tensor work: no host syncs, no data-dependent shapes or Python branches on tensor
values, so it can run inside a CUDA graph (the sampled path too, apart from per-request seeded generators,
which, as in vLLM, are a Python loop over the seeded requests only).

Output contract (vLLM's RejectionSampler, widened for trees): an accepted path holds at most one node per
depth, so it can never exceed the tree's max depth L; rows are L+1 wide (L accepted drafts + the bonus), not
B+1. ``output_token_ids[r]`` = accepted draft tokens, then the bonus, then -1 padding, which is what vLLM's
``RejectionSampler.parse_output`` and ``(out != -1).sum(1)`` consumers expect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_ddtree.tree.layout import BITS_PER_WORD, TreeBatch

PLACEHOLDER_TOKEN_ID = -1  # vLLM's rejection_sampler.PLACEHOLDER_TOKEN_ID
SAMPLING_EPS = 1e-5  # vLLM's sampler._SAMPLING_EPS: temperature below it means greedy


@dataclass
class TreeWalkOutput:
    """Preallocatable results of one walk, rows = requests, L = the tree's max depth."""

    output_token_ids: torch.Tensor  # [R, L+1] int32: accepted tokens, bonus, then -1
    accepted_node_ids: torch.Tensor  # [R, L+1] int32: node of each accepted position (0 = root), then -1
    num_accepted: torch.Tensor  # [R] int32: accepted draft tokens, bonus excluded

    @classmethod
    def allocate(cls, max_reqs: int, max_depth: int, device: torch.device | str) -> TreeWalkOutput:
        return cls(
            output_token_ids=torch.full((max_reqs, max_depth + 1), -1, dtype=torch.int32, device=device),
            accepted_node_ids=torch.full((max_reqs, max_depth + 1), -1, dtype=torch.int32, device=device),
            num_accepted=torch.zeros(max_reqs, dtype=torch.int32, device=device),
        )


def walk_tree(
    node_tokens: torch.Tensor, tree: TreeBatch, max_depth: int, out: TreeWalkOutput | None = None
) -> TreeWalkOutput:
    """Follow the tree along the tokens drawn at each node; write ``out[:R]``.

    node_tokens [R, B+1] int: the target's token at each node (argmax or a sample). tree: rows 0..R-1 are read;
    nodes beyond ``tree.num_nodes[r]`` are ignored (a prefix of the node list is a valid subtree). max_depth L:
    an upper bound on node depths (nodes deeper than L are never accepted). Sibling tokens must be distinct
    (build.py guarantees it), which makes the accepted path unique.
    """
    rows, width = node_tokens.shape
    device = node_tokens.device
    if out is None:
        out = TreeWalkOutput.allocate(rows, max_depth, device)
    node_index = torch.arange(width, device=device)
    parents = tree.parents[:rows].to(torch.int64)
    tokens = tree.token_ids[:rows]

    # Edge i is good iff node i is live and its token is what was drawn at its parent; the root's is always good.
    live = (node_index <= tree.num_nodes[:rows, None]) & (parents >= 0)
    drawn_at_parent = torch.gather(node_tokens, 1, parents.clamp(min=0))
    edge_ok = (live & (tokens == drawn_at_parent)) | (node_index == 0)

    # On the path iff every ancestor-or-self edge is good: (ancestor bits & ~good bits) == 0, word by word.
    words = tree.ancestor_bits.shape[-1]
    padded = torch.nn.functional.pad(edge_ok.to(torch.int64), (0, words * BITS_PER_WORD - width))
    shifts = torch.arange(BITS_PER_WORD, device=device, dtype=torch.int64)
    good_words = (padded.view(rows, words, BITS_PER_WORD) << shifts).sum(-1)  # distinct bits: sum == or
    ancestors = tree.ancestor_bits[:rows].to(torch.int64) & 0xFFFFFFFF
    on_path = ((ancestors & ~good_words[:, None, :]) == 0).all(-1) & edge_ok

    # One accepted node per depth: scatter node ids into their depth slot (off-path nodes into a spill slot).
    spill = max_depth + 1
    slot = torch.where(on_path, tree.depths[:rows].to(torch.int64).clamp(0, spill), spill)
    source = torch.where(on_path, node_index, -1).expand(rows, -1)
    accepted = torch.full((rows, max_depth + 2), -1, dtype=torch.int64, device=device)
    accepted.scatter_reduce_(1, slot, source, reduce="amax")
    accepted = accepted[:, : max_depth + 1]
    num_accepted = (accepted[:, 1:] >= 0).sum(1)

    deepest = torch.gather(accepted, 1, num_accepted[:, None])
    bonus = torch.gather(node_tokens, 1, deepest)
    path_tokens = torch.gather(tokens, 1, accepted[:, 1:].clamp(min=0))  # token of accepted position k+1
    position = torch.arange(max_depth + 1, device=device)
    n = num_accepted[:, None]
    emitted = torch.where(position[:max_depth] < n, path_tokens, PLACEHOLDER_TOKEN_ID)
    emitted = torch.cat([emitted, torch.full_like(bonus, PLACEHOLDER_TOKEN_ID)], dim=1)
    emitted = torch.where(position == n, bonus, emitted)

    out.output_token_ids[:rows] = emitted
    out.accepted_node_ids[:rows] = accepted
    out.num_accepted[:rows] = num_accepted
    return out


def _vllm_sampling_ops():
    """vLLM's own top-k/top-p and seeded random-sample functions (imported late: the walk itself needs no vLLM).

    On CUDA, vLLM's dispatcher (Triton kernel for >= 8 rows, sort-based otherwise); elsewhere its sort-based
    PyTorch version without the host-sync shortcut (vLLM's CPU dispatch would pick a Triton kernel).
    """
    from vllm.v1.sample.ops.topk_topp_sampler import (
        apply_top_k_top_p,
        apply_top_k_top_p_pytorch,
        random_sample,
    )

    def top_k_top_p(logits, k, p):
        if logits.is_cuda:
            return apply_top_k_top_p(logits, k, p)
        return apply_top_k_top_p_pytorch(logits, k, p)

    return top_k_top_p, random_sample


def sample_node_tokens(
    target_logits: torch.Tensor,
    *,
    all_greedy: bool,
    all_random: bool = False,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:
    """One target token per node [R, N] int64 from logits [R, N, V]; per-request parameters are [R].

    Mirrors vLLM's Sampler.sample row for row: greedy rows (temperature < 1e-5) take the argmax; the rest divide
    by temperature, apply top-k/top-p, and draw with exponential noise, request r's noise for all of
    its N nodes coming from ``generators[r]`` when it has one (so seeded requests reproduce). ``all_greedy`` /
    ``all_random`` are vLLM's batch flags and only skip work. target_logits is not modified.
    """
    rows, width, vocab = target_logits.shape
    flat = target_logits.reshape(rows * width, vocab)
    greedy = None
    if not all_random:
        greedy = flat.argmax(dim=-1)
        if all_greedy:
            return greedy.view(rows, width)
    if temperature is None:
        raise ValueError("sampled rows need a temperature tensor")
    top_k_top_p, random_sample = _vllm_sampling_ops()

    def per_node(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[:rows, None].expand(rows, width).reshape(-1)

    temp = temperature[:rows]
    divisor = temp if all_random else torch.where(temp < SAMPLING_EPS, 1.0, temp)
    logits = flat.to(torch.float32) / per_node(divisor)[:, None]  # a fresh buffer: the caller's stays intact
    logits = top_k_top_p(logits, per_node(top_k), per_node(top_p))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    sampled = random_sample(probs.view(rows, width, vocab), generators or {}, use_fp64_gumbel).view(rows, width)
    if greedy is None:
        return sampled
    return torch.where(temp[:, None] < SAMPLING_EPS, greedy.view(rows, width), sampled)
