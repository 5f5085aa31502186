"""The shape of the trees a drafter builds: what a tree kernel that runs each request's nodes one after another pays.

Runs the CPU engine (float32, eager) with SmolLM2-135M and the trained DFlash drafter in `fixtures/` on held-out
prompts, records every step's draft logits (DDTreeProposer's ``draft_logits_hook`` seam), builds the trees the
engine built, and reports per budget: nodes, leaves, internal nodes (with children), depth, and the parent-state
reloads the GatedDeltaNet tree kernel makes, in best-first (pop) order as today, in depth-first order, and with
the leaves deferred to the leaf kernel (`vllm_ddtree/hybrid/tree_gdn.py`: the main kernel then runs only the
internal nodes). Prints a table, writes JSON and a PNG.

    .venv/bin/python benchmarks/tree_shapes.py --budgets 16 64 --num-prompts 4 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tree_stats(parents: list[int]) -> dict:
    """One tree's counts (sequence-relative ``parents``, root -1)."""
    n = len(parents)
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(parents[i], []).append(i)
    order, stack = [], [0]
    while stack:  # depth-first, children in pop order
        u = stack.pop()
        order.append(u)
        stack.extend(sorted(children.get(u, []), reverse=True))
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    internal = [i for i in range(n) if i in children]
    return {
        "nodes": n, "leaves": n - len(internal), "internal": len(internal), "depth": max(depth),
        "reloads_pop": sum(1 for i in range(1, n) if parents[i] != i - 1),
        "reloads_dfs": sum(1 for j in range(1, n) if parents[order[j]] != order[j - 1]),
        "reloads_deferred": sum(1 for j in range(1, len(internal)) if parents[internal[j]] != internal[j - 1]),
    }


def measure(budget: int, num_prompts: int, max_tokens: int) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    from ddtree_testkit.smollm2 import smollm2_dir
    from ddtree_testkit.train_dflash.prompts import gsm8k_prompt_ids
    from vllm_ddtree.tree.build import build_tree
    from vllm_ddtree.tree.layout import TreeBatch
    from vllm_ddtree.v1.proposer import DDTreeProposer

    logits_seen = []
    DDTreeProposer.draft_logits_hook = lambda proposer, logits: logits_seen.append(logits.float().cpu()) or logits
    try:
        llm = LLM(model=str(smollm2_dir()), dtype="float32", max_model_len=1024, enforce_eager=True, max_num_seqs=4,
                  kv_cache_memory_bytes=1 << 30,
                  speculative_config={"method": "ddtree", "model": str(REPO / "fixtures/dflash-smollm2-135m-b16-l3"),
                                      "num_speculative_tokens": budget})
        prompts = [{"prompt_token_ids": ids} for ids in gsm8k_prompt_ids(llm.get_tokenizer(), num_prompts)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    finally:
        DDTreeProposer.draft_logits_hook = None
    rows = []
    for logits in logits_seen:
        tree = TreeBatch.allocate(logits.shape[0], budget, "cpu")
        build_tree(logits, budget, tree, torch.zeros(logits.shape[0], dtype=torch.int64))
        rows += [tree_stats(p) for p in tree.parents.tolist()]
    mean = {k: round(sum(r[k] for r in rows) / len(rows), 2) for k in rows[0]}
    return {"budget": budget, "trees": len(rows), "mean": mean}


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[tree_shapes] matplotlib is not installed: no plot ({path})", file=sys.stderr)
        return
    keys = ["nodes", "internal", "reloads_pop", "reloads_dfs", "reloads_deferred"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(result["runs"])
    for j, run in enumerate(result["runs"]):
        ax.bar([i + j * width for i in range(len(keys))], [run["mean"][k] for k in keys], width,
               label=f"B={run['budget']} ({run['trees']} trees)")
    ax.set_xticks([i + width * (len(result["runs"]) - 1) / 2 for i in range(len(keys))], keys)
    ax.set_ylabel("per tree (mean)")
    ax.set_title("trees of the trained SmolLM2 drafter: sequential work of the GDN tree kernel")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=REPO / "out/tree_shapes.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the hook must run in this process
    result = {"runs": [measure(b, a.num_prompts, a.max_tokens) for b in a.budgets],
              "num_prompts": a.num_prompts, "max_tokens": a.max_tokens}
    cols = ["nodes", "leaves", "internal", "depth", "reloads_pop", "reloads_dfs", "reloads_deferred"]
    print(f"{'B':>4} {'trees':>6} " + " ".join(f"{c:>16}" for c in cols))
    for run in result["runs"]:
        print(f"{run['budget']:>4} {run['trees']:>6} " + " ".join(f"{run['mean'][c]:>16}" for c in cols))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    plot(result, a.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
