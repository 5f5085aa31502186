"""Where a request's first engine steps spend their time, from the Chrome traces of ``bench_e2e.py --trace-dir``.

On the SmolLM2 pair every ddtree engine, the fixed B=64 too, took about 10 ms more than the chain from a request's
scheduling to its first token (H100, 2026-12-06, medians 20.5-22.9 against 10.3 ms at batch 1); on the Qwen3-8B
shape it no longer did. The pair's steps are short and host-bound, so the time is host work, and a sampling
profiler over whole runs (``host_profile.py``) cannot single out one step per request. ``--trace-dir`` runs a few
requests one at a time under vLLM's torch profiler with Python frames; this script cuts each engine's trace at
vLLM's per-step annotation (``execute_context_<prefills>..._generation_<decodes>...``) and reports, per step kind
(the prefill step, the first decode step after it, the later decode steps), the host period from one step's start to
the next, the device time and count of its kernels, the CUDA API calls its host made (launches of kernels, graphs
and Triton kernels; copies; waits, whose duration a blocking one shows), and the Python functions with the most time
inside those periods, inclusive and self, against the base configuration. Launches and waits tell what Python
frames do not: the default engine pinned to the chain took 0.3-0.8 ms a step more than vLLM's chain engine at every
batch size on the pair (H100, 2026-12-08), where the step is host-bound:

    python benchmarks/trace_steps.py DIR [--base dflash] [--top 20] [--out DIR/trace_steps.json]

DIR holds one folder per configuration (``bench_e2e``'s slug of its name), each with the worker's
``*.pt.trace.json[.gz]``.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"execute_context_(\d+)")  # vLLM's annotation of each execute_model (gpu_worker.annotate_profile)
KINDS = ("prefill", "first decode", "later decode")
# The CUDA API calls the profiler records on the host: launches (a kernel, a graph, a Triton kernel through the
# driver), copies and waits. A blocking call (a synchronize, a copy to pageable memory) shows as its duration.
RUNTIME = ("cuda_runtime", "cuda_driver")
ADDRESS = re.compile(r" (?:object )?at 0x[0-9a-f]+")  # built-ins are named by address: differs between engines


def load_events(path: Path) -> list[dict]:
    """The complete ("X") events of one Chrome trace, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def engine_steps(events: list[dict]) -> list[dict]:
    """vLLM's step annotations in time order, each with its kind and its period (start to the next step's start;
    the last step has none, so it is dropped)."""
    marks = sorted((e for e in events if e.get("cat") == "user_annotation" and STEP.match(e["name"])),
                   key=lambda e: e["ts"])
    steps, previous = [], None
    for e, nxt in zip(marks, marks[1:]):
        prefill = int(STEP.match(e["name"])[1]) > 0
        kind = "prefill" if prefill else ("first decode" if previous == "prefill" else "later decode")
        steps.append({"kind": kind, "start": e["ts"], "end": nxt["ts"], "period_us": nxt["ts"] - e["ts"]})
        previous = kind
    return steps


