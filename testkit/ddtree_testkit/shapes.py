"""Real models' shapes, for timing with random weights that vLLM makes in memory (``load_format="dummy"``): only
config.json (and a tokenizer) is written, so an 8B-shaped target costs no disk and no transfer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from ddtree_testkit.model_cache import build_atomic, cache_dir
from ddtree_testkit.model_files import tokenizer_files, tokenizer_ids
from ddtree_testkit.smollm2 import smollm2_dir
from ddtree_testkit.tiny_targets import TINY_DEFAULTS, tiny_config

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(arch="qwen3", num_layers=36, hidden_size=4096, intermediate_size=12288, num_heads=32,
                     num_kv_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                     max_position_embeddings=40960),
    "qwen3-32b": dict(arch="qwen3", num_layers=64, hidden_size=5120, intermediate_size=25600, num_heads=64,
                      num_kv_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                      max_position_embeddings=40960),
    "tiny": dict(arch="qwen3", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                 head_dim=64, vocab_size=49152, rope_theta=10000.0, max_position_embeddings=2048),
    "tiny-hybrid": dict(arch="qwen3_next", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
                        num_kv_heads=2, head_dim=64, vocab_size=49152, rope_theta=10000.0,
                        max_position_embeddings=2048),
}


def shaped_target_dir(shape: str, *, tokenizer_dir: str | os.PathLike | None = None,
                      cache: str | os.PathLike | None = None, force: bool = False) -> Path:
    """A config-only target of a real model's shape (``SHAPES``) with SmolLM2's tokenizer: load it in vLLM with
    ``load_format="dummy"``. Token ids past the tokenizer's vocabulary can be generated: don't detokenize.
    ``random_dflash_dir`` makes a drafter for it (with weights: vLLM's DFlash drafter needs loaded weights)."""
    from ddtree_testkit import qwen3_5_models

    if shape in qwen3_5_models.SHAPES:  # Qwen3.5/3.6 (qwen3.6-27b): a vision tower and its processor files too
        return qwen3_5_models.qwen3_5_shaped_dir(shape, tokenizer_dir=tokenizer_dir, cache=cache, force=force)
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted([*SHAPES, *qwen3_5_models.SHAPES])}, got {shape!r}")
    cache = cache_dir(cache)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else smollm2_dir(cache)
    params = {**TINY_DEFAULTS, **SHAPES[shape], "tie_word_embeddings": False}
    tok_files = tokenizer_files(tok_dir)
    recipe = {"recipe": "shaped-target", "shape": shape, "params": params}

    def build(tmp: Path) -> None:
        ids = tokenizer_ids(tok_dir)
        tiny_config(params["arch"], params, ids).save_pretrained(tmp)
        for f in tok_files:
            shutil.copy2(tok_dir / f, tmp / f)

    return build_atomic(cache / f"shaped-{shape}", recipe, build, force=force)
