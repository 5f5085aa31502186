"""Python garbage-collector pauses per engine, from the logs of a bench_e2e run with ``VLLM_GC_DEBUG=1``.

With that variable set, vLLM's engine core logs every collection ("GC took 12.345ms to complete. Collected 10
objects (out of 5000) in GC generation 2."; vllm/utils/gc_utils.py). A collection stops the engine's only thread,
so its pauses land in step times and first tokens. The question they answer (H100, 2026-12-06): ddtree's first
tokens at batch 1 are bimodal, on the same requests run after run, as collections triggered by allocation counts
would be; the chain's are not. Run bench_e2e with ``--keep-logs`` (each engine's log beside ``--out``), then:

    python benchmarks/gc_pauses.py LOG [LOG ...] [--out gc.json]

Per log: collections per generation, their total and longest pause, and how many took 5 ms or more; all of them,
then only those while serving: after start-up (vLLM's "init engine ... took" line) and before shut-down (its first
"[shutdown]" line). On an H100 (2026-12-06, fifteenth session) every engine's long pauses (four or five
generation-2 collections of 0.7-1.0 s) fell at shut-down; while serving, none took more than 19.3 ms.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GC_LINE = re.compile(r"GC took ([\d.]+)ms to complete\. Collected (\S+) objects \(out of (\d+)\) in GC generation (\d)")
LONG_MS = 5.0
STARTED = re.compile(r"init engine \(.*\) took")  # vLLM's engine core, once start-up (capture, freeze) is over
STOPPING = re.compile(r"\[shutdown\]")  # vLLM's shut-down, which unfreezes the heap and collects it


def pauses(text: str) -> list[tuple[int, float, int]]:
    """(generation, pause ms, objects examined) per logged collection, in log order."""
    return [(int(m[4]), float(m[1]), int(m[3])) for m in GC_LINE.finditer(text)]


def summarise(events: list[tuple[int, float, int]]) -> dict:
    by_generation = {}
    for generation in sorted({g for g, _, _ in events}):
        ms = [p for g, p, _ in events if g == generation]
        objects = [n for g, _, n in events if g == generation]
        by_generation[generation] = {"count": len(ms), "total_ms": round(sum(ms), 2), "max_ms": round(max(ms), 2),
                                     f"at_least_{LONG_MS:g}_ms": sum(p >= LONG_MS for p in ms),
                                     "max_objects": max(objects)}
    return {"collections": len(events), "total_ms": round(sum(p for _, p, _ in events), 2),
            "by_generation": by_generation}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = {}
    for path in args.logs:
        text = path.read_text(errors="replace")
        serving = None
        if started := STARTED.search(text):
            stopping = STOPPING.search(text, started.end())
            serving = summarise(pauses(text[started.end(): stopping.start() if stopping else len(text)]))
        report[path.name] = {**summarise(pauses(text)), "serving": serving}
    for name, entry in report.items():
        for label, part in (("", entry), (" while serving", entry["serving"])):
            if part is None:
                print(f"== {name}{label}: no start-up line (vLLM's 'init engine ... took') in the log")
                continue
            print(f"== {name}{label}: {part['collections']} collections, {part['total_ms']} ms")
            for generation, row in part["by_generation"].items():
                print(f"  generation {generation}: {row['count']:6d} collections, {row['total_ms']:9.2f} ms in all, "
                      f"longest {row['max_ms']:7.2f} ms, {row[f'at_least_{LONG_MS:g}_ms']} of {LONG_MS:g} ms or "
                      f"more, up to {row['max_objects']} objects")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
