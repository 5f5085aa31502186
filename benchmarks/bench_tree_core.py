"""Micro-benchmarks of the DDTree tree core, one registry entry per operation (build, walk, ...).

Each benchmark is a setup function registered under a name: given a Case it allocates every input once and
returns a zero-argument ``step`` that runs the operation on preallocated buffers (what a CUDA graph would
replay). The harness times ``step`` with CUDA events (median of --iters), eagerly and, with --graph, as a
captured CUDA graph replay, and checks that one eager step makes no host sync (torch.cuda sync debug mode).
Add an operation by writing ``@register("name") def setup_name(case): ...; return step``.

    python benchmarks/bench_tree_core.py --what build,walk --out out/tree_core.json --graph --verify
    python benchmarks/bench_tree_core.py --device cpu            # smoke check with tiny sizes

On CPU the sizes shrink to a smoke check and wall-clock timing is used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_ddtree.tree.build import build_tree, order_topk, per_depth_topk  # noqa: E402
from vllm_ddtree.tree.layout import TreeBatch  # noqa: E402


@dataclass(frozen=True)
class Case:
    batch: int
    budget: int
    depth: int
    vocab: int
    device: str
    dtype: torch.dtype


Step = Callable[[], None]
BENCHMARKS: dict[str, Callable[[Case], Step]] = {}
VERIFIERS: dict[str, Callable[[Case], str]] = {}


def register(name: str, verify: Callable[[Case], str] | None = None):
    """Add a benchmark: ``setup(case) -> step``; optional ``verify(case) -> 'ok' | message`` for --verify."""

    def wrap(setup: Callable[[Case], Step]) -> Callable[[Case], Step]:
        BENCHMARKS[name] = setup
        if verify is not None:
            VERIFIERS[name] = verify
        return setup

    return wrap


# --logits: "random" (independent N(0, 16) logits), or "clustered": the same plus a run of CLUSTER_TOKENS
# consecutive token ids raised by CLUSTER_LIFT, as when a drafter favours one script whose tokens sit together in
# the vocabulary; many keys then sit in few chunks (the threshold top-k's hard case).
LOGITS = "random"
CLUSTER_START, CLUSTER_TOKENS, CLUSTER_LIFT = 4096, 1536, 10.0


def _draft_logits(case: Case, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=case.device).manual_seed(seed)
    logits = torch.randn(case.batch, case.depth, case.vocab, generator=gen, device=case.device) * 4
    if LOGITS == "clustered":
        logits[..., CLUSTER_START : CLUSTER_START + CLUSTER_TOKENS] += CLUSTER_LIFT
    return logits.to(case.dtype)


def _built_tree(case: Case) -> TreeBatch:
    tree = TreeBatch.allocate(case.batch, case.budget, case.device)
    build_tree(_draft_logits(case), case.budget, tree, torch.zeros(case.batch, dtype=torch.int64, device=case.device))
    return tree


def _target_logits(case: Case, tree: TreeBatch, follow: bool = True) -> torch.Tensor:
    """Target logits [R, B+1, V] whose argmax mostly follows the tree (long accepted paths, realistic work)."""
    gen = torch.Generator(device=case.device).manual_seed(1)
    logits = torch.randn(case.batch, case.budget + 1, case.vocab, generator=gen, device=case.device).to(case.dtype)
    if follow:
        # Node i's argmax := the token of its first child, when it has one (the last-written child wins).
        child_tokens = torch.zeros(case.batch, case.budget + 1, dtype=torch.int64, device=case.device)
        parents = tree.parents.to(torch.int64)
        idx = torch.where(parents >= 0, parents, case.budget + 1)
        scratch = torch.zeros(case.batch, case.budget + 2, dtype=torch.int64, device=case.device)
        scratch.scatter_(1, idx.flip(1), tree.token_ids.flip(1))
        child_tokens.copy_(scratch[:, : case.budget + 1])
        logits.scatter_(-1, child_tokens[..., None], 30.0)
    return logits


# --- build --------------------------------------------------------------------------------------------------


def _verify_build(case: Case) -> str:
    from vllm_ddtree.tree.reference import ancestor_sets_from_bits, heap_tree

    logits = _draft_logits(case, seed=3)
    tree = TreeBatch.allocate(case.batch, case.budget, case.device)
    build_tree(logits, case.budget, tree, torch.zeros(case.batch, dtype=torch.int64, device=case.device))
    top_logp, top_ids = per_depth_topk(logits, min(case.budget, case.vocab))
    for r in sorted({0, case.batch - 1}):
        ref = heap_tree(top_logp[r].tolist(), top_ids[r].tolist(), case.budget)
        n = ref.num_nodes
        if tree.token_ids[r, 1 : n + 1].tolist() != ref.tokens[1:] or tree.parents[r, : n + 1].tolist() != ref.parents:
            return f"row {r}: tree differs from the heap reference"
        if ancestor_sets_from_bits(tree.ancestor_bits[r, : n + 1].tolist()) != ref.ancestors:
            return f"row {r}: ancestor bits differ"
    return "ok"


def _build_step(case: Case, **build) -> Step:
    logits = _draft_logits(case)
    tree = TreeBatch.allocate(case.batch, case.budget, case.device)
    roots = torch.zeros(case.batch, dtype=torch.int64, device=case.device)
    return lambda: build_tree(logits, case.budget, tree, roots, **build)


@register("build", verify=_verify_build)
def setup_build(case: Case) -> Step:
    """Per-depth log_softmax + top-k over the full vocabulary, beam build, TreeBatch fill (on CUDA its sorts are
    Triton launches, tree/sort_triton.py)."""
    return _build_step(case, use_triton=False)


def _same_trees_as_build(case: Case, **build) -> str:
    """Every field of every row equal to the PyTorch build's (``build``, the CPU engine's path)."""
    logits = _draft_logits(case, seed=3)
    roots = torch.zeros(case.batch, dtype=torch.int64, device=case.device)
    trees = [TreeBatch.allocate(case.batch, case.budget, case.device) for _ in range(2)]
    build_tree(logits, case.budget, trees[0], roots, use_triton=False)
    build_tree(logits, case.budget, trees[1], roots, **build)
    for field in ("token_ids", "parents", "depths", "ancestor_bits", "num_nodes"):
        if not torch.equal(getattr(trees[0], field), getattr(trees[1], field)):
            return f"{field} differs from the PyTorch build's"
    return "ok"


@register("build_triton", verify=lambda case: _same_trees_as_build(case, use_triton=True))
def setup_build_triton(case: Case) -> Step:
    """``build`` with the beam and merge in one Triton launch (tree/build_triton.py) instead of about 100 kernels."""
    if not str(case.device).startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton build needs a GPU here (or TRITON_INTERPRET=1)")
    return _build_step(case, use_triton=True)


@register("build_torch_sort", verify=lambda case: _same_trees_as_build(case, use_triton=False, triton_sort=False))
def setup_build_torch_sort(case: Case) -> Step:
    """``build`` with torch.sort for the beam's sorts (the CPU's path; radixSortKVInPlace on CUDA): the baseline of
    tree/sort_triton.py."""
    return _build_step(case, use_triton=False, triton_sort=False)


def _topk_step(case: Case, topk: Callable[[torch.Tensor, int], tuple]) -> Step:
    logits = _draft_logits(case)
    k = min(case.budget, case.vocab)
    return lambda: topk(logits, k)


@register("build_topk")
def setup_build_topk(case: Case) -> Step:
    """Just the vocabulary-wide part of the build (top-k of the logits, their log-probs, tie ordering), as the
    build runs it (build.topk_method picks the path)."""
    return _topk_step(case, per_depth_topk)


@register("build_topk_torch")
def setup_build_topk_torch(case: Case) -> Step:
    """build_topk on its PyTorch path (torch.topk, the row log-sum-exp, order_topk)."""
    return _topk_step(case, lambda logits, k: per_depth_topk(logits, k, method="torch"))


def _verify_topk_method(case: Case, method: str) -> str:
    """The PyTorch path's log-probs within 1e-5, its tokens where no tie straddles the k-th value."""
    logits = _draft_logits(case, seed=5)
    k = min(case.budget, case.vocab)
    (new_logp, new_ids), (ref_logp, ref_ids) = (per_depth_topk(logits, k, method=method),
                                                per_depth_topk(logits, k, method="torch"))
    if not torch.allclose(new_logp, ref_logp, rtol=0, atol=1e-5):
        return f"log-probs differ by {float((new_logp - ref_logp).abs().max()):.2e}"
    return "ok" if torch.equal(new_ids, ref_ids) else "ok (tokens differ only within ties)"


