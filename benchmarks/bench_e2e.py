"""End-to-end decode speed and acceptance: no-spec vs the DFlash chain vs DDTree, one engine per configuration.

    python benchmarks/bench_e2e.py                       # default: SmolLM2-135M + the trained drafter (fixtures/)
    python benchmarks/bench_e2e.py --budgets 16 64 --batch-sizes 1 8 --max-tokens 128 --out out/e2e.json

On the CPU engine (the README's main job) it shows τ and losslessness, not speed: vLLM runs there eagerly, so the
defaults are small (``CPU_DEFAULTS``: 4 prompts, 32 tokens, batch 4; a few minutes on 2 cores). Speed needs a GPU
(benchmarks/README.md), where the defaults are ``GPU_DEFAULTS``.

Every configuration generates greedily for the same prompts, ``batch`` at a time (batch 1 runs them one by one);
the table gives tokens/s (on GPU after a warm-up pass over the same shapes), τ (mean tokens per verify step, bonus
included: 1 + accepted / drafts), how many outputs differ from no-spec, and each request's mean time to its first
token (TTFT ms) and per later token (ms/tok), which split tokens/s into what a request pays once and what its
decode steps cost. ``--prompt-set heldout`` uses the drafter
trainer's held-out prompts (GSM8K, then the last HumanEval tasks; needs ``requirements/train.txt``).
CUDA graphs stay on unless --eager (the CPU default: vLLM's CPU engine would otherwise compile with inductor). With a
random-weight drafter (--shape) nothing is accepted, so τ ≈ 1 and the ratios measure pure per-step overhead; the
trained drafter gives real acceptance.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from ddtree_testkit import host_load
from ddtree_testkit.engine_args import TEXT_ONLY_MM_LIMITS, hybrid_engine_args
from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.shapes import shaped_target_dir
from ddtree_testkit.smollm2 import smollm2_dir, trained_smollm2_drafter_dir
from vllm_ddtree import step_timing
from vllm_ddtree.attention.backend import TREE_KERNEL_PREFIX_ENV
from vllm_ddtree.config import BENCHMARK_ENV, CHAIN, DEFAULT_TREE_BUDGET, DEFAULT_TREE_BUDGETS
from vllm_ddtree.cuda_graphs import capture_size_covering
from vllm_ddtree.hybrid import memory
from vllm_ddtree.scheduler import PIN_ENV as BUDGET_PIN_ENV
from vllm_ddtree.scheduler import RECORD_ENV as BUDGET_RECORD_ENV

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a hash map.",
    "def quicksort(arr):",
    "The history of the printing press begins",
    "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?\nA:",
    "Summarise the rules of chess for a beginner.",
    "SELECT name, COUNT(*) FROM orders",
]


# Defaults by device for the options given as None. The CPU engine is no speed reference: a small run that still
# shows τ and 0 differences in float32; --no-eager compiles there with inductor (minutes per engine).
# 512 batched tokens (raised to the largest verify step) make the start-up's profiling forward, as long as
# max_num_batched_tokens, 8x shorter than with vLLM's CPU default of 4096.
# No warm-up pass on CPU: eager, nothing to compile or capture.
CPU_DEFAULTS = {"batch_sizes": [4], "max_tokens": 32, "num_prompts": 4, "eager": True, "max_num_batched_tokens": 512,
                "warmup": False}
GPU_DEFAULTS = {"batch_sizes": [1, 4], "max_tokens": 32, "num_prompts": None, "eager": False,
                "max_num_batched_tokens": None, "warmup": True}
STEP_RECORD_SCHEDULER = "step_record.make_scheduler"  # benchmarks/step_record.py (this script's directory)
CONCURRENT_KV_CACHE_BYTES = 4 << 30  # per engine with --concurrent-engines
TRACE_GROUPS, TRACE_TOKENS = 3, 12  # --trace-dir: groups of the last batch size traced one at a time, tokens each
CPU_BANNER = ("bench_e2e on the CPU engine shows acceptance (tau: tokens per verify step) and losslessness (outputs "
              "differing from no-spec: 0 in float32). vLLM runs eagerly here, so tok/s and the x columns are no "
              "speed reference: speed needs a GPU (benchmarks/README.md).")


def worker(args: dict) -> dict:
    """Run one configuration in this process and return its measurements."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args["attention_backend"] = os.environ.get("BENCH_ATTENTION_BACKEND")
    # None keeps vLLM's choice (on for the chain on GPU, off for ddtree unless asked for).
    async_scheduling = {"1": True, "0": False}.get(os.environ.get("BENCH_ASYNC_SCHEDULING", ""))
    if args["in_process"]:  # CPU: one process instead of three vLLM imports (the GPU keeps vLLM's default)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    started = time.perf_counter()
    llm = LLM(
        model=args["model"],
        dtype=args["dtype"],
        speculative_config=args["spec"],
        max_model_len=args["max_model_len"],
        max_num_seqs=max(args["batch_sizes"]),
        max_num_batched_tokens=args["max_num_batched_tokens"],
        enforce_eager=args["eager"],
        tensor_parallel_size=args["tensor_parallel_size"],
        attention_backend=args.get("attention_backend"),
        load_format=args["load_format"],
        # On CPU gpu_memory_utilization budgets the worker's whole memory; an explicit KV size is what works there.
        gpu_memory_utilization=args["gpu_memory_utilization"] or 0.9,
        kv_cache_memory_bytes=args.get("kv_cache_memory_bytes") or (None if args["gpu_memory_utilization"]
                                                                     else 512 << 20),
        distributed_executor_backend="uni" if args["in_process"] else None,
        async_scheduling=async_scheduling,
        # TP probe on the GPU host: vLLM's custom all-reduce needs CUDA IPC peer access between the GPUs.
        disable_custom_all_reduce=os.environ.get("BENCH_DISABLE_CUSTOM_ALL_REDUCE") == "1",
        compilation_config=args["capture_sizes"],
        disable_log_stats=False,
        enable_logging_iteration_details=args.get("iteration_details", False),
        seed=0,
        **(hybrid_engine_args() if args["hybrid"] else {}),
        limit_mm_per_prompt=TEXT_ONLY_MM_LIMITS if args.get("multimodal") else None,  # text prompts only
        profiler_config=_trace_config(args),
        scheduler_cls=_step_record_scheduler(args["spec"]),
    )
    engine_start_s = time.perf_counter() - started  # weights, compilation, CUDA-graph capture
    with _alone_on_the_device(args.get("side_by_side")):
        rows = _measure(llm, args)
        if args.get("trace_dir"):
            _trace_pass(llm, args)
    engine_config = llm.llm_engine.vllm_config
    try:  # stop the engine core now: it logs the cost-aware budget's choices as it stops (DDTREE_LOG_LINES)
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # the measurement stands; only that line is lost
        print(f"engine shutdown: {e!r}", flush=True)
    return {"rows": rows, "async_scheduling": bool(engine_config.scheduler_config.async_scheduling),
            "model_runner": "V2" if engine_config.use_v2_model_runner else "V1",
            "engine_start_s": round(engine_start_s, 1)}


