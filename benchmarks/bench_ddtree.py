"""No-spec, the DFlash chain and DDTree side by side, one command: tokens/s, τ, ms/step, the tree tax, the speed-up
at the paper's τ, prefill throughput, engine start-up and DDTree's step breakdown; one table, one JSON, one PNG
(issues 6 and 19).

    python benchmarks/bench_ddtree.py                     # every workload, B 16 32 64, batch 1 8 32 64 (GPU)
    python benchmarks/bench_ddtree.py --workloads smollm2 --budgets 16 --batch-sizes 1 --max-tokens 8 --num-prompts 2
    python benchmarks/bench_ddtree.py --from-e2e benchmarks/results/h200-2026-11-29b/tax_qwen3_8b_shape.json

A thin orchestrator over ``bench_e2e.py``, run as subprocesses with ``--out JSON`` (the engines, warm-up, CUDA
graphs, capture sizes and τ are all bench_e2e's; every engine on vLLM's default runner, Model Runner V2 on GPU).
Workloads (``WORKLOADS``):

* ``smollm2``: SmolLM2-135M-Instruct and bench_e2e's default drafter (the trained one; ``--model``/``--drafter``
  override): real τ, so the ratios are speed-ups;
* ``qwen3-8b``: ``bench_e2e --shape qwen3-8b``, random in-memory weights of Qwen3-8B's shape and a random DFlash
  drafter: nothing is accepted (τ = 1), so the step-time ratio is the tree tax;
* ``qwen3-8b-paper-tau``: the same shape at the paper's acceptance (MATH-500: chain τ 7.79, DDTree 10.73) through
  synthetic acceptance (``vllm_ddtree/synthetic_acceptance.py``): the end-to-end speed-up a real pair at that τ gets;
* ``prefill-8k``: the same shape, 4 prompts of 8192 tokens, one output token each, batch 1: prefill tokens/s of each
  engine against no-spec's (a ddtree engine should prefill as no-spec does, plus its drafter's context pass).

Runs, per workload (engine starts matter: 30-125 s each on an H200 with CUDA graphs; the table's ``start s``):

* default: one bench_e2e run for the baselines (no-spec and the chain; ``--same-backend-baselines`` adds both on
  DDTree's V1 runner with TRITON_ATTN) over all batch sizes, then one bench_e2e run per batch size for the DDTree
  budgets with ``--step-timing`` (the timer aggregates over an engine's life, so a per-batch breakdown needs an engine
  per batch size): 2 + |batches| x |budgets| engines. Outputs differing from no-spec are then not compared
  (bench_e2e compares within one run; use bench_e2e for that);
* ``--shared-engines``: one bench_e2e run with everything (2 + |budgets| engines); the DDTree breakdown then mixes
  all batch sizes and is reported on every batch's row, and outputs differing from no-spec are reported.

Every number in one report comes from one invocation of this script on one machine.

Derived columns:

* ms/step = 1000 · batch · τ / (tokens/s), τ = 1 for no-spec: each verify step yields τ tokens for each of ``batch``
  requests. Approximate: tokens/s includes the prefill step (one token per request) and, when the prompt count is
  not a multiple of the batch, a last smaller group.
* × no-spec, × chain, × chain V1 = tokens/s over the no-spec / chain row's at the same batch size; "chain" is the
  DFlash chain on vLLM's default runner (as users run it: Model Runner V2 with async scheduling on GPU), "chain V1"
  the chain on the V1 runner (``dflash V1+tri`` of ``--same-backend-baselines``; else ``dflash`` when that ran on V1,
  as on CPU; saved runs may also hold ``dflash V1``).
* tax = ms/step(DDTree B) / ms/step(chain) - 1: what a step with a B-node tree costs over a chain step with
  block - 1 (15) drafts. Meaningful as "the tree tax" where τ = 1 (qwen3-8b); with real τ it is the step-cost ratio.
* start s: the engine's start-up (``LLM(...)``: weights, compilation, CUDA-graph capture), from bench_e2e.
* prefill tok/s (prefill workloads): prompt tokens per second, and its ratio to no-spec's.
* breakdown: vllm_ddtree/step_timing.py's intervals mapped to phases (PHASES below), medians over the engine's
  steps, host (perf_counter) and device-stream (CUDA events) ms; Σ is the sum of the medians (not the median step).
* GPU idle per step: not reported. The device times are CUDA-event intervals between marks on the stream; an
  interval includes any time the GPU waited for the host inside it, so it is not busy time, and host - device is
  not idle time: over complete steps both sum to the same wall time (Σ host_ms_mean ≈ Σ device_ms_mean; the JSON
  keeps both sums so this can be checked). A positive device - host in one phase means the GPU fell further behind
  the host there (GPU-bound), a negative one that it caught up. Idle time needs per-kernel busy time (a profiler).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from vllm_ddtree.cuda_graphs import capture_size_covering

ROOT = Path(__file__).resolve().parent.parent
BENCH_E2E = ROOT / "benchmarks" / "bench_e2e.py"

class Phase(NamedTuple):
    name: str
    interval: str  # step_timing's interval between two marks
    header: str  # the breakdown table's column
    what: str


# The timer's cycle (step_timing.ORDER) starts at "prepare"; listed here in the order a DDTree step runs, from the
# drafter to the next drafter hand-off.
PHASES = (
    Phase("linearise", "propose -> linearised", "linear", "drafter inputs linearised from the accepted paths"),
    Phase("draft", "linearised -> build", "draft", "DFlash drafter forward (one pass)"),
    Phase("tree_build", "build -> built", "build", "best-first tree build (graph replay at small batch)"),
    Phase("scheduler", "built -> prepare", "sched",
          "vLLM between steps: output processing, scheduling, input preparation"),
    Phase("verify_prep", "prepare -> prepared", "v-prep", "tree metadata into the static verify buffers"),
    Phase("verify", "prepared -> sample", "verify", "target forward over the trees + logits"),
    Phase("walk", "sample -> walked", "walk", "tree walk: accepted path and bonus token"),
    Phase("compaction", "walked -> compacted", "compact", "accepted K/V moved onto the path"),
    Phase("handoff", "compacted -> propose", "handoff", "accepted path handed to the drafter"),
)
# The paper's τ for Qwen3-8B on MATH-500 (arXiv:2604.12989): the DFlash chain and DDTree.
PAPER_TAU_CHAIN, PAPER_TAU_TREE = 7.79, 10.73
PREFILL_TOKENS, PREFILL_PROMPTS = 8192, 4  # the prefill-8k workload: 4 prompts of 8192 tokens
# bench_e2e arguments per workload. The 8B shape runs random weights: at τ = 1 (nothing accepted) the step-time ratio
# is the tree tax; at the paper's τ through synthetic acceptance it is the speed-up a real pair at that τ would see.
WORKLOADS = {
    "smollm2": [],
    "qwen3-8b": ["--shape", "qwen3-8b"],
    "qwen3-8b-paper-tau": ["--shape", "qwen3-8b", "--synthetic-acceptance-length", str(PAPER_TAU_CHAIN),
                           str(PAPER_TAU_TREE)],
    "prefill-8k": ["--shape", "qwen3-8b", "--prefill-tokens", str(PREFILL_TOKENS)],
}
BASELINES = ("no-spec", "dflash")
SAME_BACKEND_BASELINES = ("no-spec V1+tri", "dflash V1+tri")  # --same-backend-baselines: DDTree's V1 + TRITON_ATTN
CONFIG_ORDER = ("no-spec", "dflash", "no-spec V1+tri", "dflash V1+tri", "dflash V1")
DEFAULT_CAPTURE = 512  # vLLM 0.26.0's largest default CUDA graph, in tokens
GPU_IDLE_NOTE = (
    "not reported: step_timing's device times are CUDA-event intervals between marks; they include time the GPU "
    "waited for the host, so host - device is not idle time (over whole steps both sum to the same wall time: "
    "compare step_host_ms_mean_sum with step_device_ms_mean_sum). Idle time needs per-kernel busy time (a profiler).")


# ------------------------------------------------------------------------------------------------ pure functions
def ms_per_step(tokens_per_s: float | None, tau: float | None, batch: int) -> float | None:
    """Milliseconds per engine step: each step yields τ tokens (1 without speculation) for each of ``batch``
    requests, so step time = batch · τ / tokens_per_s."""
    if not tokens_per_s:
        return None
    return 1000.0 * batch * (tau or 1.0) / tokens_per_s


def budget_of(config: str) -> int | None:
    """The node budget of a DDTree configuration name ("ddtree B=64 async" -> 64), None for the rest."""
    m = re.match(r"ddtree B=(\d+)", config)
    return int(m.group(1)) if m else None


def phase_breakdown(report: dict | None) -> dict | None:
    """One step_timing report ({"a -> b": {host_ms_median, ...}}) as {phase: {host_ms, device_ms, count}}, in step
    order, plus the sums: ``_sum`` of the medians, ``_mean_sum`` of the means. Missing intervals are left out."""
    if not report:
        return None
    out = {}
    for phase in PHASES:
        v = report.get(phase.interval)
        if v:
            out[phase.name] = {"host_ms": v["host_ms_median"], "device_ms": v["device_ms_median"], "count": v["count"]}
    unknown = sorted(set(report) - {phase.interval for phase in PHASES})
    if unknown:  # the timer grew a mark this mapping does not know: keep it visible rather than drop it
        out.update({k: {"host_ms": report[k]["host_ms_median"], "device_ms": report[k]["device_ms_median"],
                        "count": report[k]["count"]} for k in unknown})
    out["_sum"] = {"host_ms": round(sum(v["host_ms"] for v in out.values()), 4),
                   "device_ms": round(sum(v["device_ms"] for v in out.values()), 4)}
    out["_mean_sum"] = {"host_ms": round(sum(v.get("host_ms_mean", 0.0) for v in report.values()), 4),
                        "device_ms": round(sum(v.get("device_ms_mean", 0.0) for v in report.values()), 4)}
    return out


def chain_v1_config(rows: dict[tuple[str, int], dict]) -> str | None:
    """Which chain row ran on DDTree's runner: the V1 + TRITON_ATTN chain, else the V1 chain, else the default
    chain when it ran on V1 (CPU)."""
    names = {config for config, _ in rows}
    for name in ("dflash V1+tri", "dflash V1"):
        if name in names:
            return name
    if any(config == "dflash" and row.get("model_runner") == "V1" for (config, _), row in rows.items()):
        return "dflash"
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _tax(ms: float | None, chain_ms: float | None) -> float | None:
    return round(ms / chain_ms - 1.0, 4) if ms and chain_ms else None


def _sort_key(row: dict) -> tuple:
    config = row["config"]
    if config in CONFIG_ORDER:
        return row["workload"], row["batch"], CONFIG_ORDER.index(config), 0, config
    return row["workload"], row["batch"], len(CONFIG_ORDER), budget_of(config) or 0, config


def largest_graph(capture_sizes: str | None, verify_tokens: int) -> int:
    """The largest CUDA graph (tokens) of an engine run with bench_e2e's ``--capture-sizes`` choice (at least, for
    "shared": the largest of every configuration's): "auto" raises vLLM's largest size onto its grid to cover the
    verify step; "vllm" (and runs from before that option) keeps vLLM's 512; a list captures its own sizes."""
    if capture_sizes in ("auto", "shared"):
        return max(DEFAULT_CAPTURE, capture_size_covering(verify_tokens))
    if capture_sizes in (None, "vllm"):
        return DEFAULT_CAPTURE
    return max(int(x) for x in capture_sizes.split(","))