@register("build_topk_triton", verify=lambda case: _verify_topk_method(case, "chunks"))
def setup_build_topk_triton(case: Case) -> Step:
    """build_topk in two Triton launches (tree/topk_triton.py, k maxima per chunk), whatever the size."""
    return _topk_step(case, lambda logits, k: per_depth_topk(logits, k, method="chunks"))


@register("build_topk_threshold", verify=lambda case: _verify_topk_method(case, "threshold"))
def setup_build_topk_threshold(case: Case) -> Step:
    """build_topk in four Triton launches that read the logits about once (topk_triton.py's threshold top-k)."""
    return _topk_step(case, lambda logits, k: per_depth_topk(logits, k, method="threshold"))


def _topk_of_log_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """build_topk before 2026-12-01's fourth session: top-k of the float32 log-softmax of the whole vocabulary."""
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1, sorted=True)
    return order_topk(values, ids)


def _verify_build_topk_log_softmax(case: Case) -> str:
    """The same ranks and tokens as build_topk, log-probs within 1e-4 (a different float32 rounding)."""
    logits = _draft_logits(case, seed=5)
    k = min(case.budget, case.vocab)
    (new_logp, new_ids), (old_logp, old_ids) = (per_depth_topk(logits, k, method="torch"),
                                                _topk_of_log_softmax(logits, k))
    if not torch.equal(new_ids, old_ids):
        return "top-k tokens differ"
    if not torch.allclose(new_logp, old_logp, rtol=0, atol=1e-4):
        return f"log-probs differ by {float((new_logp - old_logp).abs().max()):.2e}"
    return "ok"


