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
    # Qwen3.5/3.6-27B's layer pattern on vLLM's Qwen3-Next model: 64 layers, every 4th full attention (24 q / 4 kv
    # heads of 256, output gate, partial RoPE), 48 GatedDeltaNet layers (16 k / 48 v heads of 128, conv 4), dense
    # MLPs of 17408 (mlp_only_layers: no experts). Shapes from public Qwen3.5-27B training configs (third-party).
    "qwen3.6-27b-hybrid": dict(arch="qwen3_next", num_layers=64, hidden_size=5120, intermediate_size=17408,
                               num_heads=24, num_kv_heads=4, head_dim=256, vocab_size=248320, rope_theta=10000000.0,
                               max_position_embeddings=40960,
                               hybrid=dict(full_attention_interval=4, linear_num_value_heads=48,
                                           linear_num_key_heads=16, linear_key_head_dim=128,
                                           linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                           mlp_only_layers=list(range(64)))),
    "tiny-hybrid": dict(arch="qwen3_next", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
                        num_kv_heads=2, head_dim=64, vocab_size=49152, rope_theta=10000.0,
                        max_position_embeddings=2048),
}


def shaped_target_dir(shape: str, *, tokenizer_dir: str | os.PathLike | None = None,
                      cache: str | os.PathLike | None = None, force: bool = False) -> Path:
    """A config-only target of a real model's shape (``SHAPES``) with SmolLM2's tokenizer: load it in vLLM with
    ``load_format="dummy"``. Token ids past the tokenizer's vocabulary can be generated: don't detokenize.
    ``random_dflash_dir`` makes a drafter for it (with weights: vLLM's DFlash drafter needs loaded weights)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
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
