"""Per-kernel device time of decode steps, inside CUDA graphs: what a DDTree step pays that the chain's does not.

``bench_e2e.py --profile-dir DIR`` runs each configuration's engine in its own process (vLLM's engine core in the
same process, so the profiler sees the GPU) and, after the warm-up pass, profiles the timed pass of every batch size
with the torch profiler (CUPTI records the kernels a CUDA graph replays, one by one). Each run writes
``DIR/<config>.b<batch>.json``: kernel name -> total device µs and launches, the steps profiled, the window's wall
time. This module then compares the runs, per decode step:

    python benchmarks/kernel_profile.py DIR [--base dflash] [--top 25] [--out DIR/compare.json]

prints, per batch size, every configuration's device time per step by kernel class and the kernels whose time per
step differs most from the base configuration's. Kernels are classed by name (``KERNEL_CLASSES``); a name can sit in
one class only, first match wins.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# (class, pattern on the kernel name), first match wins.
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("tree attention (ours)", r"_tree_attn_kernel|_merge_splits_kernel"),
    ("flash attention", r"flash|fmha|FlashAttn"),
    ("triton attention (vLLM)", r"unified_attention|kernel_unified"),
    ("tree build / walk / rows (ours)", r"_prepare_rows|_linearise_rows|_kv_compact|_tree_|walk|ancestor"),
    ("top-k / sort", r"topk|TopK|sort|Sort|radix|bitonic"),
    ("gemm", r"gemm|GEMM|nvjet|cutlass|xmma|sm90|cublas|Kernel2"),
    ("softmax / sampling", r"softmax|Softmax|argmax|gumbel|sample|logsumexp|reduce_kernel"),
    ("norm / rope / activation", r"rms_norm|rotary|silu|act_and_mul|fused_add|layer_norm"),
    ("copy / fill / elementwise", r"elementwise|copy|Copy|fill|index|scatter|gather|cat|memcpy|memset"),
)


GEMMS = "gemm (all matrix-product kernels)"


def kernel_class(name: str) -> str:
    for cls, pattern in KERNEL_CLASSES:
        if re.search(pattern, name):
            return cls
    return "other"


class Profiler:
    """Wraps one timed pass; ``result(steps)`` aggregates the CUDA kernels it ran."""

    def __init__(self):
        import torch

        self._torch = torch
        self._cuda = torch.cuda.is_available()
        activity = torch.profiler.ProfilerActivity
        self._prof = torch.profiler.profile(activities=[activity.CUDA] if self._cuda else [activity.CPU])
        self._start = None

    def __enter__(self):
        import time

        if self._cuda:
            self._torch.cuda.synchronize()
        self._start = time.perf_counter()
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        import time

        if self._cuda:
            self._torch.cuda.synchronize()
        self.wall_s = time.perf_counter() - self._start
        self._prof.__exit__(*exc)
        return False

    def result(self, steps: int) -> dict:
        kernels: dict[str, list[float]] = {}
        for evt in self._prof.events():
            if evt.device_type != self._torch.autograd.DeviceType.CUDA:
                continue
            name = evt.name[:160]
            entry = kernels.setdefault(name, [0.0, 0])
            entry[0] += evt.device_time  # µs
            entry[1] += 1
        return {"steps": steps, "wall_ms": self.wall_s * 1e3,
                "kernels": {k: {"us": round(v[0], 2), "count": v[1]} for k, v in kernels.items()}}


def load_runs(directory: Path) -> dict[int, dict[str, dict]]:
    """{batch: {config: run}} from ``<config>.b<batch>.json`` files."""
    runs: dict[int, dict[str, dict]] = {}
    for path in sorted(directory.glob("*.b*.json")):
        match = re.fullmatch(r"(.+)\.b(\d+)\.json", path.name)
        if not match:
            continue
        run = json.loads(path.read_text())
        runs.setdefault(int(match.group(2)), {})[run.get("config", match.group(1))] = run
    return runs


def per_step(run: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(µs per step by kernel class, µs per step by kernel name)."""
    steps = max(run["steps"], 1)
    by_name = {name: k["us"] / steps for name, k in run["kernels"].items()}
    by_class: dict[str, float] = {}
    for name, us in by_name.items():
        cls = kernel_class(name)
        by_class[cls] = by_class.get(cls, 0.0) + us
    return by_class, by_name