def _step_record_scheduler(spec: dict | None) -> str | None:
    """With ``VLLM_DDTREE_BUDGET_RECORD`` set, engines on vLLM's own scheduler (no-spec, the chain, a fixed ddtree
    budget) record their steps too (step_record.py); the cost-aware ones record through their own scheduler."""
    cost_aware = bool(spec) and spec["method"] == "ddtree" and (
        "num_speculative_tokens" not in spec or "tree_budgets" in spec
        or "num_speculative_tokens_per_batch_size" in spec)
    return STEP_RECORD_SCHEDULER if os.environ.get(BUDGET_RECORD_ENV) and not cost_aware else None


@contextmanager
def _alone_on_the_device(side_by_side: dict | None):
    """With --concurrent-engines: wait until every engine has started (or its worker has died: the parent marks it),
    then measure while holding a lock, so no other engine compiles, captures or generates meanwhile."""
    if not side_by_side:
        yield
        return
    sync = Path(side_by_side["dir"])
    (sync / f"ready.{side_by_side['me']}").touch()
    while not all((sync / f"ready.{n}").exists() or (sync / f"gone.{n}").exists() for n in side_by_side["engines"]):
        time.sleep(0.5)
    with (sync / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def generate_together(llm, prompts, params) -> list:
    """``llm.generate`` with every request of the group queued before the engine schedules any (vLLM's recipe:
    ``sleep(level=0)``, ``enqueue``, ``wake_up(["scheduling"])``). ``generate`` adds requests one by one while the
    engine already steps, so which of them share the first prefill step was a race: on an H100 (2026-12-06, Qwen3-8B
    shape, batch 32 and 64) the first request prefilled alone, the rest in one to three steps split differently run to
    run, and the median first token of one engine against another moved by -36 to +25 ms between runs."""
    llm.sleep(level=0)
    try:
        llm.enqueue(prompts, params, use_tqdm=False)
    finally:
        llm.wake_up(tags=["scheduling"])
    return llm.wait_for_completion(use_tqdm=False)


def _measure(llm, args: dict) -> list[dict]:
    """Warm-up and timed passes per batch size (and the profiled pass with --profile-dir)."""
    from vllm import SamplingParams

    prompts = _prompts(llm, args)
    # Random weights (--shape) generate ids past the tokenizer's vocabulary: keep token ids, skip the text.
    params = SamplingParams(temperature=0.0, max_tokens=1 if args.get("prefill_tokens") else args["max_tokens"],
                            ignore_eos=True, detokenize=args["load_format"] != "dummy")
    rows = []
    for batch in args["batch_sizes"]:
        if batch > len(prompts):
            prompts = (prompts * (batch // len(prompts) + 1))[:batch]
        groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]
        if args["warmup"]:
            generate_together(llm, groups[0], params)  # same shapes: compiles, captures
            # Its prompts would hit the prefix cache in the timed pass, where every other group's are cold (H100,
            # 2026-12-06: the first of four 8k prompts took 16 ms on no-spec, 28 on the chain, 264 on ddtree).
            if not llm.reset_prefix_cache():
                print("warning: vLLM did not reset the prefix cache after the warm-up pass", flush=True)
        before = _spec_counters(llm)
        host_before = host_load.snapshot(time.perf_counter())
        outputs, group_seconds = [], []
        for group in groups:
            start = time.perf_counter()
            outputs += generate_together(llm, group, params)
            group_seconds.append(time.perf_counter() - start)
        elapsed = sum(group_seconds)
        host_cpu = host_load.cpu_use(host_before, host_load.snapshot(time.perf_counter()), os.getpid())
        after = _spec_counters(llm)
        drafts, accepted = after[0] - before[0], after[1] - before[1]
        if args.get("profile_dir"):
            _profile_pass(llm, groups[0], params, args)
        per_pos = [a - b for a, b in zip(after[2], before[2])] if before[2] else after[2]
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        rows.append({
            "batch": batch,
            "tokens_per_s": tokens / elapsed,
            # Each group ends with its slowest request: beside budget_record.py's groups, where a ratio is made.
            "group_seconds": [round(g, 4) for g in group_seconds],
            **request_latencies(outputs),
            "prefill_tokens_per_s": prompt_tokens / elapsed if args.get("prefill_tokens") else None,
            "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),  # prefix-cache hits: 0 expected
            "tau": 1 + accepted / drafts if drafts else None,
            "accepted_per_position": [round(a / drafts, 4) for a in per_pos] if drafts else None,
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "host_cpu": host_cpu,
        })
    return rows


def request_latencies(outputs) -> dict:
    """Mean time to the first token and mean time per later token of a request, from vLLM's request metrics (engine
    core timestamps): they split tokens/s into what each request pays once (prefill, its first step) and the
    decode steps. None where vLLM kept no metrics."""
    first, per_token, queued, scheduled_to_first = [], [], [], []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if m is None or not m.first_token_ts:
            continue
        first.append(1e3 * m.first_token_latency)
        # The engine core's clock splits the first token into the wait for a step (queued -> scheduled) and the
        # steps from scheduling to the first output (scheduled -> first token).
        if m.scheduled_ts:
            queued.append(round(1e3 * (m.scheduled_ts - m.queued_ts), 1))
            scheduled_to_first.append(round(1e3 * (m.first_token_ts - m.scheduled_ts), 1))
        if n > 1 and m.last_token_ts > m.first_token_ts:
            per_token.append(1e3 * (m.last_token_ts - m.first_token_ts) / (n - 1))
    return {"first_token_ms": round(statistics.fmean(first), 2) if first else None,
            "first_token_ms_each": [round(f, 1) for f in first],  # a mean over one prefill per group hides outliers
            "queued_ms_each": queued, "scheduled_to_first_token_ms_each": scheduled_to_first,
            "decode_ms_per_token": round(statistics.fmean(per_token), 3) if per_token else None}


def prefill_prompts(count: int, length: int) -> list[dict]:
    """``--prefill-tokens``: ``count`` prompts of ``length`` token ids, fixed pseudo-random ids in [1000, 30000)
    (inside SmolLM2's and the --shape targets' vocabularies), distinct per prompt so no prefix is shared."""
    import random

    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(length)]} for _ in range(count)]


