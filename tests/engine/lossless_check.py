"""The teacher-forced lossless check of DDTree on a hybrid target: every verified node's logits against the same
tokens fed to the target plainly, within a tolerance measured on vLLM's own chain.

vLLM runs GatedDeltaNet layers in bfloat16 on the CPU (and FLA's GPU prefill refuses float32), where a multi-token
verify rounds differently from a one-token decode or a prefill: no speculative method equals no-spec token for token
there, and comparing greedy outputs tests only where the first near-tie falls. Instead:

1. ``teacher``: seeded random continuations S (``seeded_teacher``); every run is teacher-forced onto S
   (teacher_forcing.py), so the committed tokens, the trees (the seeded oracle drafter) and the accepted paths are
   the same on every machine. Not the target's own greedy output: that costs an engine run (2.5 minutes on the
   H200 with CUDA graphs) and depends on the machine's bf16 near-ties, and any S tests the same thing.
2. ``subject``: DDTree records the logits of every tree row, with its tree (parents) and depth position.
3. ``calibration``: vLLM's DFlash chain records the logits of every verify row (root and drafts: each a path verified
   as a chain) in the same way.
4. ``reference``: for every recorded row, the tokens it saw (the committed context, then its root path) as the prompt
   of a plain no-spec prefill; its last-token logits are the row's reference.

A row's deviation is the largest absolute logit difference from its reference on a fixed vocabulary subset. The
tolerance is the chain's largest deviation times ``TOLERANCE_FACTOR``: bf16 noise of the same kinds of kernels on
the same machine. A node continuing from a wrong state (wrong parent, missing relayout) deviates by a change of
context, tens of times more (``DeviationReport.separation`` measures that scale on the references themselves).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from teacher_forcing import TEACHER_ENV

from ddtree_testkit.engine_run import run_engine

TEACHER_SITE = Path(__file__).with_name("teacher_site")
ORACLE_ENV = "VLLM_DDTREE_TEST_ORACLE"
TOLERANCE_FACTOR = 4.0
Tokens = tuple[int, ...]
# A directory that keeps every finished engine run of the recipe (GPU sessions: a 10-minute device call fits two of
# its 3-4 minute runs on the H200, so the phase is repeated and the next call reuses them). Unset: every run runs.
RUN_CACHE_ENV = "VLLM_DDTREE_TEST_RUN_CACHE"
# What else decides a run's output: the engine process's environment (gpu_session.sh) and the code.
RUN_ENV_KEYS = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_DDTREE_TEST_ATTENTION_BACKEND", "VLLM_DDTREE_TEST_CUDA_GRAPHS",
                "VLLM_DDTREE_TEST_ASYNC_SCHEDULING")
ROOT = Path(__file__).resolve().parents[2]
GPU_KV_CACHE_BYTES = 1 << 30  # the tiny targets' runs need a few MiB of it
T = TypeVar("T")
RUN_CODE = [ROOT / "vllm_ddtree", ROOT / "patches", TEACHER_SITE, Path(__file__).with_name("teacher_forcing.py")]


@dataclass
class Recording:
    """What teacher_forcing.Recorder saved: one entry per sampled row (lists), logits on ``subset``."""

    rows: dict[str, list]
    prompts: list[Tokens]
    logits: torch.Tensor
    subset: torch.Tensor | None

    def __len__(self) -> int:
        return len(self.rows["token"])

    def path_keys(self, teacher: dict[Tokens, list[int]]) -> list[Tokens | None]:
        """Per row, the tokens the target saw up to it: the teacher sequence before the request's first row of the
        step, then the row's root path (its parents' tokens and its own). None for rows outside the teacher run
        (prefill chunks before the last prompt token)."""
        keys: list[Tokens | None] = []
        first = 0  # index of the current request-step's first row
        for i in range(len(self)):
            if self.rows["row"][i] == 0:
                first = i
            sequence = teacher[self.prompts[self.rows["prompt"][i]]]
            start = self.rows["position"][first]
            if start < len(self.prompts[self.rows["prompt"][i]]) - 1:
                keys.append(None)
                continue
            path, node = [], self.rows["row"][i]
            while node >= 0:
                path.append(self.rows["token"][first + node])
                node = self.rows["parent"][first + node]
            keys.append(tuple(sequence[:start]) + tuple(reversed(path)))
        return keys

    def depths(self) -> list[int]:
        """Per row, its depth below the request-step's first row, from the recorded parents."""
        out, first = [], 0
        for i in range(len(self)):
            if self.rows["row"][i] == 0:
                first = i
            depth, node = 0, self.rows["row"][i]
            while self.rows["parent"][first + node] >= 0:
                node, depth = self.rows["parent"][first + node], depth + 1
            out.append(depth)
        return out


