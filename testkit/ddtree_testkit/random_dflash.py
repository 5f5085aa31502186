"""Random-weight DFlash drafters for a target directory: nothing is accepted (τ ≈ 1), so tests and benchmarks use
them for the engine paths and the per-step cost, not for acceptance."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddtree_testkit.dflash_checkpoint import dflash_draft_config, dflash_weight_shapes
from ddtree_testkit.model_cache import build_atomic, cache_dir
from ddtree_testkit.model_files import config_fingerprint
from ddtree_testkit.random_weights import random_tensor


def random_dflash_dir(target_dir: str | os.PathLike, block_size: int = 8, num_layers: int = 1, seed: int = 0, *,
                      mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                      init_std: float = 0.02, cache: str | os.PathLike | None = None, force: bool = False) -> Path:
    """A random-weight DFlash drafter for ``target_dir``, loadable by vLLM 0.26.0 as
    ``speculative_config={"method": "dflash", "model": str(path), "num_speculative_tokens": k}`` (exactly the tensor
    names vLLM's ``qwen3_dflash.py`` loader expects: no ``model.`` prefix, no ``embed_tokens`` / ``lm_head``, both
    shared from the target)."""
    import torch

    target_dir = Path(target_dir).resolve()
    cache = cache_dir(cache)
    cfg = dflash_draft_config(target_dir, block_size=block_size, num_layers=num_layers,
                              mask_token_id=mask_token_id, target_layer_ids=target_layer_ids)
    recipe = {"recipe": "random-dflash", "config": cfg, "seed": seed, "init_std": init_std,
              "target_config_sha": config_fingerprint(target_dir)}
    name = f"dflash-random-{target_dir.name}-b{block_size}-l{num_layers}-s{seed}"

    def build(tmp: Path) -> None:
        from safetensors.torch import save_file

        tensors = {n: random_tensor(s, n, seed, init_std, torch.bfloat16)
                   for n, s in dflash_weight_shapes(cfg).items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    return build_atomic(cache / name, recipe, build, force=force)