def _profile_pass(llm, prompts, params, args) -> None:
    """One more pass under the torch profiler (not timed): per-kernel device time, for kernel_profile.py."""
    import kernel_profile

    before = _spec_counters(llm)[0]
    with kernel_profile.Profiler() as prof:
        generate_together(llm, prompts, params)
    drafts = _spec_counters(llm)[0] - before
    steps = round(drafts / len(prompts)) if drafts else args["max_tokens"]  # requests step in lockstep here
    out = Path(args["profile_dir"]) / f"{_slug(args['config'])}.b{len(prompts)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": args["config"], "batch": len(prompts), **prof.result(steps)}))


def _prompts(llm, args: dict) -> list[str]:
    """The run's prompts as the engine gets them: chat-templated where the tokenizer has a template."""
    if args.get("prefill_tokens"):
        return prefill_prompts(len(args["prompts"]), args["prefill_tokens"])
    tokenizer = llm.get_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            if getattr(tokenizer, "chat_template", None) else p for p in args["prompts"]]


def _trace_config(args: dict) -> dict | None:
    """With --trace-dir: vLLM's torch profiler in the engine's worker (off until ``_trace_pass`` starts it), with
    Python frames, so host time is attributed to functions; the engine keeps its processes and its scheduling."""
    if not args.get("trace_dir"):
        return None
    return {"profiler": "torch", "torch_profiler_dir": str(Path(args["trace_dir"]) / _slug(args["config"])),
            "torch_profiler_with_stack": True, "ignore_frontend": True}