def load_recording(path: str | os.PathLike) -> Recording:
    data = torch.load(path, weights_only=False)
    return Recording(data["rows"], [tuple(p) for p in data["prompts"]], data["logits"], data["subset"])


def hybrid_args(model: Path, **extra) -> dict:
    """Engine arguments of every run: bf16 (vLLM's CPU GDN layers run nothing else), float32 recurrent state, no
    prefix caching of recurrent state (DDTree refuses it on hybrids), text only (the prompts are token ids; no
    vision encoder to build and profile at each of the recipe's engine starts). On a GPU a fixed KV cache, so that
    runs can start side by side (``concurrently``)."""
    gpu = {"kv_cache_memory_bytes": GPU_KV_CACHE_BYTES} if torch.cuda.is_available() else {}
    return dict(model=str(model), dtype="bfloat16", mamba_ssm_cache_dtype="float32", enable_prefix_caching=False,
                ignore_eos=True, text_only=True, **gpu, **extra)


def concurrently(*calls: Callable[[], T]) -> list[T]:
    """Each call's result, in order. On a GPU the engine runs start side by side: an engine start there is mostly
    compilation and autotuning (2.5-4 minutes each for the tiny Qwen3.5 on the H200, 2026-12-01), and the fixed KV
    cache of ``hybrid_args`` keeps vLLM's memory profiling out of the way. The CPU engine runs them one after
    another (CI has two cores)."""
    if not torch.cuda.is_available():
        return [call() for call in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def _run(args: dict, teacher: dict[Tokens, list[int]], tmp: str, *, spec: dict | None = None,
         oracle: dict | None = None, fault: str | None = None, reference: bool = False,
         env: dict | None = None) -> tuple[dict, str]:
    config = {"teacher": [[list(p), s[len(p):]] for p, s in teacher.items()], "record": f"{tmp}/rows.pt",
              "fault": fault, "reference": reference}
    Path(f"{tmp}/teacher.json").write_text(json.dumps(config))
    run_env = {**(env or {}), TEACHER_ENV: f"{tmp}/teacher.json",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TEACHER_SITE), os.environ.get("PYTHONPATH")]))}
    if oracle:
        Path(f"{tmp}/oracle.json").write_text(json.dumps(oracle))
        run_env[ORACLE_ENV] = f"{tmp}/oracle.json"
    cache = os.environ.get(RUN_CACHE_ENV)
    entry = Path(cache) / _run_key(config, args, spec, oracle, env) if cache else None
    if entry is not None and (entry / "result.json").exists():
        shutil.copy(entry / "rows.pt", f"{tmp}/rows.pt")
        return json.loads((entry / "result.json").read_text()), f"{tmp}/rows.pt"
    result = run_engine(env=run_env, spec=spec, **args)
    if entry is not None:
        entry.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{tmp}/rows.pt", entry / "rows.pt")
        (entry / "result.part").write_text(json.dumps(result))
        (entry / "result.part").rename(entry / "result.json")  # last: a run killed mid-copy leaves no entry
    return result, f"{tmp}/rows.pt"


