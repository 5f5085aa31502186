"""Continuations from vLLM's offline ``LLM`` (``--generator vllm``), in a subprocess so that its GPU memory is free
again for the HF feature pass. This module is also that subprocess: ``python -m
ddtree_testkit.train_dflash.vllm_generation JOB OUT``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _vllm_worker(job_path: str, out_path: str) -> None:
    """Subprocess body of ``generate_vllm``: one offline ``LLM``, every request at once, token ids to JSON."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = {}
    if cuda and not job["enforce_eager"]:  # graphs for every decode batch size up to max_num_seqs
        kw["compilation_config"] = {"max_cudagraph_capture_size": job["max_num_seqs"]}
    llm = LLM(model=job["target"], dtype="bfloat16" if cuda else "float32", seed=job["seed"],
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=max(8192, job["max_model_len"]),
              gpu_memory_utilization=job["gpu_memory_utilization"] if cuda else 0.1,
              enforce_eager=job["enforce_eager"] or not cuda, disable_log_stats=True, **kw)
    params = [SamplingParams(n=r["n"], temperature=r["temperature"], top_p=1.0, seed=r["seed"],
                             max_tokens=job["max_new_tokens"]) for r in job["requests"]]
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in job["requests"]], params, use_tqdm=cuda)
    res = [[list(o.token_ids) for o in sorted(out.outputs, key=lambda o: o.index)] for out in outs]
    n_tok = sum(len(t) for r in res for t in r)
    print(f"[data] vLLM generated {n_tok} tokens in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    Path(out_path).write_text(json.dumps(res))


def generate_vllm(target_dir: Path, requests: list[dict], *, max_new_tokens: int, seed: int, max_model_len: int,
                  max_num_seqs: int = 512, gpu_memory_utilization: float = 0.5,
                  enforce_eager: bool = False) -> list[list[list[int]]]:
    """Continuations from vLLM's offline ``LLM`` (run in a subprocess, so its GPU memory is free again for the HF
    feature pass). ``requests``: ``{"prompt", "n", "temperature", "seed"}``; returns per request its ``n``
    continuations (token ids, EOS included, as ``generate_with_features`` keeps them)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"target": str(target_dir), "requests": requests, "max_new_tokens": max_new_tokens,
                                   "seed": seed, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                                   "gpu_memory_utilization": gpu_memory_utilization,
                                   "enforce_eager": enforce_eager}))
        env = {**os.environ}
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.run([sys.executable, "-m", __name__, str(job), str(out)], env=env)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"vLLM generation failed (exit {proc.returncode})")
        return json.loads(out.read_text())


if __name__ == "__main__":
    _vllm_worker(sys.argv[1], sys.argv[2])
