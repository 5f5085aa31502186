"""Concurrent streaming load on a ddtree `vllm serve` with a tiny KV cache (benchmarks/load_test.py, CI-sized).

Mixed lengths, greedy and seeded T > 0 requests, some cut off mid-stream, preemption forced by 32 KV blocks: the
server must see no other error, end idle with its KV cache empty, keep serving, and greedy outputs must equal a
no-spec server's under the same load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"


def test_ddtree_server_under_concurrent_load(tmp_path, tiny_llama_dir, tiny_llama_dflash_dir):
    out = tmp_path / "load.json"
    spec = {"method": "ddtree", "num_speculative_tokens": 8}
    cmd = [sys.executable, str(BENCH), "--target", str(tiny_llama_dir), "--drafter", str(tiny_llama_dflash_dir),
           "--spec", json.dumps(spec), "--clients", "8", "--requests", "24", "--max-tokens", "40",
           "--abort-frac", "0.15", "--num-gpu-blocks", "32", "--max-model-len", "512", "--timeout", "240",
           "--json", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.exists(), f"load test failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    report = json.loads(out.read_text())
    ddtree, no_spec = report["runs"]["ddtree"], report["runs"]["no_spec"]
    assert ddtree["errors"] == [] and no_spec["errors"] == []
    assert ddtree["aborted"] > 0 and ddtree["served"] + ddtree["aborted"] == 24
    assert ddtree["preemptions"] > 0, "32 KV blocks were meant to force preemption"
    assert ddtree["tau"] is not None, "the ddtree server never speculated"
    for run in (ddtree, no_spec):
        assert run["kv_usage_after"] == 0 and run["running_after"] == 0 and run["waiting_after"] == 0
        assert run["serves_after"]
    assert ddtree["greedy_outputs"], "the workload had no completed greedy request"
    assert ddtree["greedy_outputs"] == no_spec["greedy_outputs"]
    assert proc.returncode == 0 and all(report["checks"].values()), proc.stdout[-3000:]