def collapse_gemms(by_name: dict[str, float]) -> dict[str, float]:
    """Matrix-product kernels summed into one entry: cuBLAS picks other kernels for 17 rows than for 16, so per name
    they swap places by milliseconds while their sum moves by microseconds."""
    out: dict[str, float] = {}
    for name, us in by_name.items():
        key = GEMMS if kernel_class(name) == "gemm" else name
        out[key] = out.get(key, 0.0) + us
    return out


def launches_per_step(run: dict) -> dict[str, float]:
    """Kernel launches per step by class: at batch 1 each one costs a few µs of a graph replay whatever it does."""
    steps = max(run["steps"], 1)
    counts: dict[str, float] = {}
    for name, k in run["kernels"].items():
        cls = kernel_class(name)
        counts[cls] = counts.get(cls, 0.0) + k["count"] / steps
    return counts


def compare(runs: dict[int, dict[str, dict]], base: str, top: int) -> dict:
    report = {}
    for batch, configs in sorted(runs.items()):
        classes = sorted({c for cls in (per_step(r)[0] for r in configs.values()) for c in cls})
        table = {}
        for config, run in configs.items():
            by_class, _ = per_step(run)
            table[config] = {
                "device_ms_per_step": round(sum(by_class.values()) / 1e3, 3),
                "wall_ms_per_step": round(run["wall_ms"] / max(run["steps"], 1), 3),
                "steps": run["steps"],
                "classes_us": {c: round(by_class.get(c, 0.0), 1) for c in classes},
                "launches_per_step": {c: round(n, 1) for c, n in launches_per_step(run).items()},
            }
        diffs = {}
        if base in configs:
            _, base_names = per_step(configs[base])
            for config, run in configs.items():
                if config == base:
                    continue
                _, names = per_step(run)
                names, base_collapsed = collapse_gemms(names), collapse_gemms(base_names)
                delta = {n: names.get(n, 0.0) - base_collapsed.get(n, 0.0) for n in set(names) | set(base_collapsed)}
                ranked = sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]
                diffs[config] = [{"kernel": n, "delta_us": round(d, 1), "class": kernel_class(n),
                                  "us": round(names.get(n, 0.0), 1), "base_us": round(base_collapsed.get(n, 0.0), 1)}
                                 for n, d in ranked]
        report[batch] = {"configs": table, "largest_differences_from_base": diffs, "base": base}
    return report


def print_report(report: dict) -> None:
    for batch, entry in report.items():
        configs = entry["configs"]
        names = list(configs)
        print(f"\n== batch {batch}: device µs per decode step by kernel class (base {entry['base']})")
        print(f"{'class':34s}" + "".join(f"{n[:16]:>17s}" for n in names))
        classes = next(iter(configs.values()))["classes_us"].keys() if configs else []
        for cls in classes:
            print(f"{cls:34s}" + "".join(f"{configs[n]['classes_us'].get(cls, 0.0):17.1f}" for n in names))
        print(f"{'device ms / step':34s}" + "".join(f"{configs[n]['device_ms_per_step']:17.3f}" for n in names))
        print(f"{'kernel launches / step':34s}"
              + "".join(f"{sum(configs[n]['launches_per_step'].values()):17.1f}" for n in names))
        print(f"{'wall ms / step':34s}" + "".join(f"{configs[n]['wall_ms_per_step']:17.3f}" for n in names))
        print(f"{'steps profiled':34s}" + "".join(f"{configs[n]['steps']:17d}" for n in names))
        for config, rows in entry["largest_differences_from_base"].items():
            print(f"-- {config} minus {entry['base']}, µs per step (largest first)")
            for r in rows:
                print(f"  {r['delta_us']:+9.1f}  ({r['base_us']:8.1f} -> {r['us']:8.1f})  [{r['class']}] "
                      f"{r['kernel'][:100]}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--base", default="dflash", help="configuration the others are compared with")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = compare(load_runs(args.directory), args.base, args.top)
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