def _trace_pass(llm, args: dict) -> None:
    """After the timed passes (not timed): TRACE_GROUPS groups of the last batch size, one group at a time,
    TRACE_TOKENS tokens each, under the worker's profiler: each group's prefill step and first decode steps in one
    Chrome trace per worker. The prefix cache is reset first: the timed passes ran these prompts."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TRACE_TOKENS, ignore_eos=True,
                            detokenize=args["load_format"] != "dummy")
    batch, prompts = args["batch_sizes"][-1], _prompts(llm, args)
    prompts = (prompts * (TRACE_GROUPS * batch // len(prompts) + 1))[: TRACE_GROUPS * batch]
    llm.reset_prefix_cache()
    llm.start_profile()
    for i in range(0, len(prompts), batch):
        generate_together(llm, prompts[i: i + batch], params)
    llm.stop_profile()


def _spec_counters(llm) -> tuple[int, int, list[int]]:
    """(drafts, accepted tokens, accepted tokens per draft position) so far, from vLLM's spec-decode metrics."""
    metrics = {m.name: m for m in llm.get_metrics()}

    def value(name):
        return getattr(metrics.get(name), "value", 0)

    per_pos = list(getattr(metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos"), "values", []) or [])
    return value("vllm:spec_decode_num_drafts"), value("vllm:spec_decode_num_accepted_tokens"), per_pos


def load_prompts(prompt_set: str, limit: int | None) -> list[str]:
    """Chat prompts (user turns) for the benchmark."""
    if prompt_set == "chat":
        prompts = DEFAULT_PROMPTS
    else:
        from ddtree_testkit.train_dflash.prompts import heldout_texts

        prompts = [text for _, text in heldout_texts()]
    return prompts[:limit] if limit else prompts


def default_models() -> tuple[str, str]:
    return str(smollm2_dir()), str(trained_smollm2_drafter_dir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--drafter")
    parser.add_argument("--shape", help="time a real model's shape with random in-memory weights "
                        "(ddtree_testkit.shapes.SHAPES, e.g. qwen3-8b): no acceptance, so ratios are per-step costs "
                        "(the tree tax); replaces --model/--drafter")
    parser.add_argument("--draft-layers", type=int, default=1, help="drafter layers for --shape")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16])
    parser.add_argument("--chain-tokens", type=int, default=None, help="DFlash chain drafts (default: block - 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help=f"default: {GPU_DEFAULTS['batch_sizes']} on GPU, {CPU_DEFAULTS['batch_sizes']} on CPU")
    parser.add_argument("--prompt-set", choices=["chat", "heldout"], default="chat")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the set (default: all on "
                        f"GPU, {CPU_DEFAULTS['num_prompts']} on CPU)")
    parser.add_argument("--chain-v1", action="store_true", help="also run the DFlash chain on the V1 model runner "
                        "(the runner DDTree uses) next to vLLM's default runner")
    parser.add_argument("--same-backend-baselines", action="store_true", help="also run no-spec and the chain on "
                        "what DDTree runs on (V1 runner, TRITON_ATTN): separates kernel rounding from DDTree itself")
    parser.add_argument("--step-timing", action="store_true", help="DDTree configurations report where a step's time "
                        "goes (vllm_ddtree/step_timing.py), over all their batch sizes: give one batch size")
    parser.add_argument("--iteration-details", action="store_true", help="vLLM logs every engine step (requests and "
                        "tokens of prefill and decode, time to its output) into each engine's log: with --keep-logs, "
                        "the steps between a request's scheduling and its first token")
    parser.add_argument("--async-ab", action="store_true", help="also run every budget with async scheduling "
                        "(--async-scheduling; vLLM turns it on for the chain on GPU and off for ddtree by default)")
    parser.add_argument("--budget-schedule", type=json.loads, default=None, help="also run 'ddtree adaptive': the "
                        "adaptive budget, as vLLM's num_speculative_tokens_per_batch_size, e.g. "
                        "'[[1, 4, 64], [5, 16, 32], [17, 256, 16]]' (bench_ddtree.py prints one from its measurements)")
    parser.add_argument("--ddtree-default", action="store_true", help="also run 'ddtree default': no budget given, "
                        "so ddtree chooses (the cost-aware budget with the chain fallback on Model Runner V2, B=64 "
                        "on the V1 runner)")
    parser.add_argument("--ddtree-default-pinned", type=int, nargs="+", default=None, metavar="B", help="also run "
                        "'ddtree default pinned B=<b>': the default engine with every step verifying b "
                        "(VLLM_DDTREE_BUDGET_PIN; 15 is the chain), against 'ddtree B=<b>' what the cost-aware "
                        "machinery costs, against 'ddtree default' what the choice costs")
    parser.add_argument("--tree-budgets", type=int, nargs="+", default=None, help="also run 'ddtree cost-aware': "
                        "ddtree's tree_budgets, each step's budget among these from live acceptance and step time "
                        "(vllm_ddtree/budget_policy.py), e.g. 16 32 64")
    parser.add_argument("--chain-fallback", action="store_true", help="also run 'ddtree chain fallback': the "
                        "cost-aware budget over --tree-budgets (default 16 32 64) and the DFlash chain "
                        "(tree_budgets [\"chain\", ...]: steps that verify the chain on vLLM's attention)")
    parser.add_argument("--tree-kernel-prefix", action="store_true", help="also run every budget with the tree "
                        "kernel attending to the prefix too (VLLM_DDTREE_TREE_KERNEL_PREFIX=1) as 'ddtree B=<b> "
                        "tree-kernel prefix'; by default FLASH_ATTN's verify runs the prefix on FlashAttention")
    parser.add_argument("--v1", action="store_true", help="also run every budget on the V1 model runner "
                        "(VLLM_USE_V2_MODEL_RUNNER=0) as 'ddtree B=<b> V1'; on GPU ddtree runs on Model Runner V2 "
                        "where vLLM does (dense targets)")
    parser.add_argument("--capture-sizes", default="shared", help="CUDA-graph capture sizes: 'auto' (vLLM's list, "
                        "its largest size raised, onto vLLM's capture grid, where a configuration's verify step, "
                        "batch x (1 + budget) tokens, exceeds 512, as ddtree's start-up warning advises), 'shared' "
                        "(the default: every configuration gets the largest list 'auto' gives any of them, so a "
                        "prefill batch is padded alike everywhere; vLLM's default list grows with the drafts per "
                        "step, and a bf16 prefill padded into a graph by one engine and run eagerly by another can "
                        "round to another first token), 'vllm' (vLLM's default), or a comma-separated list. (An "
                        "explicit short list of just the sizes each step needs made DDTree's batch-8 steps 40%% "
                        "slower on an H200, 2026-12-01: vLLM's list is what users run.)")
    parser.add_argument("--synthetic-acceptance-length", type=float, nargs="+", default=None, metavar="TAU",
                        help="time the speculative rows at a stated mean acceptance length τ: CHAIN [TREE] (e.g. "
                        "the paper's Qwen3-8B MATH-500 7.79 10.73; vLLM's synthetic rejection sampling, DDTree's down "
                        "its best-first path, vllm_ddtree/synthetic_acceptance.py); with --shape, the speed-up at "
                        "that τ; outputs are then not the target's")
    parser.add_argument("--prefill-tokens", type=int, default=None, metavar="N", help="time prefill instead: "
                        "--num-prompts prompts of N token ids, one output token each; the table gains prefill tok/s "
                        "(prompt tokens per second) and its ratio to no-spec's")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=None, help="run only these configurations, in this order "
                        "(by name; also comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"default: {GPU_DEFAULTS['max_tokens']} on GPU, {CPU_DEFAULTS['max_tokens']} on CPU")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"default: vLLM's on GPU, {CPU_DEFAULTS['max_num_batched_tokens']} on CPU")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=None,
                        help="no CUDA graphs / torch.compile (default: on CPU, off on GPU)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                        help="a warm-up pass over each batch size's shapes before timing (default: on GPU, off on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: 0.5 on GPU; on CPU a "
                        "fixed 512 MiB KV cache")
    parser.add_argument("--concurrent-engines", action="store_true", help="start every configuration's engine at "
                        "once, each with a fixed KV cache (vLLM's start-up memory profiling trips over another engine "
                        "on the GPU) and no compile cache; once all have started, they measure one at a time. For the "
                        "outputs of correctness runs: on an H200 (2026-12-02) steps timed this way came out slower and "
                        "noisier than with engines started in turn, for reasons not yet known")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--keep-logs", action="store_true", help="keep every worker's whole log next to --out "
                        "(by default only a failed worker's is kept)")
    parser.add_argument("--profile-dir", default=None, help="after each timed pass, profile one more pass per batch "
                        "size (torch profiler, engine in-process) and write per-kernel device time there "
                        "(benchmarks/kernel_profile.py compares the configurations)")
    parser.add_argument("--trace-dir", default=None, help="after the timed passes, run TRACE_GROUPS groups of the last "
                        "batch size, one at a time, under vLLM's torch profiler (Python frames on) and write each "
                        "engine's Chrome trace under DIR/<config>/ (benchmarks/trace_steps.py reads them): where a "
                        "prefill step's and the first decode steps' time goes; the engine keeps its processes and "
                        "scheduling (--profile-dir runs it in-process)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("BENCH_RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    import torch

    on_gpu = torch.cuda.is_available()
    batched_tokens_given = args.max_num_batched_tokens is not None
    for name, value in (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not on_gpu:
        print(CPU_BANNER, flush=True)
    load_format = "auto"
    if args.shape:
        model = str(shaped_target_dir(args.shape))
        # vLLM's DFlash drafter does not run on dummy weights (its fused context-KV buffers come from
        # load_weights), so the drafter gets real random weights and its own load config.
        drafter = str(random_dflash_dir(model, block_size=16, num_layers=args.draft_layers))
        load_format = "dummy"
    else:
        model, drafter = (args.model, args.drafter) if args.model else default_models()
        drafter = args.drafter or drafter
    block = json.loads((Path(drafter) / "config.json").read_text()).get("block_size", 16)
    chain = args.chain_tokens or block - 1
    if args.max_num_batched_tokens and not batched_tokens_given:  # the CPU default: room for every verify step
        largest = max(args.budgets + [chain] + [entry[2] for entry in args.budget_schedule or []]
                      + (args.tree_budgets or [])
                      + ([DEFAULT_TREE_BUDGET] if args.chain_fallback or args.ddtree_default
                         or args.ddtree_default_pinned else []))
        args.max_num_batched_tokens = max(args.max_num_batched_tokens, max(args.batch_sizes) * (1 + largest))
    drafter_load = {"draft_load_config": {"load_format": "auto"}} if load_format == "dummy" else {}
    chain_spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": chain, **drafter_load}
    configs = [("no-spec", None, {}), ("dflash", chain_spec, {})]
    if args.chain_v1:
        configs.append(("dflash V1", chain_spec, {"VLLM_USE_V2_MODEL_RUNNER": "0"}))
    if args.same_backend_baselines and on_gpu:
        same = {"VLLM_USE_V2_MODEL_RUNNER": "0", "BENCH_ATTENTION_BACKEND": "TRITON_ATTN"}
        configs += [("no-spec V1+tri", None, same), ("dflash V1+tri", chain_spec, same)]
    trees = [(f"ddtree B={b}", {"method": "ddtree", "model": drafter, "num_speculative_tokens": b, **drafter_load},
              {}) for b in args.budgets]
    configs += trees
    if args.budget_schedule:
        largest = max(entry[2] for entry in args.budget_schedule)
        configs.append(("ddtree adaptive", {"method": "ddtree", "model": drafter, "num_speculative_tokens": largest,
                                            "num_speculative_tokens_per_batch_size": args.budget_schedule,
                                            **drafter_load}, {}))
    if args.ddtree_default:
        configs.append(("ddtree default", {"method": "ddtree", "model": drafter, **drafter_load}, {}))
    for b in args.ddtree_default_pinned or ():
        configs.append((f"ddtree default pinned B={b}", {"method": "ddtree", "model": drafter, **drafter_load},
                        {BUDGET_PIN_ENV: str(b)}))
    if args.tree_budgets:
        configs.append(("ddtree cost-aware", {"method": "ddtree", "model": drafter, "tree_budgets": args.tree_budgets,
                                              "num_speculative_tokens": max(args.tree_budgets), **drafter_load},
                        {}))
    if args.chain_fallback:
        budgets = args.tree_budgets or [b for b in DEFAULT_TREE_BUDGETS if b != CHAIN]
        configs.append(("ddtree chain fallback", {"method": "ddtree", "model": drafter,
                                                  "tree_budgets": ["chain", *budgets],
                                                  "num_speculative_tokens": max(budgets), **drafter_load}, {}))
    if args.async_ab:
        configs += [(f"{name} async", spec, {"BENCH_ASYNC_SCHEDULING": "1"}) for name, spec, _ in trees]
    if args.tree_kernel_prefix:
        configs += [(f"{name} tree-kernel prefix", spec, {TREE_KERNEL_PREFIX_ENV: "1"}) for name, spec, _ in trees]
    if args.v1:
        configs += [(f"{name} V1", spec, {"VLLM_USE_V2_MODEL_RUNNER": "0"}) for name, spec, _ in trees]
    if args.configs:
        configs = select_configs(configs, args.configs)
    if args.synthetic_acceptance_length:  # every speculative row at a stated acceptance
        if len(args.synthetic_acceptance_length) > 2:
            sys.exit("--synthetic-acceptance-length takes CHAIN [TREE]")
        chain_tau, tree_tau = (args.synthetic_acceptance_length * 2)[:2]

        def synthetic(spec: dict | None) -> dict | None:
            tau = tree_tau if spec and spec["method"] == "ddtree" else chain_tau
            return spec and {**spec, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": tau}

        configs = [(name, synthetic(spec), {**env, BENCHMARK_ENV: "1"} if spec else env)
                   for name, spec, env in configs]
        print(f"synthetic acceptance: τ = {chain_tau} for the chain (vLLM's), {tree_tau} for DDTree (down its "
              "best-first path); outputs are not the target's", flush=True)
    target_config = json.loads((Path(model) / "config.json").read_text())
    base = {
        "model": model, "dtype": args.dtype or ("bfloat16" if on_gpu else "float32"),
        "prompts": load_prompts(args.prompt_set, args.num_prompts), "tensor_parallel_size": args.tensor_parallel_size,
        "load_format": load_format,
        "max_tokens": args.max_tokens, "batch_sizes": args.batch_sizes, "prefill_tokens": args.prefill_tokens,
        "max_model_len": max(args.max_model_len, (args.prefill_tokens or 0) + 64),
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "eager": args.eager, "warmup": args.warmup,
        "gpu_memory_utilization": args.gpu_memory_utilization or (0.5 if on_gpu else None),
        "in_process": not on_gpu and args.tensor_parallel_size == 1,
        "hybrid": "linear_num_value_heads" in target_config.get("text_config", target_config),
        "multimodal": "vision_config" in target_config,
        "iteration_details": args.iteration_details,
    }
    if base["hybrid"] and not on_gpu:
        base["dtype"] = "bfloat16"  # vLLM's CPU GDN layers run in bfloat16 only
    meta = {"model": model, "drafter": drafter, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "vllm": "0.26.0", "max_tokens": args.max_tokens, "eager": args.eager, "warmup": args.warmup,
            "dtype": base["dtype"], "prompt_set": args.prompt_set, "prompts": len(base["prompts"]),
            "tensor_parallel_size": args.tensor_parallel_size, "shape": args.shape,
            "synthetic_acceptance_length": args.synthetic_acceptance_length, "prefill_tokens": args.prefill_tokens,
            "capture_sizes": args.capture_sizes}
    results: dict[str, dict | None] = {}
    if args.concurrent_engines:
        base["gpu_memory_utilization"] = min(base["gpu_memory_utilization"] or 0.9, 0.9 / len(configs))
        base["kv_cache_memory_bytes"] = CONCURRENT_KV_CACHE_BYTES
        configs = [(name, spec, {**env, "VLLM_DISABLE_COMPILE_CACHE": "1"}) for name, spec, env in configs]
        meta["concurrent_engines"] = True
        sync_dir = tempfile.mkdtemp(prefix="bench_e2e_sync_")
    launched = []
    for name, spec, env in configs:
        side_by_side = {"dir": sync_dir, "me": _slug(name), "engines": [_slug(c[0]) for c in configs]} \
            if args.concurrent_engines else None
        worker_args = {**base, "spec": spec, "config": name, "profile_dir": args.profile_dir,
                       "trace_dir": args.trace_dir,
                       "side_by_side": side_by_side,
                       "capture_sizes": capture_sizes(args.capture_sizes, spec, args.batch_sizes,
                                                      on_gpu and not args.eager, [c[1] for c in configs])}
        if args.profile_dir:  # the engine core in the worker's process, where the profiler runs
            env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        timing_dir = None
        if args.step_timing and spec and spec["method"] == "ddtree":
            timing_dir = tempfile.mkdtemp(prefix="ddtree_timing_")
            env = {**env, step_timing.TIMING_ENV: timing_dir}
        gdn_state = gdn_state_gib(target_config, spec, args.tensor_parallel_size, on_gpu) if base["hybrid"] else None
        launched.append(_launch(name, worker_args, env, args.out, timing_dir, gdn_state, args.keep_logs))
        if not args.concurrent_engines:
            _finish(launched.pop(), results, meta, args.out)
    for run in launched:
        _finish(run, results, meta, args.out)
    print()
    print_table(summarise(results))
    failed = [name for name, res in results.items() if res is None]
    if failed:
        sys.exit(f"failed configurations: {', '.join(failed)}")


def select_configs(configs: list[tuple], wanted: list[str]) -> list[tuple]:
    """The configurations named in ``--configs`` (names, also comma-separated), run in the order given there: engines
    run one after another, and a host that drifts over a call (H100, 2026-12-07: the default engine, run last, cost
    0.5-2.5 ms a step more than B=64 before it, unexplained) is told apart by running the same names in another
    order. A name the other options do not build is skipped with a warning (callers list optional ones)."""
    order = [name.strip() for arg in wanted for name in arg.split(",") if name.strip()]
    known = {c[0]: c for c in configs}
    unknown = [name for name in order if name not in known]
    if unknown:
        print(f"warning: --configs names {', '.join(map(repr, unknown))}, which the options given do not build "
              f"(these do: {', '.join(known)})", flush=True)
    return [known[name] for name in dict.fromkeys(order) if name in known]


def capture_sizes(choice: str, spec: dict | None, batch_sizes: list[int], graphs: bool,
                  specs: list[dict | None] = ()) -> dict | None:
    """The compilation_config capture settings of one configuration (``--capture-sizes``); None keeps vLLM's.
    ``specs``: every configuration's speculative config, for "shared"."""
    if not graphs or choice == "vllm":
        return None
    if choice == "shared":
        return {"max_cudagraph_capture_size": max(largest_capture_size(s, batch_sizes) for s in [spec, *specs])}
    if choice != "auto":
        return {"cudagraph_capture_sizes": sorted({int(x) for x in choice.split(",")})}
    largest = largest_capture_size(spec, batch_sizes)  # above 512 only where vLLM's list must be raised
    return {"max_cudagraph_capture_size": largest} if largest > 512 else None


def largest_capture_size(spec: dict | None, batch_sizes: list[int]) -> int:
    """The largest CUDA-graph size "auto" gives a configuration: vLLM's default (0.26.0
    ``VllmConfig._set_cudagraph_sizes``: max_num_seqs x (1 + K) x 2, at most 512; bench_e2e's max_num_seqs is the
    largest batch), or the grid size covering its largest verify step where that exceeds 512 (on vLLM's grid: 520,
    B=64 at batch 8, would be truncated to 512 and that step would run without graphs)."""
    query_len = 1 + largest_budget(spec)
    largest = max(batch_sizes) * query_len
    return capture_size_covering(largest) if largest > 512 else min(2 * largest, 512)


def _launch(name: str, worker_args: dict, env: dict, out: str | None, timing_dir: str | None,
            gdn_state_gib_per_request: float | None = None, keep_log: bool = False) -> dict:
    """Start one configuration's worker. Its whole output (vLLM logs to stdout, tracebacks go to stderr) streams to
    a file, so a worker killed by a time limit still leaves it; it is kept next to the results when it fails."""
    if out:
        log_path = Path(out).with_suffix(f".{_slug(name)}.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
    else:
        fd, temp_name = tempfile.mkstemp(".log")
        os.close(fd)
        log_path = Path(temp_name)
    cmd = [sys.executable, __file__, "--worker", json.dumps(worker_args)]
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env})
    if side_by_side := worker_args.get("side_by_side"):  # a worker that dies must not hold the others' start
        gone = Path(side_by_side["dir"]) / f"gone.{side_by_side['me']}"

        def mark_gone() -> None:
            proc.wait()
            gone.touch()
        threading.Thread(target=mark_gone, daemon=True).start()
    return {"name": name, "proc": proc, "log": log, "log_path": log_path, "timing_dir": timing_dir,
            "gdn_state_gib_per_request": gdn_state_gib_per_request, "keep_log": keep_log}


def _finish(run: dict, results: dict, meta: dict, out: str | None) -> None:
    """Wait for a worker, record its result (None if it failed), print and save what is measured so far (a run cut
    short by a time limit keeps it)."""
    name = run["name"]
    returncode = run["proc"].wait()
    run["log"].close()
    output = run["log_path"].read_text()
    result = worker_result(output)
    if not (out and (returncode or run["keep_log"])):
        run["log_path"].unlink()
    if result is None:
        print(f"{name}: FAILED\n{output[-4000:]}", file=sys.stderr)
        results[name] = None
        return
    if run["gdn_state_gib_per_request"] is not None:
        result["gdn_state_gib_per_request"] = run["gdn_state_gib_per_request"]
    results[name] = result
    if run["timing_dir"]:
        meta.setdefault("step_timing", {})[name] = step_timing.read_reports(run["timing_dir"])
        _print_step_timing(name, meta["step_timing"][name])
    table = summarise(results)
    print_table([t for t in table if t["config"] == name])
    for key, line in ddtree_log_lines(output).items():
        meta.setdefault(key, {})[name] = line
        print(f"{name}: {line}")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"meta": meta, "table": table}, indent=2))