@register("build_topk_log_softmax", verify=_verify_build_topk_log_softmax)
def setup_build_topk_log_softmax(case: Case) -> Step:
    """build_topk as it was (log_softmax over the vocabulary first): the baseline of the same call."""
    return _topk_step(case, _topk_of_log_softmax)


# --- walk ---------------------------------------------------------------------------------------------------


def _tree_sample(logits: torch.Tensor, tree: TreeBatch, depth: int, out=None, **sampling):
    """One target token per node (vLLM's sampling functions), then the walk: what a verify step's sampler does."""
    from vllm_ddtree.sampler import sample_node_tokens, walk_tree

    return walk_tree(sample_node_tokens(logits, **sampling), tree, depth, out)


def _verify_walk(case: Case) -> str:
    from vllm_ddtree.tree.reference import walk_tree_greedy_reference

    tree = _built_tree(case)
    logits = _target_logits(case, tree)
    out = _tree_sample(logits, tree, case.depth, all_greedy=True)
    post = logits.argmax(-1)
    for r in sorted({0, case.batch - 1}):
        accepted, bonus = walk_tree_greedy_reference(
            tree.token_ids[r].tolist(), tree.parents[r].tolist(), int(tree.num_nodes[r]), post[r].tolist(), case.depth
        )
        if out.accepted_node_ids[r, : len(accepted)].tolist() != accepted:
            return f"row {r}: accepted path differs from the reference walk"
        if int(out.output_token_ids[r, len(accepted) - 1]) != bonus:
            return f"row {r}: bonus differs"
    return "ok"


@register("walk", verify=_verify_walk)
def setup_walk(case: Case) -> Step:
    """Greedy verify: argmax over [R, B+1, V] target logits, then the tree walk into preallocated outputs."""
    from vllm_ddtree.sampler import TreeWalkOutput

    tree = _built_tree(case)
    logits = _target_logits(case, tree)
    out = TreeWalkOutput.allocate(case.batch, case.depth, case.device)
    return lambda: _tree_sample(logits, tree, case.depth, out, all_greedy=True)


@register("walk_core")
def setup_walk_core(case: Case) -> Step:
    """The walk alone, from per-node tokens (excludes the vocabulary-wide argmax)."""
    from vllm_ddtree.sampler import TreeWalkOutput, walk_tree

    tree = _built_tree(case)
    node_tokens = _target_logits(case, tree).argmax(-1)
    out = TreeWalkOutput.allocate(case.batch, case.depth, case.device)
    return lambda: walk_tree(node_tokens, tree, case.depth, out)


def _verify_walk_triton(case: Case) -> str:
    from vllm_ddtree.sampler import walk_tree
    from vllm_ddtree.walk_triton import walk_tree_triton

    tree = _built_tree(case)
    node_tokens = _target_logits(case, tree).argmax(-1)
    want, got = walk_tree(node_tokens, tree, case.depth), walk_tree_triton(node_tokens, tree, case.depth)
    same = all(torch.equal(getattr(want, f), getattr(got, f))
               for f in ("output_token_ids", "accepted_node_ids", "num_accepted"))
    return "ok" if same else "differs from walk_tree"


