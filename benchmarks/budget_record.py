"""Which budget the cost-aware policy ran when, and why, from the engine core's step record
(``VLLM_DDTREE_BUDGET_RECORD=<directory>``; vllm_ddtree/scheduler.py).

The shut-down summary gives each choice's final estimates and step count, but not how the choice moved: on the
SmolLM2 pair at batch 5-8 B=32 took 450 of 683 steps while the final estimates put B=64 31% ahead (H100,
2026-12-07), and steps around a change of budget read dearer than steps between two of one budget. This reads the
record and reports, per batch bucket and choice: steps, runs (consecutive steps at one budget) and their median
length, the median interval after a step of the same budget against after a change, the timed steps' median (what
the policy's estimate holds), and why the policy chose it (explore, probe, best); then, per bucket, the stretches in
which one choice was the policy's best, with the estimates it saw as each began; then, per group of requests that
started together, its steps at the full batch and in the tail after its first request finished:

    python benchmarks/budget_record.py DIR_OR_FILES... [--out budget_record.json] [--png budget_record.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from vllm_ddtree.budget_policy import batch_bucket, bucket_range


def bucket_label(batch_size: int) -> str:
    """The policy's batch bucket of a batch size, as its range: 1, 2, 3-4, 5-8, ..."""
    return bucket_range(batch_bucket(batch_size))


def rows(record: dict, table: str) -> list[dict]:
    """The record's ``"steps"`` or ``"decisions"`` as dicts keyed by their columns."""
    columns = record["columns" if table == "steps" else "decision_columns"]
    return [dict(zip(columns, row)) for row in record.get(table, [])]


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def choice_table(record: dict) -> dict[str, dict[int, dict]]:
    """Per bucket and budget, over verify-only steps: steps, runs, median run length, median ms after a step of the
    same budget / after a change, median of the timed intervals, and the decisions by reason."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    runs: dict[tuple[str, int], list[int]] = defaultdict(list)
    previous = None
    for row in rows(record, "steps"):
        if not row["verify_only"]:
            previous = None
            continue
        key = (bucket_label(row["batch_size"]), row["budget"])
        cell = out[key[0]].setdefault(key[1], {"steps": 0, "same": [], "change": [], "timed": []})
        cell["steps"] += 1
        continued = previous == key  # a run: steps of one budget at one batch bucket
        if continued:
            runs[key][-1] += 1
        else:
            runs[key].append(1)
        if row["ms_since_last_output"] is not None and previous is not None:
            cell["same" if continued else "change"].append(row["ms_since_last_output"])
        if row["timed"]:
            cell["timed"].append(row["ms_since_last_output"])
        previous = key
    why: dict[tuple[str, int], Counter] = defaultdict(Counter)
    for d in rows(record, "decisions"):
        why[(bucket_label(d["batch_size"]), d["budget"])][d["why"]] += 1
    for bucket, cells in out.items():
        for budget, cell in cells.items():
            lengths = runs[(bucket, budget)]
            cell.update(runs=len(lengths), median_run=_median(lengths),
                        ms_after_same=_median(cell.pop("same")), ms_after_change=_median(cell.pop("change")),
                        ms_timed=_median(cell.pop("timed")), why=dict(why[(bucket, budget)]))
    return dict(out)


def best_stretches(record: dict) -> dict[str, list[dict]]:
    """Per bucket, the stretches of decisions in which one choice was the policy's best (probes inside a stretch
    do not end it), each with its first decision's step, its length and the tokens/ms and acceptance it saw."""
    budgets = record["budgets"]
    out: dict[str, list[dict]] = defaultdict(list)
    for d in rows(record, "decisions"):
        if d["why"] != "best":
            continue
        stretches = out[bucket_label(d["batch_size"])]
        if stretches and stretches[-1]["budget"] == d["budget"]:
            stretches[-1]["decisions"] += 1
            continue
        stretches.append({"budget": d["budget"], "from_step": d["step"], "decisions": 1,
                          "tokens_per_ms": dict(zip(budgets, d["tokens_per_ms"])),
                          "accepted": dict(zip(budgets, d["accepted"]))})
    return dict(out)


