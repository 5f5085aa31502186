"""τ of a trained drafter in the vLLM CPU engine (``tau``): no-spec, the DFlash chain and DDTree budgets on held-out
GSM8K prompts, greedy, through the engine tests' runner (ddtree_testkit.engine_run)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ddtree_testkit.train_dflash.prompts import gsm8k_prompt_ids


def measure_tau(target_dir: Path, drafter_dir: Path, *, num_prompts: int = 20, max_tokens: int = 128,
                budgets: list[int] = (8, 32), chain_k: int | None = None, dtype: str = "float32") -> dict:
    """τ = 1 + accepted / drafts from vLLM's spec-decode metrics, on held-out GSM8K prompts, greedy."""
    os.environ.pop("TRITON_INTERPRET", None)
    from transformers import AutoTokenizer

    from ddtree_testkit.engine_run import run_engine

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = gsm8k_prompt_ids(tok, num_prompts)
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    chain_k = chain_k or int(cfg["block_size"]) - 1
    common = dict(model=str(target_dir), prompt_token_ids=prompts, max_tokens=max_tokens, dtype=dtype,
                  max_model_len=1024, max_num_batched_tokens=2048)
    runs: dict[str, Any] = {}
    t0 = time.monotonic()
    base = run_engine(**common)
    runs["no-spec"] = {"seconds": round(time.monotonic() - t0, 1)}
    specs = {f"dflash k={chain_k}": {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": chain_k}}
    for b in budgets:
        specs[f"ddtree B={b}"] = {"method": "ddtree", "model": str(drafter_dir), "num_speculative_tokens": b}
    for name, spec in specs.items():
        t0 = time.monotonic()
        r = run_engine(**common, spec=spec)
        m = r["spec_decode"]
        drafts, acc = m.get("vllm:spec_decode_num_drafts", 0), m.get("vllm:spec_decode_num_accepted_tokens", 0)
        runs[name] = {"tau": round(1 + acc / max(drafts, 1), 4), "drafts": drafts, "accepted": acc,
                      "accepted_per_pos": m.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
                      "equal_to_no_spec": r["token_ids"] == base["token_ids"],
                      "seconds": round(time.monotonic() - t0, 1)}
        print(f"[tau] {name}: τ = {runs[name]['tau']:.3f} ({acc} accepted / {drafts} drafts), "
              f"greedy equal to no-spec: {runs[name]['equal_to_no_spec']}", file=sys.stderr)
    return {"num_prompts": num_prompts, "max_tokens": max_tokens, "output_tokens": sum(map(len, base["token_ids"])),
            "runs": runs}