@register("walk_triton", verify=_verify_walk_triton)
def setup_walk_triton(case: Case) -> Step:
    """walk_core in one Triton launch (walk_triton.py, what the verify core runs on CUDA)."""
    from vllm_ddtree.sampler import TreeWalkOutput
    from vllm_ddtree.walk_triton import walk_tree_triton

    tree = _built_tree(case)
    node_tokens = _target_logits(case, tree).argmax(-1)
    out = TreeWalkOutput.allocate(case.batch, case.depth, case.device)
    return lambda: walk_tree_triton(node_tokens, tree, case.depth, out)


@register("walk_sampled")
def setup_walk_sampled(case: Case) -> Step:
    """T=0.8 + top-p 0.95 at every node (vLLM's top-k/top-p and sampling functions), then the walk."""
    from vllm_ddtree.sampler import TreeWalkOutput

    tree = _built_tree(case)
    logits = _target_logits(case, tree)
    out = TreeWalkOutput.allocate(case.batch, case.depth, case.device)
    temperature = torch.full((case.batch,), 0.8, device=case.device)
    top_p = torch.full((case.batch,), 0.95, device=case.device)
    return lambda: _tree_sample(logits, tree, case.depth, out, all_greedy=False, all_random=True,
                                temperature=temperature, top_p=top_p)


# --- tree attention / KV compaction (vllm_ddtree.attention, vllm_ddtree.kv_compact) ------------------------
# Target-shaped inputs: Hq 32 / Hkv 8 / D 128 (Llama-3-8B, Qwen3-8B), block 16, committed prefix ATTN_CTX tokens
# (64 on CPU), trees from the real build. GPU: the Triton kernels; CPU: the PyTorch paths the CPU engine runs.

ATTN_CTX, ATTN_HQ, ATTN_HKV, ATTN_D, ATTN_BS, COMPACT_LAYERS = 2048, 32, 8, 128, 16, 36


def _attn_inputs(case: Case) -> dict:
    on_gpu = case.device.startswith("cuda")
    ctx, n = (ATTN_CTX if on_gpu else 64), case.budget + 1
    gen = torch.Generator(device=case.device).manual_seed(7)
    blocks_per_req = (ctx + n + ATTN_BS - 1) // ATTN_BS
    num_blocks = case.batch * blocks_per_req + 1
    kv = torch.randn(num_blocks, ATTN_BS, ATTN_HKV, 2 * ATTN_D, generator=gen, device=case.device).to(case.dtype)
    kv = kv.permute(0, 2, 1, 3)  # TRITON_ATTN's logical [nb, Hkv, bs, 2D] over NHD memory
    perm = torch.randperm(num_blocks, generator=gen, device=case.device)[: case.batch * blocks_per_req]
    q = torch.randn(case.batch * n, ATTN_HQ, ATTN_D, generator=gen, device=case.device).to(case.dtype)
    return dict(
        q=q, kv=kv, k=kv.transpose(1, 2)[..., :ATTN_D], v=kv.transpose(1, 2)[..., ATTN_D:],
        block_table=perm.view(case.batch, blocks_per_req).int(),
        qsl=torch.arange(0, case.batch * n + 1, n, dtype=torch.int32, device=case.device),
        seq_lens=torch.full((case.batch,), ctx + n, dtype=torch.int32, device=case.device),
        bits=_built_tree(case).ancestor_bits, ctx=ctx, out=torch.empty_like(q),
    )


def _run_attention(x: dict, device: str) -> torch.Tensor:
    args = (x["q"], x["k"], x["v"], x["out"], x["qsl"], x["seq_lens"], x["block_table"], x["bits"], ATTN_D**-0.5)
    if device.startswith("cuda"):
        from vllm_ddtree.attention.triton_tree import tree_attention

        return tree_attention(*args)
    from vllm_ddtree.attention.torch_tree import tree_attention_torch

    return tree_attention_torch(*args)


def _against_torch_path(x: dict, got: torch.Tensor) -> str:
    """Verdict on one layer's tree attention output against the PyTorch path on the same inputs."""
    from vllm_ddtree.attention.torch_tree import tree_attention_torch

    got = got.float().clone()
    ref = torch.empty_like(x["q"])
    tree_attention_torch(x["q"], x["k"], x["v"], ref, x["qsl"], x["seq_lens"], x["block_table"], x["bits"],
                         ATTN_D**-0.5)
    err = ((got - ref.float()).norm() / ref.float().norm()).item()
    return "ok" if err < 2e-2 else f"relative error {err:.2e} vs the PyTorch path"


def _verify_attention(case: Case) -> str:
    x = _attn_inputs(case)
    return _against_torch_path(x, _run_attention(x, case.device))