def workload_of(meta: dict) -> str:
    """A saved bench_e2e run's workload (the key of WORKLOADS it was run with)."""
    if meta.get("prefill_tokens"):
        return "prefill-8k" if meta["prefill_tokens"] == PREFILL_TOKENS else f"prefill-{meta['prefill_tokens']}"
    shape = meta.get("shape") or "smollm2"
    return f"{shape}-paper-tau" if meta.get("synthetic_acceptance_length") else shape


def rows_from_e2e(workload: str, results: list[dict]) -> list[dict]:
    """Report rows for one workload from bench_e2e ``--out`` JSONs ({"meta", "table"}) of one invocation of this
    script. A configuration's step timing covers every batch size it ran in that bench_e2e run (its engine's whole
    life): ``breakdown_batches`` says which."""
    table: dict[tuple[str, int], dict] = {}
    timing: dict[tuple[str, int], tuple[dict | None, list[int]]] = {}
    graphs = False  # CUDA graphs: on GPU unless --eager (vLLM's CPU engine has none)
    capture_sizes = None
    for result in results:
        meta = result.get("meta") or {}
        graphs = graphs or (meta.get("device", "cpu") != "cpu" and not meta.get("eager"))
        capture_sizes = meta.get("capture_sizes", capture_sizes)
        batches: dict[str, list[int]] = {}
        for t in result.get("table", []):
            batches.setdefault(t["config"], []).append(t["batch"])
        reports = meta.get("step_timing") or {}
        for t in result.get("table", []):
            key = (t["config"], t["batch"])
            table[key] = t
            per_process = reports.get(t["config"]) or []
            # Tensor-parallel ranks report alike; the first process stands for the step.
            timing[key] = (per_process[0] if per_process else None, sorted(batches[t["config"]]))
    chain_v1 = chain_v1_config(table)
    rows = []
    for (config, batch), t in table.items():
        ms = ms_per_step(t["tokens_per_s"], t["tau"], batch)
        ref = {name: table.get((name, batch)) for name in ("no-spec", "dflash")}
        ref["chain_v1"] = table.get((chain_v1, batch)) if chain_v1 else None
        ref_ms = {k: ms_per_step(r["tokens_per_s"], r["tau"], batch) if r else None for k, r in ref.items()}
        is_tree = budget_of(config) is not None
        report, timed_batches = timing[(config, batch)]
        breakdown = phase_breakdown(report) if is_tree else None
        row = {
            "workload": workload, "config": config, "batch": batch,
            "tokens_per_s": t["tokens_per_s"], "tau": t["tau"],
            "ms_per_step": round(ms, 3) if ms else None,
            "vs_no_spec": _ratio(t["tokens_per_s"], ref["no-spec"] and ref["no-spec"]["tokens_per_s"]),
            "vs_chain": _ratio(t["tokens_per_s"], ref["dflash"] and ref["dflash"]["tokens_per_s"]),
            "vs_chain_v1": _ratio(t["tokens_per_s"], ref["chain_v1"] and ref["chain_v1"]["tokens_per_s"]),
            "tax_vs_chain": _tax(ms, ref_ms["dflash"]) if is_tree else None,
            "tax_vs_chain_v1": _tax(ms, ref_ms["chain_v1"]) if is_tree else None,
            "chain_v1_config": chain_v1,
            "model_runner": t.get("model_runner"), "async_scheduling": t.get("async_scheduling"),
            "outputs_differing_from_no_spec": t.get("outputs_differing_from_no_spec"), "prompts": t.get("prompts"),
            "engine_start_s": t.get("engine_start_s"),
            "prefill_tokens_per_s": t.get("prefill_tokens_per_s"), "prefill_vs_no_spec": t.get("prefill_vs_no_spec"),
        }
        if is_tree:
            tokens = batch * (1 + budget_of(config))
            row.update({
                "verify_tokens_per_step": tokens,
                "over_cuda_graph_capture": tokens > largest_graph(capture_sizes, tokens) if graphs else None,
                "breakdown": breakdown, "breakdown_batches": timed_batches if breakdown else None,
                "step_host_ms_median_sum": breakdown["_sum"]["host_ms"] if breakdown else None,
                "step_device_ms_median_sum": breakdown["_sum"]["device_ms"] if breakdown else None,
                "step_host_ms_mean_sum": breakdown["_mean_sum"]["host_ms"] if breakdown else None,
                "step_device_ms_mean_sum": breakdown["_mean_sum"]["device_ms"] if breakdown else None,
                "gpu_idle_ms": None,
            })
        rows.append(row)
    return sorted(rows, key=_sort_key)