def _run_key(config: dict, args: dict, spec, oracle, env) -> str:
    """A run's identity: its inputs, the environment that shapes the engine, and every file of the code under test."""
    digest = hashlib.sha256(json.dumps(
        [{k: v for k, v in config.items() if k != "record"}, args, spec, oracle, env,
         [os.environ.get(k) for k in RUN_ENV_KEYS]], sort_keys=True, default=str).encode())
    for root in RUN_CODE:
        for path in sorted(root.rglob("*") if root.is_dir() else [root]):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(os.path.relpath(path, ROOT).encode() + path.read_bytes())
    return digest.hexdigest()[:20]


def teacher_run(args: dict, teacher: dict[Tokens, list[int]], *, spec: dict | None = None, oracle: dict | None = None,
                fault: str | None = None, env: dict | None = None) -> tuple[dict, Recording]:
    """One engine run forced onto ``teacher`` (prompt -> prompt + continuation), recording every sampled row."""
    with tempfile.TemporaryDirectory() as tmp:
        result, path = _run(args, teacher, tmp, spec=spec, oracle=oracle, fault=fault, env=env)
        return result, load_recording(path)


def reference_logits(args: dict, keys: set[Tokens], env: dict | None = None) -> dict[Tokens, torch.Tensor]:
    """The target's logits (recorded subset) after every key fed as plain prompt tokens: one no-spec prefill per
    key that is no other key's prefix (its prefill gives every prefix's logits too)."""
    ordered = sorted(keys)
    leaves = [k for k, nxt in zip(ordered, ordered[1:] + [()]) if nxt[: len(k)] != k]
    ref_args = {**args, "max_tokens": 1, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
                "prompt_token_ids": [list(k) for k in leaves]}
    with tempfile.TemporaryDirectory() as tmp:
        _, recording_path = _run(ref_args, {}, tmp, reference=True, env=env)
        reference = torch.load(recording_path, weights_only=False)["reference"]
    missing = keys - reference.keys()
    assert not missing, f"{len(missing)} keys have no reference logits"
    return reference


@dataclass
class DeviationReport:
    """Per recorded row (those with a key): deviation from its reference; and the scale of a change of context."""

    deviations: torch.Tensor  # [rows] max |logits - reference| on the subset
    rows: list[int]  # recording row of each entry
    separation: float  # median over rows of max |reference(row) - reference(its parent)|: one token of context

    @property
    def worst(self) -> float:
        return float(self.deviations.max()) if len(self.deviations) else 0.0


def deviation_report(recording: Recording, keys: list[Tokens | None],
                     reference: dict[Tokens, torch.Tensor]) -> DeviationReport:
    rows = [i for i, k in enumerate(keys) if k is not None]
    deviations = torch.stack([(recording.logits[i] - reference[keys[i]]).abs().max() for i in rows]) if rows \
        else torch.zeros(0)
    steps = [(reference[keys[i]] - reference[keys[i][:-1]]).abs().max() for i in rows
             if keys[i][:-1] in reference]
    separation = float(torch.stack(steps).median()) if steps else float("nan")
    return DeviationReport(deviations, rows, separation)


# Ordinary tokens of SmolLM2's tokenizer (the fixtures' one): no special, chat or vision ids among the forced inputs.
TEACHER_TOKENS = (100, 30000)


def seeded_teacher(prompts: list[list[int]], max_tokens: int, seed: int) -> dict[Tokens, list[int]]:
    """prompt -> prompt + ``max_tokens`` token ids drawn uniformly from ``TEACHER_TOKENS`` with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {tuple(p): list(p) + torch.randint(*TEACHER_TOKENS, (max_tokens,), generator=gen).tolist()
            for p in prompts}


def greedy_agreement(recording: Recording, keys: list[Tokens | None],
                     reference: dict[Tokens, torch.Tensor]) -> tuple[int, int]:
    """(rows whose argmax on the recorded subset is their reference's, rows with a reference): greedy agreement with
    no-spec at the same contexts, reported and not asserted."""
    rows = [i for i, k in enumerate(keys) if k is not None]
    hits = sum(int(recording.logits[i].argmax() == reference[keys[i]].argmax()) for i in rows)
    return hits, len(rows)