@register("attention", verify=_verify_attention)
def setup_attention(case: Case) -> Step:
    """Tree-masked paged attention for one layer: batch x (B+1) queries over ATTN_CTX-token prefixes."""
    x = _attn_inputs(case)
    return lambda: _run_attention(x, case.device)


def _fa_inputs(case: Case) -> dict:
    """The same shapes as ``_attn_inputs`` in FLASH_ATTN's cache layout (separate K and V [nb, bs, Hkv, D])."""
    x = _attn_inputs(case)
    return dict(x, k=x["k"].contiguous(), v=x["v"].contiguous(), n=case.budget + 1)


def _flash(x: dict, *, causal: bool, prefix_only: bool):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    seqused = x["seq_lens"] - x["n"] if prefix_only else x["seq_lens"]
    return flash_attn_varlen_func(
        q=x["q"], k=x["k"], v=x["v"], out=x["out"], cu_seqlens_q=x["qsl"], max_seqlen_q=x["n"],
        seqused_k=seqused, max_seqlen_k=x["ctx"] + x["n"], softmax_scale=ATTN_D**-0.5, causal=causal,
        block_table=x["block_table"], return_softmax_lse=prefix_only, fa_version=3)


@register("attention_fa3")
def setup_attention_fa3(case: Case) -> Step:
    """vLLM's FlashAttention 3, causal, on the same batch x (B+1) queries: what a chain verify of B+1 tokens pays
    for attention (the bar for the tree kernel)."""
    x = _fa_inputs(case)
    return lambda: _flash(x, causal=True, prefix_only=False)


@register("attention_fa3_prefix")
def setup_attention_fa3_prefix(case: Case) -> Step:
    """FlashAttention 3 over the committed prefix only (no mask, with the log-sum-exp): the prefix half of a
    tree attention split into prefix + tree block, merged by log-sum-exp."""
    x = _fa_inputs(case)
    return lambda: _flash(x, causal=False, prefix_only=True)


def _fa3_split(x: dict) -> torch.Tensor:
    """What TreeFlashAttentionImpl runs for a full verify batch: FlashAttention 3 over the prefix, then the tree
    kernel over the tree block, merged into FlashAttention's output by log-sum-exp."""
    from vllm_ddtree.attention.triton_tree import tree_attention

    _, lse = _flash(x, causal=False, prefix_only=True)
    return tree_attention(x["q"], x["k"], x["v"], x["out"], x["qsl"], x["seq_lens"], x["block_table"], x["bits"],
                          ATTN_D**-0.5, prefix_lse=lse)


def _verify_attention_fa3_split(case: Case) -> str:
    x = _fa_inputs(case)
    return _against_torch_path(x, _fa3_split(x))


@register("attention_fa3_split", verify=_verify_attention_fa3_split)
def setup_attention_fa3_split(case: Case) -> Step:
    """The FLASH_ATTN backend's tree attention: FlashAttention 3 over the prefix + the tree kernel over the block
    (compare ``attention``, the tree kernel over every key, and ``attention_fa3``, the chain's causal verify)."""
    x = _fa_inputs(case)
    return lambda: _fa3_split(x)