def python_times(events: list[dict]) -> list[tuple[str, float, float, float]]:
    """(function, start us, inclusive us, self us) of every Python frame: self time is the frame's duration less
    its direct children's on the same thread."""
    frames = sorted((e for e in events if e.get("cat") == "python_function"),
                    key=lambda e: (e.get("pid"), e.get("tid"), e["ts"], -e["dur"]))
    out, stack = [], []  # stack: [event, children us]
    for e in frames:
        while stack and (stack[-1][0].get("tid") != e.get("tid") or stack[-1][0].get("pid") != e.get("pid")
                         or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
            done, children = stack.pop()
            out.append(_frame(done, children))
        if stack:
            stack[-1][1] += e["dur"]
        stack.append([e, 0.0])
    out += [_frame(done, children) for done, children in stack]
    return out


def _frame(event: dict, children_us: float) -> tuple[str, float, float, float]:
    return ADDRESS.sub("", event["name"]), event["ts"], event["dur"], event["dur"] - children_us


def summarise(events: list[dict], top: int) -> dict:
    """Per step kind: steps, median period and kernel time (ms), and the functions' mean ms per step. Kernels and
    Python frames count in the step they start in."""
    steps = engine_steps(events)
    starts = [s["start"] for s in steps]

    def step_of(ts: float) -> dict | None:
        i = bisect.bisect_right(starts, ts) - 1
        return steps[i] if i >= 0 and ts < steps[i]["end"] else None

    device = defaultdict(float)  # step start -> kernel us
    kernels = defaultdict(int)  # step start -> kernels
    runtime_calls = {kind: defaultdict(int) for kind in KINDS}
    runtime_us = {kind: defaultdict(float) for kind in KINDS}
    for e in events:
        if (step := step_of(e["ts"])) is None:
            continue
        if e.get("cat") == "kernel":
            device[step["start"]] += e["dur"]
            kernels[step["start"]] += 1
        elif e.get("cat") in RUNTIME:
            runtime_calls[step["kind"]][e["name"]] += 1
            runtime_us[step["kind"]][e["name"]] += e["dur"]
    inclusive = {kind: defaultdict(float) for kind in KINDS}
    own = {kind: defaultdict(float) for kind in KINDS}
    for name, ts, incl, self_us in python_times(events):
        if (step := step_of(ts)) is not None:
            own[step["kind"]][name] += self_us
            inclusive[step["kind"]][name] += incl  # a recursive function counts each of its frames: rare in a step
    report = {}
    for kind in KINDS:
        windows = [s for s in steps if s["kind"] == kind]
        if not windows:
            continue
        n = len(windows)
        report[kind] = {
            "steps": n,
            "period_ms": round(statistics.median(w["period_us"] for w in windows) / 1e3, 3),
            "device_ms": round(statistics.median(device[w["start"]] for w in windows) / 1e3, 3),
            "kernels": statistics.median(kernels[w["start"]] for w in windows),
            "launches": round(sum(c for f, c in runtime_calls[kind].items() if "Launch" in f) / n, 1),
            "runtime_calls": {f: round(c / n, 2) for f, c in runtime_calls[kind].items()},
            "runtime_ms": _per_step(runtime_us[kind], n, top * 4),
            "inclusive_ms": _per_step(inclusive[kind], n, top * 4),
            "self_ms": _per_step(own[kind], n, top * 4),
        }
    return report


def _per_step(total_us: dict[str, float], steps: int, keep: int) -> dict[str, float]:
    """The ``keep`` largest totals as ms per step."""
    return {k: round(v / steps / 1e3, 3) for k, v in sorted(total_us.items(), key=lambda kv: -kv[1])[:keep]}


def differences(report: dict, base: str, kind: str, key: str, top: int) -> dict[str, list[tuple[str, float]]]:
    """Per configuration, the functions whose ms per step of this kind differ most from the base's."""
    if kind not in report.get(base, {}):
        return {}
    ref = report[base][kind][key]
    out = {}
    for name, entry in report.items():
        if name == base or kind not in entry:
            continue
        mine = entry[kind][key]
        deltas = {f: round(mine.get(f, 0.0) - ref.get(f, 0.0), 3) for f in set(mine) | set(ref)}
        out[name] = sorted(deltas.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]  # ties by name
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--base", default="dflash", help="configuration the others are compared with")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = {}
    for folder in sorted(p for p in args.directory.iterdir() if p.is_dir()):
        traces = sorted(folder.rglob("*.json*"))
        if traces:
            report[folder.name] = summarise([e for t in traces for e in load_events(t)], args.top)
    print(f"{'config':24s} {'step':13s} {'steps':>5s} {'period ms':>9s} {'device ms':>9s} {'kernels':>7s} "
          f"{'launches':>8s}")
    for name, entry in report.items():
        for kind, row in entry.items():
            print(f"{name:24s} {kind:13s} {row['steps']:5d} {row['period_ms']:9.3f} {row['device_ms']:9.3f} "
                  f"{row['kernels']:7.0f} {row['launches']:8.1f}")
    for kind in KINDS:
        for key in ("inclusive_ms", "self_ms", "runtime_calls", "runtime_ms"):
            for name, deltas in differences(report, args.base, kind, key, args.top).items():
                print(f"\n{name} against {args.base}, {kind} step, {key.replace('_', ' ')} per step (+ more):")
                for function, delta in deltas:
                    print(f"  {delta:+8.3f}  {function[:150]}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