def group_table(record: dict) -> list[dict]:
    """Per group of requests that started together (bench_e2e's groups: one step prefills them all, with no drafts):
    its size, the interval that ended at that prefill's output (with the idle time before it), and its decode steps
    split into those at the full batch (their total and median interval) and the tail after its first request
    finished (every batch bucket below), with the budgets the tail ran. On the small pair a tail took 44-60% of a
    batch-32 / 64 group's decode time (H100, 2026-12-07), in the chain engine too (2026-12-08); and one engine's
    full-batch steps moved by up to 1.8x from one batch-32 group to the next (medians 7.5 and 4.1 ms), so groups
    compare by their medians, engines over several groups."""
    groups: list[dict] = []
    for row in rows(record, "steps"):
        if not row["verify_only"] and row["budget"] == 0 and row["batch_size"] > 0:
            if not groups or groups[-1]["steps"]:  # a prefill starts a group (a chunked one: the first chunk)
                groups.append({"size": row["batch_size"], "prefill_ms": row["ms_since_last_output"], "steps": []})
            continue
        if groups and row["verify_only"]:
            groups[-1]["steps"].append(row)
    out = []
    for group in groups:
        full = [r for r in group["steps"] if r["batch_size"] >= group["size"]]
        tail = [r for r in group["steps"] if r["batch_size"] < group["size"]]
        out.append({"size": group["size"], "prefill_ms": group["prefill_ms"], "full_steps": len(full),
                    "full_ms": _total_ms(full), "full_median_ms": _median(
                        [r["ms_since_last_output"] for r in full if r["ms_since_last_output"] is not None]),
                    "tail_steps": len(tail), "tail_ms": _total_ms(tail),
                    "tail_budgets": dict(Counter(r["budget"] for r in tail))})
    return out


def _total_ms(steps: list[dict]) -> float:
    return round(sum(r["ms_since_last_output"] or 0.0 for r in steps), 1)


def load(paths: list[Path]) -> list[tuple[str, dict]]:
    files = [f for p in paths for f in (sorted(p.glob("budget_record_*.json")) if p.is_dir() else [p])]
    return [(f.name, json.loads(f.read_text())) for f in files]


def label(record: dict, budget: int) -> str:
    return "chain" if budget == record.get("chain") else f"B={budget}"


def report(name: str, record: dict, table: dict, stretches: dict, top: int, groups: list[dict]) -> str:
    lines = [f"## {name}: {len(record['steps'])} step outputs, {len(record.get('decisions', []))} decisions",
             "| batch | choice | steps | runs | median run | ms after same | ms after change | ms timed | why |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for bucket in sorted(table, key=lambda b: int(b.split("-")[0])):
        for budget in sorted(table[bucket]):
            c = table[bucket][budget]
            why = ", ".join(f"{k} {v}" for k, v in sorted(c["why"].items()))
            lines.append(f"| {bucket} | {label(record, budget)} | {c['steps']} | {c['runs']} | {c['median_run']} | "
                         f"{c['ms_after_same']} | {c['ms_after_change']} | {c['ms_timed']} | {why} |")
    for bucket in sorted(stretches, key=lambda b: int(b.split("-")[0])):
        shown = stretches[bucket]
        lines.append(f"batch {bucket}: {len(shown)} stretches of one best choice"
                     + (f" (the {top} longest)" if len(shown) > top else ""))
        for s in sorted(shown, key=lambda s: -s["decisions"])[:top]:
            seen = ", ".join(f"{label(record, b)} {r:.3f}" for b, r in s["tokens_per_ms"].items() if r is not None)
            lines.append(f"  from step {s['from_step']}: {label(record, s['budget'])} for {s['decisions']} decisions;"
                         f" tokens/ms seen: {seen}")
    if groups:
        lines += ["", "| group | size | prefill ms | full-batch steps | ms | median ms | tail steps | ms | "
                      "tail share | tail budgets |", "| ---: " * 9 + "| --- |"]
        for i, g in enumerate(groups):
            total = g["full_ms"] + g["tail_ms"]
            budgets = ", ".join(f"{label(record, b)} {n}" for b, n in sorted(g["tail_budgets"].items()))
            lines.append(f"| {i} | {g['size']} | {g['prefill_ms']} | {g['full_steps']} | {g['full_ms']} | "
                         f"{g['full_median_ms']} | {g['tail_steps']} | {g['tail_ms']} | "
                         f"{g['tail_ms'] / total if total else 0:.2f} | {budgets} |")
    return "\n".join(lines)


def plot(records: list[tuple[str, dict]], path: Path) -> None:
    """Each record's chosen budget over its step outputs (verify-only steps), one panel per record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), 1, figsize=(10, 2.5 * len(records)), squeeze=False)
    for ax, (name, record) in zip(axes[:, 0], records):
        verified = [r for r in rows(record, "steps") if r["verify_only"]]
        ax.scatter([r["step"] for r in verified], [r["budget"] for r in verified],
                   c=[r["batch_size"] for r in verified], s=2, cmap="viridis")
        ax.set_yscale("log", base=2)
        ax.set_yticks(record["budgets"], [label(record, b) for b in record["budgets"]])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step output")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="budget_record_*.json files or directories holding them")
    parser.add_argument("--top", type=int, default=8, help="stretches shown per bucket, the longest")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    records = load(args.paths)
    if not records:
        raise SystemExit(f"no budget_record_*.json under {[str(p) for p in args.paths]}")
    results = {}
    for name, record in records:
        table, stretches, groups = choice_table(record), best_stretches(record), group_table(record)
        print(report(name, record, table, stretches, args.top, groups) + "\n")
        results[name] = {"choices": table, "best_stretches": stretches, "groups": groups}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.png:
        plot(records, args.png)


if __name__ == "__main__":
    main()
