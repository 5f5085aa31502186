"""Run the CPU vLLM engine once and print the generated token ids as JSON (tests run this in a subprocess).

    python -m ddtree_testkit.engine_run '{"spec": null | {...}, "prompts": [...], "max_tokens": 32, ...}'

The engine runs in this process unless tensor parallel asks for worker processes. ``"oracle"`` replaces the ddtree
drafter's logits, in every process (oracle_site/sitecustomize.py), with an oracle that knows the no-spec
continuation: it puts the right token first, second or nowhere at each depth with the given probabilities. A
random-weight drafter accepts nothing, so without the oracle a verify step would never accept a node and the tree
paths (walk, compaction, linearisation, depth positions) would go untested. Runs check that tensor-parallel ranks
accept the same paths (VLLM_DDTREE_CHECK_RANKS=1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _cpu_engine_without_amx() -> None:
    """Run vLLM's CPU engine as on a CPU without AMX, whatever this one has, so the tests see one code path on
    every CPU (tests/engine/conftest.py says what AMX changes)."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


RUNNER = Path(__file__)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Translate to German: good morning",
    "import numpy as np\n",
    "Q: What is 12 * 7?\nA:",
    "The quick brown fox",
]


def run_engine(env: dict[str, str] | None = None, **args) -> dict:
    """Run this script in a fresh process with ``args`` (and ``env`` over the checks' defaults) and return its JSON
    result.

    ``oracle`` travels through oracle_site/sitecustomize.py, so every process of the engine (TP workers too)
    drafts from it. ``audit_syncs`` records host synchronisations under vllm_ddtree code (sync_audit.py) into the
    result's ``sync_audit``."""
    env = {**os.environ, "VLLM_DDTREE_CHECK_RANKS": "1", "VLLM_DDTREE_CHECK_TREES": "1", **(env or {})}
    env.pop("TRITON_INTERPRET", None)
    oracle = args.pop("oracle", None)
    with tempfile.TemporaryDirectory() as tmp:
        if oracle:
            oracle_file = Path(tmp) / "oracle.json"
            oracle_file.write_text(json.dumps(oracle))
            site = str(RUNNER.parent / "oracle_site")
            env["PYTHONPATH"] = os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            env["VLLM_DDTREE_TEST_ORACLE"] = str(oracle_file)
        proc = _run_logged([sys.executable, "-m", "ddtree_testkit.engine_run", json.dumps(args)], env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{_failure_excerpt(proc.stdout, proc.stderr)}")
    return json.loads(lines[-1][len("ENGINE_RESULT ") :])


def _run_logged(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the engine process. With VLLM_DDTREE_TEST_LOG_DIR set (GPU sessions) its streams go to files there as
    they come, its wall time at the end of stdout's: a phase killed on its time limit still says where time went."""
    log_dir = os.environ.get("VLLM_DDTREE_TEST_LOG_DIR")
    if not log_dir:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    log = Path(tempfile.mkstemp(prefix="engine_run_", suffix=".log", dir=log_dir)[1])
    err_log = log.with_suffix(".stderr.log")
    started = time.monotonic()
    with open(log, "w") as out, open(err_log, "w") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, text=True, timeout=900, env=env)
    stdout, stderr = log.read_text(), err_log.read_text()
    with open(log, "a") as out:
        out.write(f"\n=== wall {time.monotonic() - started:.1f} s ===\n")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _failure_excerpt(stdout: str, stderr: str) -> str:
    """The first traceback (a worker's root cause; the engine's own comes later and only says it failed), the tail
    of stdout (where vLLM logs, a worker's "WorkerProc hit an exception" included) and of stderr."""
    first = stderr.find("Traceback")
    head = stderr[first: first + 4000] + "\n[...]\n" if 0 <= first < len(stderr) - 6000 else ""
    return f"{head}{stderr[-6000:]}\n=== stdout tail ===\n{stdout[-3000:]}"


def install_oracle(reference: dict[tuple[int, ...], list[int]], p_first: float, p_second: float, seed: int):
    """Make DDTreeProposer draft from the reference continuations (keyed by prompt token ids), through its
    ``draft_logits_hook`` seam: the drafter, the tree build and the hand-over run as in production; only the draft
    logits are replaced. At each depth the right token gets the first or second best logit (or neither), beside a
    random decoy."""
    import torch

    from vllm_ddtree.v1.proposer import DDTreeProposer

    rng = torch.Generator().manual_seed(seed)

    def oracle_logits(proposer, logits: torch.Tensor) -> torch.Tensor:
        num_reqs, depth, vocab = logits.shape
        device = logits.device
        logits = torch.randn(logits.shape, generator=rng)
        roots = proposer.positions[: num_reqs * (1 + depth)].view(num_reqs, 1 + depth)[:, 0].tolist()
        for r, req_id in enumerate(proposer.runner.input_batch.req_ids[:num_reqs]):
            prompt = tuple(proposer.runner.requests[req_id].prompt_token_ids)
            sequence = list(prompt) + reference[prompt]
            for i in range(depth):
                pos = roots[r] + 1 + i
                if pos >= len(sequence):
                    break
                u = torch.rand((), generator=rng).item()
                decoy = int(torch.randint(vocab, (), generator=rng))
                logits[r, i, decoy] += 9.0
                if u < p_first:
                    logits[r, i, sequence[pos]] += 10.0
                elif u < p_first + p_second:
                    logits[r, i, sequence[pos]] += 8.0
        return logits.to(device)

    DDTreeProposer.draft_logits_hook = oracle_logits


def abort_run(llm, prompts, params, steps: int) -> dict:
    """Start every prompt, step the engine, abort the even-numbered requests, finish the rest; count free blocks."""
    engine = llm.llm_engine
    block_pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_at_start = block_pool.get_num_free_blocks()
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    for _ in range(steps):
        engine.step()
    engine.abort_request(ids[::2])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
    return {
        "free_at_start": free_at_start,
        "free_at_end": block_pool.get_num_free_blocks(),
        "finished": finished,
    }


def main() -> None:
    args = json.loads(sys.argv[1])
    tensor_parallel = args.get("tensor_parallel_size", 1)
    if tensor_parallel > 1:  # one worker process per rank, one core each
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tensor_parallel))
    audit_file = None
    if args.get("audit_syncs"):
        from ddtree_testkit import sync_audit

        fd, audit_file = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        sync_audit.install(audit_file)
    from vllm import LLM, SamplingParams

    from ddtree_testkit.engine_args import TEXT_ONLY_MM_LIMITS, hybrid_engine_args

    llm = LLM(
        model=args["model"],
        dtype=args.get("dtype", "float32"),
        speculative_config=args.get("spec"),
        gpu_memory_utilization=0.1,
        max_model_len=args.get("max_model_len", 512),
        max_num_seqs=args.get("max_num_seqs", 8),
        max_num_batched_tokens=args.get("max_num_batched_tokens", 1024),
        # GPU sessions (tools/gpu_session.sh) run the same checks with graphs on, and may put the no-spec reference
        # on DDTree's attention backend (with VLLM_USE_V2_MODEL_RUNNER=0 also on its runner).
        enforce_eager=os.environ.get("VLLM_DDTREE_TEST_CUDA_GRAPHS") != "1",
        attention_backend=os.environ.get("VLLM_DDTREE_TEST_ATTENTION_BACKEND"),
        # GPU sessions may set async scheduling (VLLM_DDTREE_TEST_ASYNC_SCHEDULING 1 / 0; unset: the default).
        async_scheduling={"1": True, "0": False}.get(os.environ.get("VLLM_DDTREE_TEST_ASYNC_SCHEDULING", "")),
        tensor_parallel_size=tensor_parallel,
        distributed_executor_backend="uni" if tensor_parallel == 1 else "mp",
        seed=0,
        disable_log_stats=False,
        num_gpu_blocks_override=args.get("num_gpu_blocks"),
        # A fixed KV cache skips vLLM's start-up memory profiling, which fails while another engine on the GPU frees
        # memory: engines that start side by side (lossless_check.concurrently) set it.
        kv_cache_memory_bytes=args.get("kv_cache_memory_bytes"),
        block_size=args.get("block_size"),
        mamba_ssm_cache_dtype=args.get("mamba_ssm_cache_dtype", "auto"),
        enable_prefix_caching=args.get("enable_prefix_caching"),
        limit_mm_per_prompt=TEXT_ONLY_MM_LIMITS if args.get("text_only") else None,
        # GatedDeltaNet targets on a GPU host without FlashInfer: vLLM's Triton prefill (ddtree_testkit).
        gdn_prefill_backend=hybrid_engine_args().get("gdn_prefill_backend"),
    )
    params = [
        SamplingParams(
            temperature=args.get("temperature", 0.0),
            max_tokens=args.get("max_tokens", 32),
            seed=args.get("seed"),
            ignore_eos=args.get("ignore_eos", False),
            logprobs=args.get("logprobs"),
        )
    ]
    prompts = [{"prompt_token_ids": p} for p in args["prompt_token_ids"]]
    chain_drafts = _count_calls("vllm_ddtree.v1.proposer", "build_chain")
    results = []
    if args.get("abort_after_steps") is not None:
        print("ENGINE_RESULT " + json.dumps(abort_run(llm, prompts, params[0], args["abort_after_steps"])), flush=True)
        return
    if args.get("one_at_a_time"):
        for prompt in prompts:
            results += llm.generate([prompt], params * 1, use_tqdm=False)
    else:
        results = llm.generate(prompts, params * len(prompts), use_tqdm=False)
    out = {"token_ids": [list(r.outputs[0].token_ids) for r in results],
           "num_cached_tokens": [r.num_cached_tokens for r in results]}  # prefix-cache hits per request
    if args.get("logprobs") is not None:  # each output token's own logprob
        out["logprobs"] = [
            [step[t].logprob for t, step in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)] for r in results
        ]
    metrics = {
        m.name: getattr(m, "value", None) if hasattr(m, "value") else list(getattr(m, "values", []))
        for m in llm.get_metrics()
        if "spec_decode" in m.name
    }
    out["spec_decode"] = metrics
    policy = getattr(_in_process_scheduler(llm), "budget_policy", None)
    if policy is not None:  # ddtree's cost-aware scheduler: per verified draft count, the requests' accepted drafts
        out["budget_policy"] = {"chain": policy.chain,
                                "accepted": {str(b): list(w.samples) for b, w in policy.accepted.items()},
                                "counterfactual": {str(b): n for b, n in policy.counterfactual.items()},
                                "chain_drafts": chain_drafts[0]}
    if audit_file:
        out["sync_audit"] = json.loads(Path(audit_file).read_text() or "[]")
    out["preemptions"] = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    print("ENGINE_RESULT " + json.dumps(out), flush=True)


def _count_calls(module_name: str, name: str) -> list[int]:
    """Wrap ``module.name`` to count its calls in this process (the CPU engine's worker runs here; calls made
    inside a replayed CUDA graph are not seen)."""
    import importlib

    module = importlib.import_module(module_name)
    fn, count = getattr(module, name), [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return fn(*args, **kwargs)

    setattr(module, name, counted)
    return count


def _in_process_scheduler(llm):
    """The engine core's scheduler where the core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


if __name__ == "__main__":
    _cpu_engine_without_amx()
    main()