def projected_speedup(tax: float | None) -> float | None:
    """DDTree over the chain for a real Qwen3-8B pair: the paper's τ ratio over this step-cost ratio (1 + tax)."""
    return None if tax is None else round(PAPER_TAU_TREE / PAPER_TAU_CHAIN / (1 + tax), 3)


def budget_schedule(rows: list[dict], workload: str) -> list[list[int]] | None:
    """The adaptive budget these measurements call for: per measured batch size the fixed budget with the most
    tokens/s, as vLLM's ``num_speculative_tokens_per_batch_size`` ([[first batch, last batch, budget], ...]; each
    measured batch size covers the sizes down to the previous one, and vLLM carries the last budget beyond it).
    Adjacent ranges with the same budget merge. None without fixed-budget DDTree rows."""
    best: dict[int, tuple[float, int]] = {}
    for row in rows:
        budget = budget_of(row["config"])
        # fixed budgets on the default scheduling only: "ddtree B=64 async"/"... kernel-eager"/"... MRV2" differ
        if row["workload"] != workload or budget is None or row["config"] != f"ddtree B={budget}":
            continue
        if row["tokens_per_s"] and (row["batch"] not in best or row["tokens_per_s"] > best[row["batch"]][0]):
            best[row["batch"]] = (row["tokens_per_s"], budget)
    schedule: list[list[int]] = []
    first = 1
    for batch in sorted(best):
        budget = best[batch][1]
        if schedule and schedule[-1][2] == budget:
            schedule[-1][1] = batch
        else:
            schedule.append([first, batch, budget])
        first = batch + 1
    return schedule or None


