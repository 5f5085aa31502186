"""Where the engine's host time goes, from py-spy's samples of whole bench_e2e runs (``gpu_session.sh hostprofile``).

At batch 1 a DDTree step's wall time exceeds its device time by more than the chain's (H200, 2026-12-02, Qwen3-8B
shape: 1.01 ms against 0.70 ms per step), and on the SmolLM2 pair B=16's step costs more than B=64's although it
does less device work: the host decides there. ``py-spy record --format raw`` writes one line per distinct stack
(frames joined by ';', outermost first, then the sample count); this script reads one such file per configuration
and prints, per configuration, the samples inside the decode loop's functions (inclusive: a stack counts once per
function it passes through) and the functions with the most samples of their own:

    python benchmarks/host_profile.py DIR [--top 30] [--out DIR/host_profile.json]

DIR holds ``<config>.txt``. Only samples under ``LOOP_ROOT`` (the engine core's step) count, so engine start-up and
compilation stay out. Where bench_e2e's ``<config>.json`` lies beside it, each share is also given in ms per engine
step (the share times the run's ms per step; py-spy runs with ``--idle``, so waits for the GPU count too).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

# py-spy 0.4 qualifies methods with their class ("EngineCore.step_with_batch_queue (vllm/v1/engine/core.py:663)").
QUALIFIED = r"^(?:\w+\.)*"
LOOP_ROOT = re.compile(QUALIFIED + r"(step|step_with_batch_queue) \(.*engine/core\.py")
# Frames of interest, inclusive (function name and a path fragment).
WATCHED = (
    ("vllm_ddtree (all)", r"vllm_ddtree/"),
    ("scheduler", QUALIFIED + r"schedule \(.*scheduler\.py"),
    ("execute_model", QUALIFIED + r"execute_model \(.*gpu/model_runner\.py"),
    ("sample_tokens", QUALIFIED + r"sample_tokens \(.*gpu/model_runner\.py"),
    ("prepare_inputs", QUALIFIED + r"prepare_inputs \(.*gpu/model_runner\.py"),
    ("speculator propose", QUALIFIED + r"propose \(.*spec_decode"),
    ("rejection / tree sampler", QUALIFIED + r"__call__ \(.*(rejection_sampler|mrv2/sampler)\.py"),
    ("triton launches", QUALIFIED + r"run \(.*triton/runtime/jit\.py"),
    ("cuda graph replay", QUALIFIED + r"replay \(.*torch/cuda/graphs\.py"),
    ("output processing", r"output_processor\.py|process_outputs"),
)


def read_folded(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks.append((frames.split(";"), int(count)))
    return stacks


def in_loop(frames: list[str]) -> list[str] | None:
    """The frames from the engine step down, or None for samples outside the decode loop."""
    for i, frame in enumerate(frames):
        if LOOP_ROOT.search(frame):
            return frames[i:]
    return None


def summarise(stacks: list[tuple[list[str], int]], top: int) -> dict:
    loop_total, watched, own, inclusive = 0, Counter(), Counter(), Counter()
    for frames, count in stacks:
        frames = in_loop(frames)
        if frames is None:
            continue
        loop_total += count
        own[frames[-1]] += count
        for label, pattern in WATCHED:
            if any(re.search(pattern, f) for f in frames):
                watched[label] += count
        for name in {f for f in frames if "vllm_ddtree/" in f}:
            inclusive[name] += count
    share = (lambda n: round(100.0 * n / loop_total, 1)) if loop_total else (lambda n: 0.0)
    return {
        "loop_samples": loop_total,
        "watched_pct": {label: share(watched[label]) for label, _ in WATCHED},
        "ours_inclusive_pct": {name: share(n) for name, n in inclusive.most_common(top)},
        "self_pct": {name: share(n) for name, n in own.most_common(top)},
    }


def bench_ms_per_step(path: Path) -> float | None:
    """The run's ms per engine step from bench_e2e's JSON (its first row), None without one."""
    if not path.exists():
        return None
    table = json.loads(path.read_text()).get("table") or [{}]
    return table[0].get("ms_per_step")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = {}
    for path in sorted(args.directory.glob("*.txt")):
        report[path.stem] = entry = summarise(read_folded(path), args.top)
        entry["ms_per_step"] = bench_ms_per_step(path.with_suffix(".json"))
    for config, entry in report.items():
        ms = entry["ms_per_step"]
        print(f"\n== {config}: {entry['loop_samples']} samples in the engine step"
              + (f"; {ms:.2f} ms per step (bench_e2e)" if ms else ""))
        for title, key in (("inclusive, % of the step's samples", "watched_pct"),
                           ("vllm_ddtree functions, inclusive %", "ours_inclusive_pct"),
                           ("own samples (self) %", "self_pct")):
            print(f"-- {title}" + (", ms per step" if ms else ""))
            for name, pct in entry[key].items():
                print(f"  {pct:6.1f}" + (f" {pct * ms / 100:6.3f}" if ms else "") + f"  {name[:140]}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
