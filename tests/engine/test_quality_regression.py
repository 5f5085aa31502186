"""lm-eval through a no-spec and a ddtree `vllm serve` (benchmarks/quality_regression.py on a small slice).

Greedy ddtree is lossless, so on the fp32 CPU engine every lm-eval generation (GSM8K and HumanEval through
completions, MT-Bench through chat) and so every metric must equal no-spec's, item for item.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_regression.py"
LIMIT = 6


def test_lm_eval_slice_identical_under_ddtree(tmp_path, smollm2_dir):
    out = tmp_path / "quality.json"
    cmd = [sys.executable, str(BENCH), "--limit", str(LIMIT), "--max-gen-toks", "48", "--num-concurrent", "4",
           "--dtype", "float32", "--json", str(out), "--expect-identical"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert out.exists(), f"benchmark failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    assert set(report["comparison"]) == {"gsm8k", "humaneval", "mtbench"}
    for task, cmp in report["comparison"].items():
        assert cmp["num_samples"] == LIMIT, task
        assert cmp["differences"] == [], f"{task}: greedy generations differ under ddtree"
        assert cmp["metrics_equal"], task
    for run in report["runs"].values():
        assert run["generation_tokens"] > 0
        for task in run["tasks"].values():
            assert all(m["stderr"] is not None for m in task["metrics"].values())
    assert report["runs"]["ddtree"]["drafts"] > 0, "the ddtree server never speculated"
    assert report["runs"]["ddtree"]["tau"] > 1.3, "the trained drafter (fixtures/) should accept drafts"
    assert report["runs"]["no_spec"]["drafts"] == 0
    assert proc.returncode == 0, proc.stdout[-3000:]