def _fmt(value, spec: str = "") -> str:
    if value is None:
        return "-"
    if spec == "%":
        return f"{value * 100:+.0f}%"
    return format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The report: one line per (workload, batch, configuration), then DDTree's step breakdown."""
    head = (f"{'workload':18s} {'config':20s} {'batch':>5s} {'tok/s':>9s} {'tau':>6s} {'ms/step':>8s} "
            f"{'x no-spec':>9s} {'x chain':>8s} {'x chainV1':>9s} {'tax':>6s} {'taxV1':>6s} {'start s':>7s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("prefill_tokens_per_s"):  # prefill workloads: prompt tokens per second instead of decode
            lines.append(f"{r['workload']:18s} {r['config']:20s} {r['batch']:5d} prefill "
                         f"{_fmt(r['prefill_tokens_per_s'], '.0f')} tok/s, x no-spec "
                         f"{_fmt(r['prefill_vs_no_spec'], '.3f')}, start {_fmt(r.get('engine_start_s'), '.0f')} s")
            continue
        lines.append(
            f"{r['workload']:18s} {r['config']:20s} {r['batch']:5d} {_fmt(r['tokens_per_s'], '9.1f'):>9s} "
            f"{_fmt(r['tau'], '.3f'):>6s} {_fmt(r['ms_per_step'], '.2f'):>8s} {_fmt(r['vs_no_spec'], '.3f'):>9s} "
            f"{_fmt(r['vs_chain'], '.3f'):>8s} {_fmt(r['vs_chain_v1'], '.3f'):>9s} "
            f"{_fmt(r.get('tax_vs_chain'), '%'):>6s} {_fmt(r.get('tax_vs_chain_v1'), '%'):>6s} "
            f"{_fmt(r.get('engine_start_s'), '.0f'):>7s}"
            + ("  (verify steps past the largest CUDA graph: eager)" if r.get("over_cuda_graph_capture") else ""))
    timed = [r for r in rows if r.get("breakdown")]
    if timed:
        lines += ["", "DDTree step breakdown, median ms per step, host/device (Σ: sum of the medians; "
                  "ms/step: from tokens/s)"]
        head = f"{'workload':18s} {'config':20s} {'batch':>5s} " + " ".join(
            f"{phase.header:>11s}" for phase in PHASES) + f" {'Σ':>11s} {'ms/step':>8s}  timed batches"
        lines += [head, "-" * len(head)]
        for r in timed:
            b = r["breakdown"]
            cells = [f"{b[p]['host_ms']:.2f}/{b[p]['device_ms']:.2f}" if p in b else "-"
                     for p in (phase.name for phase in PHASES)]
            cells.append(f"{b['_sum']['host_ms']:.2f}/{b['_sum']['device_ms']:.2f}")
            lines.append(f"{r['workload']:18s} {r['config']:20s} {r['batch']:5d} "
                         + " ".join(f"{c:>11s}" for c in cells)
                         + f" {_fmt(r['ms_per_step'], '.2f'):>8s}  {','.join(map(str, r['breakdown_batches']))}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ orchestration
def build_runs(args: argparse.Namespace) -> list[dict]:
    """The bench_e2e invocations of one report: {"workload", "tag", "argv" (after bench_e2e.py), "out"}."""
    runs = []
    out_dir = Path(args.out).with_suffix("")  # out/bench_ddtree.json -> raw runs in out/bench_ddtree/
    baselines = BASELINES + (SAME_BACKEND_BASELINES if args.same_backend_baselines else ())
    for workload in args.workloads:
        common = list(WORKLOADS[workload])
        if workload == "smollm2":
            common += ["--model", args.model] if args.model else []
            common += ["--drafter", args.drafter] if args.drafter else []
        prefill = workload.startswith("prefill")
        for flag, value in (("--max-tokens", None if prefill else args.max_tokens),
                            ("--num-prompts", PREFILL_PROMPTS if prefill else args.num_prompts),
                            ("--prompt-set", None if prefill else args.prompt_set),
                            ("--max-model-len", None if prefill else args.max_model_len),
                            ("--capture-sizes", args.capture_sizes)):
            if value is not None:
                common += [flag, str(value)]
        common += ["--budgets", *map(str, args.budgets)]
        tree = [f"ddtree B={b}" for b in args.budgets] + ([f"ddtree B={b} async" for b in args.budgets]
                                                           if args.async_ab else [])
        tree_flags = ["--step-timing"] + (["--async-ab"] if args.async_ab else [])
        if args.tree_budgets:
            common += ["--tree-budgets", *map(str, args.tree_budgets)]
            tree.append("ddtree cost-aware")
        for flag, name in (("--ddtree-default", "ddtree default"), ("--chain-fallback", "ddtree chain fallback")):
            if getattr(args, flag[2:].replace("-", "_")):
                common.append(flag)
                tree.append(name)
        same_backend = ["--same-backend-baselines"] if args.same_backend_baselines else []
        batches = [str(b) for b in args.batch_sizes]
        if prefill:  # one request at a time; the step breakdown is the decode step's, not wanted here
            runs.append({"workload": workload, "tag": "all", "argv": common + [
                "--batch-sizes", "1", *same_backend, "--configs", ",".join(baselines + tuple(tree))]})
        elif args.shared_engines:
            runs.append({"workload": workload, "tag": "all", "argv": common + [
                "--batch-sizes", *batches, *same_backend, *tree_flags, "--configs", ",".join(baselines + tuple(tree))]})
        else:
            runs.append({"workload": workload, "tag": "baselines", "argv": common + [
                "--batch-sizes", *batches, *same_backend, "--configs", ",".join(baselines)]})
            runs += [{"workload": workload, "tag": f"ddtree_b{b}", "argv": common + [
                "--batch-sizes", b, *tree_flags, "--configs", ",".join(tree)]} for b in batches]
    for run in runs:
        run["out"] = str(out_dir / f"{run['workload']}_{run['tag']}.json")
        run["argv"] += ["--out", run["out"]]
    return runs


def report(runs: list[dict]) -> list[dict]:
    """Rows of every workload from the bench_e2e JSONs that exist so far."""
    rows = []
    for workload in dict.fromkeys(r["workload"] for r in runs):
        results = [json.loads(Path(r["out"]).read_text()) for r in runs
                   if r["workload"] == workload and Path(r["out"]).is_file()]
        rows += rows_from_e2e(workload, results)
    return rows


def write_png(rows: list[dict], path: str | Path) -> bool:
    """Per workload: tokens/s vs batch for every configuration, and DDTree's ms/step by phase (host medians,
    stacked) with the measured ms/step (●) and the chains' (– default runner, × V1). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        print(f"[bench_ddtree] matplotlib is not installed: no PNG ({path}); pip install matplotlib",
              file=sys.stderr)
        return False
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(14, 4.5 * len(workloads)), squeeze=False)
    for (ax_tps, ax_ms), workload in zip(axes, workloads):
        wrows = [r for r in rows if r["workload"] == workload]
        for config in dict.fromkeys(r["config"] for r in wrows):
            pts = sorted((r["batch"], r["tokens_per_s"]) for r in wrows if r["config"] == config)
            ax_tps.plot(*zip(*pts), marker="o", linestyle="--" if budget_of(config) is None else "-", label=config)
        batches = sorted({r["batch"] for r in wrows})
        ax_tps.set_xscale("log", base=2)
        ax_tps.set_xticks(batches, [str(b) for b in batches])
        ax_tps.set(yscale="log", xlabel="batch", ylabel="tokens/s", title=f"{workload}: tokens/s")
        ax_tps.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax_tps.yaxis.set_minor_formatter(NullFormatter())
        ax_tps.xaxis.set_minor_formatter(NullFormatter())
        ax_tps.legend(fontsize=7)
        trees = [r for r in wrows if budget_of(r["config"]) is not None]
        labels = [f"{r['config'].replace('ddtree ', '')}\nb={r['batch']}" for r in trees]
        x = range(len(trees))
        bottom = [0.0] * len(trees)
        for phase in (p.name for p in PHASES):
            h = [(r.get("breakdown") or {}).get(phase, {}).get("host_ms", 0.0) for r in trees]
            if any(h):
                ax_ms.bar(x, h, bottom=bottom, label=phase)
                bottom = [a + b for a, b in zip(bottom, h)]
        ax_ms.scatter(x, [r["ms_per_step"] or 0 for r in trees], color="black", zorder=3, label="ms/step")
        by_key = {(r["config"], r["batch"]): r for r in wrows}
        v1 = trees[0]["chain_v1_config"] if trees else None
        for marker, name in (("_", "dflash"), ("x", v1 if v1 != "dflash" else None)):
            ys = [(by_key.get((name, r["batch"])) or {}).get("ms_per_step") for r in trees]
            if name and any(ys):
                ax_ms.scatter(x, [y or float("nan") for y in ys], marker=marker, s=200, color="red", zorder=3,
                              label=f"{name} ms/step")
        ax_ms.set_xticks(list(x), labels, fontsize=7)
        ax_ms.set(ylabel="ms per step", title=f"{workload}: DDTree step, host medians by phase")
        ax_ms.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--model", help="smollm2 workload: the target (default: bench_e2e's, SmolLM2-135M)")
    parser.add_argument("--drafter", help="smollm2 workload: the DFlash drafter (default: bench_e2e's)")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--prompt-set", choices=["chat", "heldout"])
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--async-ab", action="store_true", help="also every budget with async scheduling")
    parser.add_argument("--tree-budgets", type=int, nargs="+", help="also 'ddtree cost-aware' (tree_budgets: each "
                        "step's budget among these from live acceptance and step time), e.g. 16 32 64")
    parser.add_argument("--ddtree-default", action="store_true", help="also 'ddtree default' (no budget given: "
                        "ddtree chooses, the cost-aware budget on Model Runner V2)")
    parser.add_argument("--chain-fallback", action="store_true", help="also 'ddtree chain fallback' (the cost-aware "
                        "budget over --tree-budgets, default 16 32 64, and the DFlash chain)")
    parser.add_argument("--capture-sizes", help="bench_e2e's --capture-sizes (its default 'auto': vLLM's list, the "
                        "largest size raised to cover every verify step)")
    parser.add_argument("--same-backend-baselines", action="store_true", help="also no-spec and the chain on DDTree's "
                        "V1 runner with TRITON_ATTN (separates kernel rounding from DDTree when outputs differ)")
    parser.add_argument("--shared-engines", action="store_true", help="one bench_e2e run per workload for all "
                        "batch sizes: fewer engine starts, but the step breakdown mixes the batch sizes")
    parser.add_argument("--out", default="out/bench_ddtree.json", help="the report's JSON; bench_e2e's JSONs go "
                        "next to it, in a folder of the same name")
    parser.add_argument("--png", default=None, help="default: --out with .png")
    parser.add_argument("--dry-run", action="store_true", help="print the bench_e2e commands and stop")
    parser.add_argument("--resume", action="store_true", help="skip the bench_e2e runs an earlier invocation with the "
                        "same --out finished (a report longer than one device call: repeat the command)")
    parser.add_argument("--from-e2e", nargs="+", metavar="JSON", help="no engines: tabulate saved bench_e2e "
                        "--out JSONs, e.g. one run's out/bench_ddtree/*.json (grouped by workload: the --shape, "
                        "else smollm2; give files of one run only, ratios must not cross runs)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    png = args.png or str(Path(args.out).with_suffix(".png"))
    meta = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "ms_per_step": "1000 * batch * tau / tokens_per_s (tau = 1 without speculation)",
            "tax": "ms_per_step(ddtree B) / ms_per_step(chain) - 1",
            "phases": {p.name: {"interval": p.interval, "what": p.what} for p in PHASES}, "gpu_idle": GPU_IDLE_NOTE}

    if args.from_e2e:
        by_workload: dict[str, list[dict]] = {}
        meta["runs"] = []
        for path in args.from_e2e:
            result = json.loads(Path(path).read_text())
            workload = workload_of(result.get("meta") or {})
            by_workload.setdefault(workload, []).append(result)
            meta["runs"].append({"workload": workload, "out": path, "meta": _meta_without_timing(result)})
        rows = [row for workload, results in by_workload.items()
                for row in rows_from_e2e(workload, results)]
        return _finish(rows, meta, args.out, png)

    runs = build_runs(args)
    if args.dry_run:
        for run in runs:
            print(" ".join([sys.executable, str(BENCH_E2E.relative_to(ROOT)), *map(_quote, run["argv"])]))
        return 0
    meta["runs"] = []
    failed = []
    for run in runs:
        cmd = [sys.executable, str(BENCH_E2E), *run["argv"]]
        done = Path(run["out"]).with_suffix(".done")
        if args.resume and done.is_file():
            print(f"[bench_ddtree] {run['workload']} {run['tag']}: done by an earlier call (--resume)", flush=True)
            meta["runs"].append({**run, "rc": 0, "seconds": float(done.read_text() or 0), "resumed": True,
                                 "meta": _meta_without_timing(json.loads(Path(run["out"]).read_text()))})
            continue
        print(f"\n[bench_ddtree] {run['workload']} {run['tag']}: {' '.join(map(_quote, cmd))}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode  # bench_e2e prints its own tables as it goes
        seconds = round(time.perf_counter() - start, 1)
        if rc == 0:
            done.write_text(str(seconds))
        print(f"[bench_ddtree] {run['workload']} {run['tag']}: exit {rc} after {seconds} s", flush=True)
        if rc:
            failed.append(f"{run['workload']} {run['tag']}")
        out = Path(run["out"])
        meta["runs"].append({**run, "rc": rc, "seconds": seconds,
                             "meta": _meta_without_timing(json.loads(out.read_text())) if out.is_file() else None})
        # Rewrite the report after every run: a run cut short by a time limit keeps what it measured.
        _write_json(report(runs), meta, args.out)
    rc = _finish(report(runs), meta, args.out, png)
    if failed:
        print(f"[bench_ddtree] failed (partly or wholly): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return rc


def _meta_without_timing(result: dict) -> dict:
    return {k: v for k, v in (result.get("meta") or {}).items() if k != "step_timing"}


def _write_json(rows: list[dict], meta: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _finish(rows: list[dict], meta: dict, out: str, png: str) -> int:
    print()
    print(format_table(rows))
    shaped = [r for r in rows if r["workload"] == "qwen3-8b" and budget_of(r["config"]) is not None]  # τ = 1
    if shaped:
        print(f"\nprojected speed-up over the chain with the paper's τ ({PAPER_TAU_TREE} vs {PAPER_TAU_CHAIN}) and "
              "these step costs:")
    for r in shaped:
        r["projected_vs_chain_paper_tau"] = projected_speedup(r.get("tax_vs_chain"))
        r["projected_vs_chain_v1_paper_tau"] = projected_speedup(r.get("tax_vs_chain_v1"))
        print(f"  {r['workload']} {r['config']} batch {r['batch']}: x{_fmt(r['projected_vs_chain_paper_tau'], '.2f')}"
              f" vs the chain, x{_fmt(r['projected_vs_chain_v1_paper_tau'], '.2f')} vs the chain on V1")
    meta["budget_schedule"] = {}
    for workload in sorted({row["workload"] for row in rows}):
        schedule = budget_schedule(rows, workload)
        if schedule:
            meta["budget_schedule"][workload] = schedule
            print(f"\nadaptive budget for {workload} (best fixed budget per batch size): "
                  f'"num_speculative_tokens": {max(e[2] for e in schedule)}, '
                  f'"num_speculative_tokens_per_batch_size": {json.dumps(schedule)}')
    _write_json(rows, meta, out)
    print(f"\nGPU idle per step: {GPU_IDLE_NOTE}")
    print(f"[bench_ddtree] JSON: {out}")
    if rows and write_png(rows, png):
        print(f"[bench_ddtree] PNG: {png}")
    return 0 if rows else 1


def _quote(s: str) -> str:
    return f'"{s}"' if any(c in s for c in " ,") else s


if __name__ == "__main__":
    sys.exit(main())
