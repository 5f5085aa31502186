"""End-to-end decode speed and acceptance: no-spec vs the DFlash chain vs DDTree, one engine per configuration.

    python benchmarks/bench_e2e.py                       # CPU default: SmolLM2-135M + a random DFlash drafter
    python benchmarks/bench_e2e.py --budgets 16 64 --batch-sizes 1 8 --max-tokens 128 --out out/e2e.json

Every configuration generates greedily for the same prompts; the table gives tokens/s (after a warm-up pass over
the same shapes), τ (mean tokens per verify step, bonus included: 1 + accepted / drafts), and how many outputs
differ from no-spec. CUDA graphs stay on unless --eager (on CPU vLLM runs eagerly anyway). With a random-weight
drafter nothing is accepted, so τ ≈ 1 and the ratios measure pure per-step overhead; a trained drafter
(--drafter) gives real acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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


def worker(args: dict) -> dict:
    """Run one configuration in this process and return its measurements."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args["in_process"]:  # CPU: one process instead of three vLLM imports (the GPU keeps vLLM's default)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args["model"],
        dtype=args["dtype"],
        speculative_config=args["spec"],
        max_model_len=args["max_model_len"],
        max_num_seqs=max(args["batch_sizes"]),
        enforce_eager=args["eager"],
        # On CPU gpu_memory_utilization budgets the worker's whole memory; an explicit KV size is what works there.
        gpu_memory_utilization=args["gpu_memory_utilization"] or 0.9,
        kv_cache_memory_bytes=None if args["gpu_memory_utilization"] else 512 << 20,
        distributed_executor_backend="uni" if args["in_process"] else None,
        disable_log_stats=False,
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True)
               if getattr(tokenizer, "chat_template", None) else p for p in args["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    rows = []
    for batch in args["batch_sizes"]:
        batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch] if batch > len(prompts) else prompts[:batch]
        llm.generate(batch_prompts, params, use_tqdm=False)  # warm-up: same shapes, compiles/captures
        before = _spec_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(batch_prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = _spec_counters(llm)
        drafts = after[0] - before[0]
        accepted = after[1] - before[1]
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append({
            "batch": batch,
            "tokens_per_s": tokens / elapsed,
            "tau": 1 + accepted / drafts if drafts else None,
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        })
    return {"rows": rows}


def _spec_counters(llm) -> tuple[int, int]:
    values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    return values.get("vllm:spec_decode_num_drafts", 0), values.get("vllm:spec_decode_num_accepted_tokens", 0)


def default_models() -> tuple[str, str]:
    sys.path.insert(0, str(ROOT))
    from vllm_ddtree import offline_models

    target = offline_models.smollm2_dir()
    return str(target), str(offline_models.random_dflash_dir(target, block_size=8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--drafter")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16])
    parser.add_argument("--chain-tokens", type=int, default=None, help="DFlash chain drafts (default: block - 1)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="default: 0.5 on GPU; on CPU a "
                        "fixed 512 MiB KV cache")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("BENCH_RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    import torch

    on_gpu = torch.cuda.is_available()
    model, drafter = (args.model, args.drafter) if args.model else default_models()
    drafter = args.drafter or drafter
    block = json.loads((Path(drafter) / "config.json").read_text()).get("block_size", 16)
    chain = args.chain_tokens or block - 1
    configs = [("no-spec", None), ("dflash", {"method": "dflash", "model": drafter, "num_speculative_tokens": chain})]
    configs += [(f"ddtree B={b}", {"method": "ddtree", "model": drafter, "num_speculative_tokens": b})
                for b in args.budgets]
    base = {
        "model": model, "dtype": args.dtype or ("bfloat16" if on_gpu else "float32"), "prompts": DEFAULT_PROMPTS,
        "max_tokens": args.max_tokens, "max_model_len": args.max_model_len, "batch_sizes": args.batch_sizes,
        "eager": args.eager, "gpu_memory_utilization": args.gpu_memory_utilization or (0.5 if on_gpu else None),
        "in_process": not on_gpu,
    }
    results = {}
    for name, spec in configs:
        cmd = [sys.executable, __file__, "--worker", json.dumps({**base, "spec": spec})]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
        if not line:
            print(f"{name}: FAILED\n{proc.stderr[-4000:]}", file=sys.stderr)
            results[name] = None
            continue
        results[name] = json.loads(line[-1][len("BENCH_RESULT "):])
        print(f"{name}: done", file=sys.stderr)

    reference = results.get("no-spec")
    table = []
    for name, res in results.items():
        for i, row in enumerate(res["rows"] if res else []):
            ref_row = reference["rows"][i] if reference else None
            base_tps = ref_row["tokens_per_s"] if ref_row else None
            chain_row = results["dflash"]["rows"][i] if results.get("dflash") else None
            differ = sum(a != b for a, b in zip(row["token_ids"], ref_row["token_ids"])) if ref_row else None
            table.append({
                "config": name, "batch": row["batch"], "tokens_per_s": round(row["tokens_per_s"], 1),
                "tau": round(row["tau"], 3) if row["tau"] else None,
                "vs_no_spec": round(row["tokens_per_s"] / base_tps, 3) if base_tps else None,
                "vs_chain": round(row["tokens_per_s"] / chain_row["tokens_per_s"], 3) if chain_row else None,
                "outputs_differing_from_no_spec": differ, "prompts": len(row["token_ids"]),
            })
    header = f"{'config':14s} {'batch':>5s} {'tok/s':>9s} {'tau':>6s} {'x no-spec':>9s} {'x chain':>8s} {'differ':>7s}"
    print(header)
    for t in table:
        print(f"{t['config']:14s} {t['batch']:5d} {t['tokens_per_s']:9.1f} {t['tau'] or '-':>6} "
              f"{t['vs_no_spec'] or '-':>9} {t['vs_chain'] or '-':>8} "
              f"{t['outputs_differing_from_no_spec']}/{t['prompts']:<3d}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": model, "drafter": drafter, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                "vllm": "0.26.0", "max_tokens": args.max_tokens, "eager": args.eager}
        Path(args.out).write_text(json.dumps({"meta": meta, "table": table}, indent=2))
    failed = [name for name, res in results.items() if res is None]
    if failed:
        sys.exit(f"failed configurations: {', '.join(failed)}")


if __name__ == "__main__":
    main()
