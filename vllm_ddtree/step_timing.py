"""Opt-in per-step time breakdown of DDTree decoding: where a step's milliseconds go, on the host and the device.

Set ``VLLM_DDTREE_STEP_TIMING=<directory>``; each worker process then writes ``step_timing_<pid>.json`` there every
``FLUSH_EVERY`` marks. The verifier and the proposer call ``mark(name)`` at fixed points of a step, in this order::

    prepare -> prepared -> sample -> walked -> compacted -> propose -> linearised -> build -> built -> prepare ...

and each interval between consecutive marks is reported as host time (``perf_counter``) and device-stream time
(CUDA events; on CPU equal to host time), median and mean per step (medians skip one-off costs such as graph
captures). ``built -> prepare`` is everything vLLM does between our draft and the next verify (scheduling, output
processing, input preparation up to the slot mapping); ``prepared -> sample`` is the target forward plus logits.
Off by default: then ``mark`` is one attribute test. The only host synchronisation is at a flush (every FLUSH_EVERY
marks), so timing perturbs what it measures very little.
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import time
from pathlib import Path

import torch

TIMING_ENV = "VLLM_DDTREE_STEP_TIMING"
FLUSH_EVERY = 512
ORDER = ("prepare", "prepared", "sample", "walked", "compacted", "propose", "linearised", "build", "built")
_NEXT = {a: b for a, b in zip(ORDER, ORDER[1:] + ORDER[:1], strict=True)}


class StepTimer:
    def __init__(self, device: torch.device):
        directory = os.environ.get(TIMING_ENV)
        self.enabled = bool(directory)
        self.cuda = device.type == "cuda"
        self.path = Path(directory or ".") / f"step_timing_{os.getpid()}.json"
        self.marks: list[tuple[str, float, torch.cuda.Event | None]] = []
        self.samples: dict[str, list[tuple[float, float]]] = {}  # interval -> [(host ms, device ms)] per step
        if self.enabled:
            atexit.register(self.flush)

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((name, time.perf_counter(), event))
        if len(self.marks) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if len(self.marks) < 2:
            return
        if self.cuda:
            torch.cuda.synchronize()
        for (a, ta, ea), (b, tb, eb) in zip(self.marks, self.marks[1:]):
            if _NEXT[a] != b:  # a step that skipped part of the cycle (prefill only, no drafts): not comparable
                continue
            host = (tb - ta) * 1e3
            device = ea.elapsed_time(eb) if ea is not None else host
            self.samples.setdefault(f"{a} -> {b}", []).append((host, device))
        self.marks = self.marks[-1:]
        report = {}
        for name, values in self.samples.items():
            host, device = zip(*values, strict=True)
            report[name] = {
                "host_ms_median": round(statistics.median(host), 4),
                "device_ms_median": round(statistics.median(device), 4),
                "host_ms_mean": round(statistics.fmean(host), 4),
                "device_ms_mean": round(statistics.fmean(device), 4),
                "count": len(values),
            }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(report, indent=1))


def read_reports(directory: str | os.PathLike) -> list[dict[str, dict[str, float]]]:
    """The reports of one run, one per worker process (tensor-parallel ranks report alike)."""
    return [json.loads(f.read_text()) for f in sorted(Path(directory).glob("step_timing_*.json"))]
