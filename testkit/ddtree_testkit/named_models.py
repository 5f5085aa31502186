"""The offline models by name: what ``--target smollm2 | tiny-llama | ...`` means to the tools, and the set that
tools/setup_env.sh builds before the tests."""

from __future__ import annotations

import os
from pathlib import Path

from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.smollm2 import smollm2_dir
from ddtree_testkit.tiny_targets import TINY_ARCHS, tiny_target_dir


def resolve_target(spec: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """``smollm2``, ``tiny-<arch>`` (``TINY_ARCHS``) or a model directory -> the model directory."""
    spec = str(spec)
    if spec == "smollm2":
        return smollm2_dir(cache)
    if spec.startswith("tiny-") and spec[5:] in TINY_ARCHS:
        return tiny_target_dir(spec[5:], cache=cache)
    path = Path(spec).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise SystemExit(f"--target {spec!r}: neither smollm2/tiny-llama/tiny-qwen3 nor a model directory")
    return path


def fetch_all(cache: str | os.PathLike | None = None) -> dict[str, Path]:
    """SmolLM2, both tiny targets, and a block-8 random DFlash drafter for each of the three."""
    out: dict[str, Path] = {}
    out["smollm2"] = smollm2_dir(cache)
    out["tiny-llama"] = tiny_target_dir("llama", cache=cache)
    out["tiny-qwen3"] = tiny_target_dir("qwen3", cache=cache)
    for key in ("smollm2", "tiny-llama", "tiny-qwen3"):
        out[f"dflash-{key}"] = random_dflash_dir(out[key], block_size=8, cache=cache)
    return out