def _compact_inputs(case: Case) -> tuple:
    """COMPACT_LAYERS packed K|V layer caches and accepted paths of length ~depth/2 (every node moves)."""
    x = _attn_inputs(case)
    layers = [torch.empty_like(x["kv"]).normal_().transpose(1, 2) for _ in range(COMPACT_LAYERS)]
    width = case.depth + 1
    m = min(case.depth // 2, case.budget)
    acc = torch.full((case.batch, width), -1, dtype=torch.int32, device=case.device)
    acc[:, : m + 1] = torch.arange(m + 1, dtype=torch.int32, device=case.device) * case.budget // max(m, 1)
    acc[:, 1 : m + 1] = torch.maximum(acc[:, 1 : m + 1], torch.arange(1, m + 1, device=case.device).int())
    ctx = torch.full((case.batch,), x["ctx"], dtype=torch.int32, device=case.device)
    return layers, x["block_table"], ctx, acc


def _verify_kv_compact(case: Case) -> str:
    from vllm_ddtree.kv_compact import KVCompactor, kv_compact_torch

    layers, bt, ctx, acc = _compact_inputs(case)
    ref = [v.clone() for v in layers]
    kv_compact_torch(ref, bt, ctx, acc)
    if case.device.startswith("cuda"):
        KVCompactor(layers)(bt, ctx, acc)
    else:
        kv_compact_torch(layers, bt, ctx, acc)
    return "ok" if all(torch.equal(a, b) for a, b in zip(layers, ref)) else "differs from kv_compact_torch"


@register("kv_compact", verify=_verify_kv_compact)
def setup_kv_compact(case: Case) -> Step:
    """Move the accepted nodes' K/V onto the path slots in all COMPACT_LAYERS layers (one launch on GPU)."""
    from vllm_ddtree.kv_compact import KVCompactor, kv_compact_torch

    layers, bt, ctx, acc = _compact_inputs(case)
    if case.device.startswith("cuda"):
        compactor = KVCompactor(layers)
        return lambda: compactor(bt, ctx, acc)
    return lambda: kv_compact_torch(layers, bt, ctx, acc)


# --- hybrid targets: one GatedDeltaNet layer of Qwen3.6-27B (TP=1), replay layout -------------------------------

GDN_HEADS_QK, GDN_HEADS_V, GDN_DIM = 16, 48, 128  # Qwen3.6-27B: linear_num_key_heads, linear_num_value_heads, dims
GDN_LAYERS = 48  # its GDN layers: a step pays each benchmark below this many times


def _branch_nodes(parents: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    """The nodes with a child other than the next token (what the one-kernel verify stored until 2026-12-04; none
    in a chain): their own rows, -1 elsewhere."""
    p, starts = parents.tolist(), qsl.tolist()
    stored = [-1] * len(p)
    for s0, s1 in zip(starts[:-1], starts[1:]):
        for t in range(s0, s1):
            if p[t] >= 0 and p[t] != t - s0 - 1:
                stored[s0 + p[t]] = s0 + p[t]
    return torch.tensor(stored, dtype=torch.int32, device=parents.device)


def _gdn_inputs(case: Case, chain: bool) -> dict:
    """One GDN layer's verify inputs for ``batch`` requests of ``1 + budget`` tokens: best-first trees (``_built_tree``)
    or chains, q/k/v/a/b in the case's dtype, one float32 state block per request, the branch-node indices."""
    dev, n, hk, hv, d = case.device, case.budget + 1, GDN_HEADS_QK, GDN_HEADS_V, GDN_DIM
    if case.device == "cpu":
        hk, hv, d = 2, 4, 16
    tokens = case.batch * n
    gen = torch.Generator(device=dev).manual_seed(5)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(case.dtype)

    if chain:
        parents = (torch.arange(n, device=dev) - 1).repeat(case.batch).int()
    else:
        parents = _built_tree(case).parents.reshape(-1).int()
    qsl = torch.arange(case.batch + 1, dtype=torch.int32, device=dev) * n
    return dict(
        A_log=torch.rand(hv, generator=gen, device=dev) - 0.5, dt_bias=torch.rand(hv, generator=gen, device=dev) * 0.2,
        q=randn(1, tokens, hk, d), k=randn(1, tokens, hk, d), v=randn(1, tokens, hv, d), a=randn(tokens, hv),
        b=randn(tokens, hv), parents=parents, qsl=qsl,
        blocks=torch.arange(1, case.batch + 1, dtype=torch.int32, device=dev)[:, None],
        state=torch.randn(case.batch + 1, hv, d, d, generator=gen, device=dev) * 0.1,
        workspace=torch.zeros(tokens, hv, d, d, device=dev), stored=_branch_nodes(parents, qsl),
    )


def _gdn_verify(x: dict, leaves=None) -> Step:
    from vllm_ddtree.hybrid.tree_gdn import tree_fused_sigmoid_gating_delta_rule_update

    return lambda: tree_fused_sigmoid_gating_delta_rule_update(
        x["A_log"], x["a"], x["b"], x["dt_bias"], x["q"], x["k"], x["v"], x["parents"], initial_state=x["state"],
        cu_seqlens=x["qsl"], ssm_state_indices=x["blocks"], node_states=x["workspace"],
        node_state_indices=x["stored"], use_qk_l2norm_in_kernel=True, leaves=leaves)


@register("gdn_chain")
def setup_gdn_chain(case: Case) -> Step:
    """One GDN layer's recurrence over 1 + B chain tokens per request in the tree kernel, nothing stored. Until
    2026-12-04 this kernel loaded each token's inputs at its turn, as vLLM's chain kernel does, and timed what the
    DFlash chain's verify pays (benchmarks/README.md); it now loads the next token's ahead, so it runs faster."""
    return _gdn_verify(_gdn_inputs(case, chain=True))


@register("gdn_tree")
def setup_gdn_tree(case: Case) -> Step:
    """The same over best-first trees, branch nodes' states stored in the float32 workspace (the verify forward in
    the replay layout until 2026-12-04; now ``gdn_tree_deferred``)."""
    return _gdn_verify(_gdn_inputs(case, chain=False))


def _verify_gdn_deferred(case: Case) -> str:
    """The deferred-leaves run against the one-kernel run: the same arithmetic, so equal up to the compiler's
    contractions across two kernels."""
    from vllm_ddtree.hybrid.tree_gdn import deferred_leaves

    x = _gdn_inputs(case, chain=False)
    o_ref, _ = _gdn_verify(x)()
    plan = deferred_leaves(x["parents"], x["qsl"])
    o, _ = _gdn_verify(dict(x, stored=plan.node_state_indices), leaves=plan)()
    worst = float((o.float() - o_ref.float()).abs().max())
    return "ok" if worst <= 1e-3 else f"differs from the one-kernel run by {worst:.3g}"


@register("gdn_tree_deferred", verify=_verify_gdn_deferred)
def setup_gdn_tree_deferred(case: Case) -> Step:
    """``gdn_tree`` with the leaves deferred to the leaf kernel (``tree_gdn.deferred_leaves``; what the verify
    forward runs since 2026-12-04): the main kernel runs roots and nodes with children, storing each one's state,
    one program per leaf the leaves; the split is built once per step for every layer, so it is not timed."""
    from vllm_ddtree.hybrid.tree_gdn import deferred_leaves

    x = _gdn_inputs(case, chain=False)
    plan = deferred_leaves(x["parents"], x["qsl"])
    return _gdn_verify(dict(x, stored=plan.node_state_indices), leaves=plan)


@register("gdn_conv")
def setup_gdn_conv(case: Case) -> Step:
    """One GDN layer's tree causal-conv1d over the same trees (``tree_conv.tree_causal_conv1d_update``: Qwen3.6-27B's
    conv dimension 2 x 16 x 128 + 48 x 128 at TP=1, width 4, bf16 slots of width - 1 + B columns; the windows are
    built once per step for every layer, so they are not timed). The H200 profile of 2026-12-04 had the
    token-serial version at 26.7 us per layer (batch 1, B=64) against vLLM's chain conv's 5.4."""
    from vllm_ddtree.hybrid.tree_conv import tree_causal_conv1d_update, tree_conv_window

    x = _gdn_inputs(case, chain=False)
    width, n = 4, case.budget + 1
    dim = (2 * GDN_HEADS_QK + GDN_HEADS_V) * GDN_DIM if case.device != "cpu" else 64
    gen = torch.Generator(device=case.device).manual_seed(6)
    tokens = case.batch * n
    xs = torch.randn(tokens, dim, generator=gen, device=case.device).to(case.dtype)
    # vLLM's default "SD" layout (mamba_utils.get_conv_state_layout): dim innermost, the kernel's view transposed.
    conv_state = torch.randn(case.batch + 1, width - 1 + case.budget, dim, generator=gen, device=case.device).to(
        case.dtype).transpose(1, 2)
    weight = torch.randn(dim, width, generator=gen, device=case.device).to(case.dtype)
    slots = x["blocks"][:, 0].contiguous()
    accepted = torch.ones(case.batch, dtype=torch.int32, device=case.device)
    window = tree_conv_window(x["parents"], x["qsl"], width)
    return lambda: tree_causal_conv1d_update(xs, conv_state, weight, None, "silu", slots, accepted, x["qsl"], n,
                                             window)


@register("gdn_replay")
def setup_gdn_replay(case: Case) -> Step:
    """One GDN layer's relayout after the walk in the replay layout: each request's accepted path (about depth / 2
    nodes deep along the tree) rerun from its block over the stashed inputs (``relayout.apply_replay``; the plan is
    built once per step for every layer, so it is not timed)."""
    from vllm_ddtree.hybrid.relayout import apply_replay, replay_plan

    x = _gdn_inputs(case, chain=False)
    n, width = case.budget + 1, case.depth + 1
    accepted = torch.full((case.batch, width), -1, dtype=torch.int32)
    kept = torch.zeros(case.batch, dtype=torch.int32)
    for r, row in enumerate(x["parents"].view(case.batch, n).tolist()):
        paths = []
        for node in range(n):  # root-to-node paths, the longest up to depth / 2 + 1 nodes kept
            path = [node]
            while row[path[-1]] >= 0:
                path.append(row[path[-1]])
            paths.append(path[::-1])
        path = max((p for p in paths if len(p) <= case.depth // 2 + 1), key=len)
        accepted[r, : len(path)], kept[r] = torch.tensor(path, dtype=torch.int32), len(path)
    blocks = x["blocks"][:, 0]
    plan = replay_plan(blocks, blocks, accepted.to(case.device), kept.to(case.device), x["qsl"])
    return lambda: apply_replay(plan, x["A_log"], x["a"], x["b"], x["dt_bias"], x["q"], x["k"], x["v"], x["state"])


# --- harness ------------------------------------------------------------------------------------------------


def _time_eager(step: Step, device: str, iters: int) -> list[float]:
    """Per-call microseconds."""
    times = []
    if device.startswith("cuda"):
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def _time_graph(step: Step, iters: int) -> list[float]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return _time_eager(graph.replay, "cuda", iters)


def _sync_free(step: Step) -> bool:
    """True when one eager step makes no host synchronisation (CUDA only)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run_case(name: str, case: Case, args) -> dict:
    row = {"bench": name, **{k: v for k, v in asdict(case).items() if k != "dtype"}, "dtype": str(case.dtype)}
    try:
        step = BENCHMARKS[name](case)
        for _ in range(args.warmup):
            step()
        if case.device.startswith("cuda"):
            torch.cuda.synchronize()
            row["sync_free"] = _sync_free(step)
        times = _time_eager(step, case.device, args.iters)
        row["eager_median_us"] = statistics.median(times)
        row["eager_p90_us"] = sorted(times)[int(0.9 * (len(times) - 1))]
        if args.graph and case.device.startswith("cuda"):
            try:
                row["graph_median_us"] = statistics.median(_time_graph(step, args.iters))
            except Exception as exc:  # report, keep going: capture failure is itself a finding
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if args.verify and name in VERIFIERS:
            row["verify"] = VERIFIERS[name](case)
    except ImportError as exc:
        row["skipped"] = f"ImportError: {exc}"[:200]
    except torch.OutOfMemoryError:
        row["skipped"] = "out of memory"
    except (RuntimeError, ValueError) as exc:  # e.g. a library refusing a shape: report it, time the rest
        row["skipped"] = f"{type(exc).__name__}: {exc}"[:200]
    if case.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict]) -> None:
    cols = ["bench", "batch", "budget", "depth", "vocab", "eager_median_us", "graph_median_us", "sync_free", "verify"]
    print(" | ".join(f"{c:>15}" for c in cols))
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c, row.get("skipped", row.get("graph_error", "")) if c == "verify" else "")
            cells.append(f"{v:>15.1f}" if isinstance(v, float) else f"{str(v)[:15]:>15}")
        print(" | ".join(cells))


def main(argv: list[str] | None = None) -> list[dict]:
    global ATTN_CTX, LOGITS
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", default="build,walk", help=f"comma list of {sorted(BENCHMARKS)} or 'all'")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--batches", default=None, help="comma list (default 1,8,32,64 on GPU, 1,4 on CPU)")
    parser.add_argument("--budgets", default=None, help="comma list (default 16,64,128 on GPU, 16,64 on CPU)")
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--vocab", type=int, default=None, help="default 151936 on GPU (Qwen3), 2048 on CPU")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--logits", choices=("random", "clustered"), default="random",
                        help="draft logits: random, or with a run of favoured consecutive tokens (see LOGITS)")
    parser.add_argument("--context", type=int, default=ATTN_CTX, help="attention benchmarks: committed prefix tokens")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    parser.add_argument("--verify", action="store_true", help="check results against the Python references")
    parser.add_argument("--out", default=None, help="write JSON results here")
    args = parser.parse_args(argv)

    on_gpu = args.device.startswith("cuda")
    ATTN_CTX = args.context
    LOGITS = args.logits
    names = sorted(BENCHMARKS) if args.what == "all" else args.what.split(",")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {sorted(BENCHMARKS)}")
    batches = [int(x) for x in (args.batches or ("1,8,32,64" if on_gpu else "1,4")).split(",")]
    budgets = [int(x) for x in (args.budgets or ("16,64,128" if on_gpu else "16,64")).split(",")]
    vocab = args.vocab or (151936 if on_gpu else 2048)
    args.iters = args.iters or (50 if on_gpu else 5)
    dtype = getattr(torch, args.dtype)

    rows = []
    for name in names:
        for batch in batches:
            for budget in budgets:
                case = Case(batch, budget, args.depth, vocab, args.device, dtype)
                rows.append(run_case(name, case, args))
                print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    if args.out:
        env = {
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu",
            "argv": sys.argv[1:] if argv is None else argv,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"env": env, "results": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
