"""The data step: the target continues the prompts, greedily and sampled, and the features of the drafter's target
layers are taken for every token; the result is cached under its recipe key."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddtree_testkit.train_dflash.data_options import (
    DataOptions,
    cache_key,
    data_recipe,
    default_data_dir,
    target_layer_ids,
)
from ddtree_testkit.train_dflash.features import (
    generate_with_features,
    load_target_model,
    resolve_device,
    teacher_forced_features,
)
from ddtree_testkit.train_dflash.packing import pack
from ddtree_testkit.train_dflash.prompts import build_prompts


def prepare_data(target_dir: str | os.PathLike, data_dir: str | os.PathLike | None = None, *,
                 opts: DataOptions | None = None, layer_ids: list[int] | None = None,
                 train_prompts: list[dict] | None = None, heldout_prompts: list[dict] | None = None,
                 device: str = "auto", force: bool = False) -> Path:
    """Build (or reuse) the data cache for ``target_dir`` and return its directory.

    ``train_prompts`` / ``heldout_prompts`` (lists of ``{"source", "id", "ids"}``) replace the built-in sources."""
    target_dir = Path(target_dir).resolve()
    opts = opts or DataOptions()
    layer_ids = list(layer_ids) if layer_ids is not None else target_layer_ids(target_dir)
    recipe = data_recipe(target_dir, layer_ids, opts, train_prompts, heldout_prompts)
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir(target_dir, recipe)
    meta_path = data_dir / "meta.json"
    if not force and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("key") == cache_key(recipe):
            return data_dir
        raise SystemExit(f"{data_dir} holds data of another recipe; pass another --data-dir or --force-data")
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if opts.generator not in ("hf", "vllm") or opts.features not in ("stored", "online"):
        raise ValueError(f"generator must be hf|vllm and features stored|online: {opts.generator}, {opts.features}")
    t0 = time.monotonic()
    dev = resolve_device(device)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    if train_prompts is None or heldout_prompts is None:
        built_train, built_heldout = build_prompts(
            tok, humaneval=opts.humaneval, mtbench=opts.mtbench, stdlib=opts.stdlib,
            heldout_gsm8k=opts.heldout_gsm8k, heldout_humaneval=opts.heldout_humaneval, seed=opts.seed,
            max_prompt_tokens=opts.max_prompt_tokens, mtbench_turns=opts.mtbench_turns, math=opts.math,
            code_tasks=opts.code_tasks, truthfulqa=opts.truthfulqa, hellaswag=opts.hellaswag)
        train_prompts = built_train if train_prompts is None else train_prompts
        heldout_prompts = built_heldout if heldout_prompts is None else heldout_prompts
    fdtype = getattr(torch, opts.feature_dtype)
    data_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    splits = {"train": (train_prompts, [("greedy", opts.greedy), ("sampled", opts.sampled)]),
              "heldout": (heldout_prompts, [("greedy", 1)])}
    timings: dict[str, float] = {}
    generated: dict[str, tuple[list[tuple[list[int], Any]], list[int], list[str]]] = {}
    if opts.generator == "vllm":
        # every split's requests in ONE engine run; sampled: one request with n = opts.sampled (vLLM seeds the
        # children seed + index)
        requests, where = [], []
        for split, (prompts, modes) in splits.items():
            for mode, count in modes:
                if count <= 0:
                    continue
                for pi, pr in enumerate(prompts):
                    if mode == "greedy":  # greedy repeats are identical: generate once
                        requests.append({"prompt": pr["ids"], "n": 1, "temperature": 0.0, "seed": None})
                    else:
                        requests.append({"prompt": pr["ids"], "n": count, "temperature": opts.sample_temperature,
                                         "seed": opts.seed * 1_000_003 + (split == "heldout") * 500_009 + pi * 101})
                    where.append((split, mode, pi))
        from ddtree_testkit.train_dflash.vllm_generation import generate_vllm  # runs itself as a module: not at import

        tg = time.monotonic()
        outs = generate_vllm(target_dir, requests, max_new_tokens=opts.max_new_tokens, seed=opts.seed,
                             max_model_len=opts.max_prompt_tokens + opts.max_new_tokens + 8,
                             max_num_seqs=opts.vllm_max_num_seqs,
                             gpu_memory_utilization=opts.vllm_gpu_memory_utilization,
                             enforce_eager=opts.vllm_enforce_eager)
        timings["vllm_generate_s"] = round(time.monotonic() - tg, 1)
        for split in splits:
            generated[split] = ([], [], [])
        by_key = {}
        for (split, mode, pi), conts in zip(where, outs):
            by_key[(split, mode, pi)] = conts
        for split, (prompts, modes) in splits.items():
            seqs, plens, tags = generated[split]
            for mode, count in modes:  # same order as the hf generator: mode, repeat, prompt
                for rep in range(max(count, 0)):
                    for pi, pr in enumerate(prompts):
                        cont = by_key[(split, mode, pi)][rep if mode == "sampled" else 0]
                        seqs.append((list(pr["ids"]) + list(cont), None))
                        plens.append(len(pr["ids"]))
                        tags.append(f"{pr['source']}:{pr['id']}:{mode}{rep}")
        model = None
        if opts.features == "stored":
            model = load_target_model(target_dir, dev)
            tf = time.monotonic()
            for split, (seqs, _, _) in generated.items():
                feats = teacher_forced_features(model, [ids for ids, _ in seqs], layer_ids,
                                                batch_tokens=opts.tf_batch_tokens, feature_dtype=fdtype,
                                                desc=f"{split}/features")
                seqs[:] = [(ids, f) for (ids, _), f in zip(seqs, feats)]
            timings["feature_pass_s"] = round(time.monotonic() - tf, 1)
    else:
        model = load_target_model(target_dir, dev)
        for split, (prompts, modes) in splits.items():
            seqs, plens, tags = [], [], []
            for mode, count in modes:
                for rep in range(count):
                    res = generate_with_features(
                        model, tok, [p["ids"] for p in prompts], layer_ids, max_new_tokens=opts.max_new_tokens,
                        sample=mode == "sampled", seed=opts.seed * 1000 + rep * 10 + (split == "heldout"),
                        batch_size=opts.gen_batch_size, feature_dtype=fdtype, desc=f"{split}/{mode}#{rep}",
                        temperature=opts.sample_temperature)
                    seqs += [(ids, f if opts.features == "stored" else None) for ids, f in res]
                    plens += [len(p["ids"]) for p in prompts]
                    tags += [f"{p['source']}:{p['id']}:{mode}{rep}" for p in prompts]
            generated[split] = (seqs, plens, tags)
    for split, (seqs, plens, tags) in generated.items():
        packed = pack(seqs, plens)
        tmp = data_dir / f".{split}.safetensors.tmp"
        save_file(packed, str(tmp))
        os.replace(tmp, data_dir / f"{split}.safetensors")
        n_cont = int(sum(len(ids) - pl for (ids, _), pl in zip(seqs, plens)))
        sources: dict[str, int] = {}
        for t in tags:
            sources[t.split(":", 1)[0]] = sources.get(t.split(":", 1)[0], 0) + 1
        summary[split] = {"sequences": len(seqs), "tokens": int(packed["ids"].numel()), "continuation_tokens": n_cont,
                          "sources": sources, "tags": tags}
    target_dtype = str(next(model.parameters()).dtype) if model is not None else "vllm"
    meta = {"key": cache_key(recipe), "recipe": recipe, "target_dir": str(target_dir), "layer_ids": layer_ids,
            "target_dtype": target_dtype, "device": str(dev), "features": opts.features,
            "generator": opts.generator, "timings": timings, "splits": summary,
            "build_seconds": round(time.monotonic() - t0, 1)}
    tmp = data_dir / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, meta_path)
    print(f"[data] {data_dir}: " + ", ".join(f"{s}: {v['sequences']} seqs / {v['continuation_tokens']} generated "
                                             f"tokens" for s, v in summary.items())
          + f" ({meta['build_seconds']} s)", file=sys.stderr)
    return data_dir