def worker_result(output: str) -> dict | None:
    """The worker's ``BENCH_RESULT {...}`` line, or None. Another process's partial line may precede the marker on
    its line, and a failed worker's traceback quotes the print statement (``"BENCH_RESULT " + ...``)."""
    found = re.findall(r"BENCH_RESULT (\{.*\})$", output, flags=re.MULTILINE)
    return json.loads(found[-1]) if found else None


DDTREE_LOG_LINES = {  # what ddtree logs that a run's table should keep (the worker's log is deleted after a clean run)
    "start_up": r"(ddtree runs on .*)$",  # the runner, why, and the budget policy
    "budget_choices": r"ddtree cost-aware budget, verify steps: (.*)$",  # logged as the engine core stops
}


def ddtree_log_lines(output: str) -> dict[str, str]:
    """The last of each ``DDTREE_LOG_LINES`` line in a worker's output."""
    found = {key: re.findall(pattern, output, flags=re.MULTILINE) for key, pattern in DDTREE_LOG_LINES.items()}
    return {key: lines[-1].strip() for key, lines in found.items() if lines}


def summarise(results: dict[str, dict | None]) -> list[dict]:
    """One row per (configuration, batch size), with ratios and output differences against no-spec/the chain."""
    reference = results.get("no-spec")
    table = []
    for name, res in results.items():
        for i, row in enumerate(res["rows"] if res else []):
            ref_row = reference["rows"][i] if reference else None
            base_tps = ref_row["tokens_per_s"] if ref_row else None
            chain_row = results["dflash"]["rows"][i] if results.get("dflash") else None
            differ = [j for j, (a, b) in enumerate(zip(row["token_ids"], ref_row["token_ids"])) if a != b] \
                if ref_row else None
            table.append({
                "config": name, "batch": row["batch"], "tokens_per_s": round(row["tokens_per_s"], 1),
                # one engine step emits batch x tau tokens (the batch runs together; batch 1 runs prompts in turn)
                "ms_per_step": round(1000 * row["batch"] * (row["tau"] or 1) / row["tokens_per_s"], 2),
                "tau": round(row["tau"], 3) if row["tau"] else None,
                "vs_no_spec": round(row["tokens_per_s"] / base_tps, 3) if base_tps else None,
                "vs_chain": round(row["tokens_per_s"] / chain_row["tokens_per_s"], 3) if chain_row else None,
                "outputs_differing_from_no_spec": None if differ is None else len(differ),
                "differing_prompts": differ,
                "first_difference": [_first_difference(row["token_ids"][j], ref_row["token_ids"][j])
                                     for j in differ or []],
                "accepted_per_position": row["accepted_per_position"], "prompts": len(row["token_ids"]),
                "async_scheduling": res.get("async_scheduling"), "model_runner": res.get("model_runner"),
                "engine_start_s": res.get("engine_start_s"),
                "first_token_ms": row.get("first_token_ms"), "first_token_ms_each": row.get("first_token_ms_each"),
                "queued_ms_each": row.get("queued_ms_each"),
                "scheduled_to_first_token_ms_each": row.get("scheduled_to_first_token_ms_each"),
                "cached_prompt_tokens": row.get("cached_prompt_tokens"),
                "decode_ms_per_token": row.get("decode_ms_per_token"),
                "host_cpu": row.get("host_cpu"),
                "group_seconds": row.get("group_seconds"),
                "vs_chain_by_group": _ratios_by_group(row, chain_row),
            })
            if row.get("prefill_tokens_per_s"):
                ref_prefill = ref_row and ref_row.get("prefill_tokens_per_s")
                table[-1]["prefill_tokens_per_s"] = round(row["prefill_tokens_per_s"], 1)
                table[-1]["prefill_vs_no_spec"] = round(row["prefill_tokens_per_s"] / ref_prefill, 3) \
                    if ref_prefill else None
            if res.get("gdn_state_gib_per_request") is not None:
                table[-1]["gdn_state_gib"] = round(res["gdn_state_gib_per_request"] * row["batch"], 3)
            # the same-backend no-spec on this row's runner (DDTree's kernels and rounding, vLLM's own decode)
            same = results.get("no-spec V1+tri") if res.get("model_runner") == "V1" else None
            if same:
                table[-1]["outputs_differing_from_same_backend_no_spec"] = sum(
                    a != b for a, b in zip(row["token_ids"], same["rows"][i]["token_ids"]))
    return table


