"""Acceptance of a trained DFlash drafter in the vLLM engine: the DFlash chain vs DDTree at several node budgets.

    python benchmarks/acceptance.py --drafter fixtures/dflash-smollm2-135m-b16-l3 \\
        --budgets 8 16 32 64 128 --temperatures 0 1 --out-json out/acceptance.json --out-png out/acceptance.png

For every temperature, one engine run per configuration (``ddtree_testkit.engine_run``'s ``run_engine``: a fresh
process each, CUDA graphs on when a GPU is present, via ``VLLM_DDTREE_TEST_CUDA_GRAPHS=1``; ``--eager`` turns them
off) on the drafter trainer's held-out prompts (the first GSM8K questions and the last HumanEval tasks, chat
formatted; never trained on). Reported per configuration:

* τ = 1 + accepted / drafts (mean tokens per verify step, the bonus token included), from vLLM's spec-decode metrics;
* per-depth acceptance: the fraction of verify steps that accepted at least d drafted tokens, d = 1 .. block-1
  (vLLM's ``spec_decode_num_accepted_tokens_per_pos`` / drafts); the chain's τ is 1 + their sum.

Budgets above ``vllm_ddtree.config.MAX_TREE_BUDGET`` (128) are skipped with a note: the config refuses them (a
budget of 256 would need that cap raised and 8 x 257 tokens per step). The chain drafts ``block_size - 1`` tokens
(``--chain-k``). T > 0 runs use one seed for every request (``--seed``). The JSON is rewritten after every run, so a
timed-out sweep keeps what it measured; ``--out-png`` plots τ vs budget (chain as dashed lines) and the per-depth
acceptance (needs matplotlib; skipped with a message without it; ``--plot-only JSON`` plots a saved run later).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def heldout_prompts(target: str, num_gsm8k: int, num_humaneval: int,
                    gsm8k_start: int = 0) -> tuple[list[list[int]], list[str]]:
    """Token ids of the held-out chat prompts: GSM8K cases from ``gsm8k_start``, then the first of the held-out
    HumanEval tail (``DataOptions.heldout_humaneval`` tasks, the trainer's default)."""
    from transformers import AutoTokenizer

    from ddtree_testkit.train_dflash.prompts import chat_ids, heldout_texts

    tok = AutoTokenizer.from_pretrained(target)
    try:
        prompts = heldout_texts(num_gsm8k, num_humaneval, gsm8k_start)
    except ValueError as e:
        raise SystemExit(f"--num-humaneval: {e}") from None
    ids = [chat_ids(tok, text) for _, text in prompts]
    names = [name for name, _ in prompts]
    return ids, names


def measure(common: dict, spec: dict | None, depth: int) -> dict:
    from ddtree_testkit.engine_run import run_engine

    t0 = time.monotonic()
    r = run_engine(**common, spec=spec)
    m = r["spec_decode"]
    drafts = m.get("vllm:spec_decode_num_drafts", 0) or 0
    acc = m.get("vllm:spec_decode_num_accepted_tokens", 0) or 0
    per_pos = list(m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [])[:depth]
    return {"tau": round(1 + acc / drafts, 4) if drafts else None, "drafts": drafts, "accepted": acc,
            "accept_per_depth": [round(a / drafts, 4) for a in per_pos] if drafts else None,
            "output_tokens": sum(map(len, r["token_ids"])), "seconds": round(time.monotonic() - t0, 1),
            "token_ids": r["token_ids"]}


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[acceptance] matplotlib is not installed: no plot ({path}); pip install -r requirements/dev.txt",
              file=sys.stderr)
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for c, (temp, runs) in zip(colors, result["runs"].items()):
        pts = [(r["budget"], r["tau"]) for r in runs if r["method"] == "ddtree" and r["tau"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=c, label=f"DDTree, T={temp}")
        chain = [r for r in runs if r["method"] == "dflash" and r["tau"] is not None]
        if chain:
            ax.axhline(chain[0]["tau"], ls="--", color=c, label=f"DFlash chain k={chain[0]['k']}, T={temp}")
        for r in runs:
            if r["accept_per_depth"] and (r["method"] == "dflash" or r["budget"] in (min(result["budgets"]),
                                                                                     max(result["budgets"]))):
                name = "chain" if r["method"] == "dflash" else f"B={r['budget']}"
                ax2.plot(range(1, len(r["accept_per_depth"]) + 1), r["accept_per_depth"], color=c,
                         ls="--" if r["method"] == "dflash" else "-", marker=".", label=f"{name}, T={temp}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("DDTree node budget B")
    ax.set_ylabel("τ (tokens per verify step)")
    ax.set_title(f"{Path(result['drafter']).name} on {result['num_prompts']} held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("depth d")
    ax2.set_ylabel("P(accepted length >= d)")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"[acceptance] wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None, help="target model directory (default: offline SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", help="DFlash drafter directory (tools/train_dflash.py output; default: the "
                    "trained SmolLM2 drafter in fixtures/)")
    ap.add_argument("--plot-only", metavar="JSON", default=None,
                    help="only plot an earlier run's --out-json into --out-png (e.g. on a box with matplotlib)")
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--chain-k", type=int, default=None, help="DFlash chain drafts (default: block_size - 1)")
    ap.add_argument("--num-gsm8k", type=int, default=12)
    ap.add_argument("--gsm8k-start", type=int, default=0, help="first GSM8K case; past the trainer's "
                    "--heldout-gsm8k the prompts were not even used to pick the checkpoint (--keep-best)")
    ap.add_argument("--num-humaneval", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the T > 0 runs")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs on a GPU")
    ap.add_argument("--no-spec-baseline", action="store_true",
                    help="also run no-spec at T=0 and count outputs differing from it (bf16 GPU runs differ at "
                    "near-ties; float32 CPU runs must not)")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--out-png", default=None)
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(json.loads(Path(a.plot_only).read_text()), Path(a.out_png or Path(a.plot_only).with_suffix(".png")))
        return 0
    import torch

    from ddtree_testkit.smollm2 import smollm2_dir, trained_smollm2_drafter_dir

    a.drafter = a.drafter or str(trained_smollm2_drafter_dir())
    from vllm_ddtree.config import MAX_TREE_BUDGET

    cuda = torch.cuda.is_available()
    if cuda and not a.eager:
        os.environ["VLLM_DDTREE_TEST_CUDA_GRAPHS"] = "1"  # ddtree_testkit.engine_run: enforce_eager=False
    target = a.model or str(smollm2_dir())
    drafter = str(Path(a.drafter).resolve())
    cfg = json.loads((Path(drafter) / "config.json").read_text())
    depth = int(cfg["block_size"]) - 1
    chain_k = a.chain_k or depth
    budgets = [b for b in a.budgets if 1 <= b <= MAX_TREE_BUDGET]
    skipped = [b for b in a.budgets if b not in budgets]
    if skipped:
        print(f"[acceptance] skipping budgets {skipped}: ddtree accepts 1..{MAX_TREE_BUDGET} "
              "(vllm_ddtree.config.MAX_TREE_BUDGET)", file=sys.stderr)
    prompts, names = heldout_prompts(target, a.num_gsm8k, a.num_humaneval, a.gsm8k_start)
    max_b = max(budgets + [chain_k])
    common = dict(model=target, prompt_token_ids=prompts, max_tokens=a.max_tokens,
                  dtype=a.dtype or ("bfloat16" if cuda else "float32"), max_num_seqs=a.max_num_seqs,
                  # vLLM drafts only while the longest sequence plus a verify step plus the drafter's queries fit
                  # (GPUModelRunner._input_fits_in_drafter): leave room for two steps of 1 + B tokens.
                  max_model_len=max(len(p) for p in prompts) + a.max_tokens + 2 * (max_b + 1) + 16,
                  max_num_batched_tokens=max(2048, a.max_num_seqs * (1 + max_b) + 512))
    result = {"target": target, "drafter": drafter, "block_size": depth + 1, "budgets": budgets,
              "skipped_budgets": skipped, "max_tree_budget": MAX_TREE_BUDGET, "num_prompts": len(prompts),
              "prompts": names, "max_tokens": a.max_tokens, "dtype": common["dtype"],
              "device": "cuda" if cuda else "cpu", "cuda_graphs": cuda and not a.eager, "runs": {}}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(0)

    def save() -> None:
        if a.out_json:
            Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
            slim = {**result, "runs": {t: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs]
                                       for t, rs in result["runs"].items()}}
            Path(a.out_json).write_text(json.dumps(slim, indent=1) + "\n")

    baseline = None
    if a.no_spec_baseline:
        baseline = measure({**common, "temperature": 0.0}, None, depth)
        result["no_spec_seconds"] = baseline["seconds"]
    for temp in a.temperatures:
        runs = result["runs"].setdefault(f"{temp:g}", [])
        configs = [("dflash", chain_k, {"method": "dflash", "model": drafter, "num_speculative_tokens": chain_k})]
        configs += [("ddtree", b, {"method": "ddtree", "model": drafter, "num_speculative_tokens": b})
                    for b in budgets]
        for method, b, spec in configs:
            r = measure({**common, "temperature": temp, "seed": a.seed if temp > 0 else None}, spec, depth)
            r = {"method": method, "budget": b if method == "ddtree" else None,
                 "k": chain_k if method == "dflash" else None, "temperature": temp, **r}
            if baseline is not None and temp == 0:
                r["outputs_differing_from_no_spec"] = sum(x != y for x, y in zip(r["token_ids"],
                                                                                  baseline["token_ids"]))
            runs.append(r)
            name = f"dflash k={chain_k}" if method == "dflash" else f"ddtree B={b}"
            depth_str = " ".join(f"{x:.2f}" for x in (r["accept_per_depth"] or []))
            print(f"[acceptance] T={temp:g} {name}: τ = {r['tau']} ({r['accepted']} accepted / {r['drafts']} drafts,"
                  f" {r['seconds']} s); P(len >= d): {depth_str}", file=sys.stderr)
            save()
    print(f"\n{'T':>4} {'config':<14} {'τ':>7}  P(accepted >= d), d = 1..{depth}")
    for temp, rs in result["runs"].items():
        for r in rs:
            name = f"dflash k={r['k']}" if r["method"] == "dflash" else f"ddtree B={r['budget']}"
            tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
            print(f"{temp:>4} {name:<14} {tau:>7}  " + " ".join(f"{x:.2f}" for x in (r["accept_per_depth"] or [])))
    save()
    if a.out_png:
        plot(result, Path(a.out_png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