def _ratios_by_group(row: dict, chain_row: dict | None) -> list[float] | None:
    """Per group of requests, the chain's wall time over this row's: the same prompts make the same tokens (greedy),
    so each is that group's tokens/s against the chain. One engine's steps moved by up to 1.8x from one group to the
    next (H100, 2026-12-08, the pair at batch 32), so a ratio over two or three groups wants each group's beside it."""
    mine, chain = row.get("group_seconds"), chain_row and chain_row.get("group_seconds")
    if not mine or not chain or len(mine) != len(chain):
        return None
    return [round(c / m, 3) for m, c in zip(mine, chain)]


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def print_table(table: list[dict]) -> None:
    print(f"{'config':24s} {'batch':>5s} {'tok/s':>9s} {'ms/step':>8s} {'tau':>6s} {'x no-spec':>9s} {'x chain':>8s} "
          f"{'differ':>7s} {'start s':>7s} {'TTFT ms':>8s} {'ms/tok':>7s}"
          + (" GDN state GiB" if any("gdn_state_gib" in t for t in table) else "")
          + (" prefill tok/s x no-spec" if any("prefill_tokens_per_s" in t for t in table) else ""))
    for t in table:
        print(f"{t['config']:24s} {t['batch']:5d} {t['tokens_per_s']:9.1f} {t['ms_per_step']:8.2f} "
              f"{t['tau'] or '-':>6} {t['vs_no_spec'] or '-':>9} {t['vs_chain'] or '-':>8} "
              f"{t['outputs_differing_from_no_spec']}/{t['prompts']:<3d} {t['engine_start_s'] or '-':>7} "
              f"{_cell(t.get('first_token_ms'), 8, 1)} {_cell(t.get('decode_ms_per_token'), 7, 2)}"
              + (f" {t['gdn_state_gib']:13.2f}" if "gdn_state_gib" in t else "")
              + (f" {t['prefill_tokens_per_s']:13.1f} {t['prefill_vs_no_spec'] or '-':>9}"
                 if "prefill_tokens_per_s" in t else "")
              + (f" (vs same-backend no-spec {t['outputs_differing_from_same_backend_no_spec']})"
                 if "outputs_differing_from_same_backend_no_spec" in t else ""))
    for t in table:
        if t.get("scheduled_to_first_token_ms_each"):
            print(f"{t['config']:24s} {t['batch']:5d} median first token "
                  f"{statistics.median(t['first_token_ms_each']):.1f} ms: queued "
                  f"{statistics.median(t['queued_ms_each']):.1f}, scheduled -> first token "
                  f"{statistics.median(t['scheduled_to_first_token_ms_each']):.1f}")
    for t in table:
        if (by_group := t.get("vs_chain_by_group")) and t["config"] != "dflash":
            print(f"{t['config']:24s} {t['batch']:5d} x chain by group: " + " ".join(f"{r:.3f}" for r in by_group))
    for t in table:
        if cpu := t.get("host_cpu"):  # CPU-seconds per second while this row was timed
            print(f"{t['config']:24s} {t['batch']:5d} host CPUs used: engine {cpu['own']:.2f}, elsewhere "
                  f"{cpu['elsewhere']:.2f} (" + ", ".join(f"{name} {cpus:.2f}" for name, cpus in cpu["busiest"])
                  + f"), steal {'-' if cpu['steal'] is None else format(cpu['steal'], '.1%')}, "
                  f"over {cpu['seconds']:.1f} s")
    for t in table:
        if t["accepted_per_position"]:
            print(f"{t['config']:24s} {t['batch']:5d} acceptance by position: "
                  + " ".join(f"{a:.2f}" for a in t["accepted_per_position"]))
    sys.stdout.flush()


def _print_step_timing(name: str, reports: list[dict]) -> None:
    for rank, report in enumerate(reports):
        print(f"{name} step breakdown (process {rank}), median ms per step, host / device:")
        for interval, v in report.items():
            print(f"  {interval:26s} {v['host_ms_median']:8.3f} / {v['device_ms_median']:8.3f}  (n={v['count']})")


def gdn_state_gib(target_config: dict, spec: dict | None, tp_size: int, on_gpu: bool) -> float:
    """GDN state per request for a configuration (hybrid/memory.py; before vLLM pads mamba pages to the attention
    page size): vLLM's 1 + num_speculative_tokens state blocks per GDN layer, each conv row widened by them; for
    ddtree on GPU (the replay layout) its one block plus its share of the step's stash and node-state workspace."""
    shapes = memory.GDNShapes.from_config(target_config, tp_size)
    if spec and spec["method"] == "ddtree" and on_gpu:
        return memory.step_bytes(shapes, largest_budget(spec), 1, "replay") / 2**30
    return memory.persistent_bytes_per_request(shapes, largest_budget(spec)) / 2**30


def largest_budget(spec: dict | None) -> int:
    """The most drafts a configuration verifies per request and step ("ddtree default" gives no budget: ddtree's
    largest is DEFAULT_TREE_BUDGET)."""
    if spec is None:
        return 0
    if "num_speculative_tokens" in spec:
        return spec["num_speculative_tokens"]
    return DEFAULT_TREE_BUDGET if spec.get("method") == "ddtree" else 0


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def _first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first token where two outputs differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
