"""The fixture models of ddtree_testkit: configs as vLLM 0.26.0 expects them, the cache (reuse, atomic builds),
non-degenerate tiny targets, the benchmark shapes.

Run: .venv/bin/python -m pytest tests/engine/test_fixture_models.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree_testkit.dflash_checkpoint import build_target_layer_ids, choose_target_layer_ids, dflash_weight_shapes
from ddtree_testkit.model_cache import MARKER, TMP_TAG, cache_dir, is_complete
from ddtree_testkit.model_files import chat_template_text
from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.smollm2 import hf_greedy_chat
from ddtree_testkit.tiny_targets import greedy_continuations, tiny_target_dir

# algorithm.md §1.1 (z-lab build_target_layer_ids, n=5).
LAYER_ID_TABLE = {
    24: [1, 6, 11, 16, 21],
    28: [1, 7, 13, 19, 25],
    30: [1, 8, 14, 20, 27],
    36: [1, 9, 17, 25, 33],
    48: [1, 12, 23, 34, 45],
    62: [1, 16, 30, 44, 59],
}

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
]


# ------------------------------------------------------------------------------------------------------------------
# Pure config logic
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_target_layers,expected", sorted(LAYER_ID_TABLE.items()))
def test_target_layer_ids_formula(num_target_layers, expected):
    assert build_target_layer_ids(num_target_layers, 5) == expected
    assert choose_target_layer_ids(num_target_layers) == expected


def test_target_layer_ids_small_targets():
    assert build_target_layer_ids(30, 1) == [15]
    assert choose_target_layer_ids(4) == [2]  # n>1 would repeat layer 1
    assert choose_target_layer_ids(6) == [1, 2, 3]
    assert choose_target_layer_ids(8) == [1, 2, 3, 4, 5]
    for L in range(2, 70):
        ids = choose_target_layer_ids(L)
        assert len(set(ids)) == len(ids) and all(0 <= i < L for i in ids), (L, ids)


# ------------------------------------------------------------------------------------------------------------------
# Produced directories
# ------------------------------------------------------------------------------------------------------------------
def _check_dflash_dir(draft: Path, target: Path, block_size: int) -> dict:
    from safetensors import safe_open

    cfg = json.loads((draft / "config.json").read_text())
    tcfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == block_size
    assert cfg["hidden_size"] == tcfg["hidden_size"]
    assert cfg["vocab_size"] == tcfg["vocab_size"]
    assert cfg["num_target_layers"] == tcfg["num_hidden_layers"]
    assert cfg["tie_word_embeddings"] is True
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    assert cfg["head_dim"] in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # CPU attention head sizes
    assert cfg.get("layer_types") in (None, ["full_attention"] * cfg["num_hidden_layers"])  # non-causal drafter
    dc = cfg["dflash_config"]
    assert dc["target_layer_ids"] == choose_target_layer_ids(tcfg["num_hidden_layers"])
    assert 0 <= dc["mask_token_id"] < cfg["vocab_size"]
    assert dc["mask_token_id"] not in (tcfg.get("bos_token_id"), tcfg.get("eos_token_id"))
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == dflash_weight_shapes(cfg)
    # vLLM's DFlashQwen3ForCausalLM.load_weights prefixes "model." itself and shares embed/lm_head from the target.
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in shapes)
    assert shapes["fc.weight"] == (cfg["hidden_size"], len(dc["target_layer_ids"]) * cfg["hidden_size"])
    assert is_complete(draft)
    return cfg


def test_smollm2_dir(smollm2_dir, smollm2_dflash_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert "<|im_start|>" in chat_template_text(smollm2_dir)
    assert is_complete(smollm2_dir)
    dcfg = _check_dflash_dir(smollm2_dflash_dir, smollm2_dir, 8)
    assert dcfg["dflash_config"]["target_layer_ids"] == [1, 8, 14, 20, 27]
    assert dcfg["dflash_config"]["mask_token_id"] == 16  # <empty_output>: special, unused by the chat template


def test_smollm2_answers_paris(smollm2_dir):
    answer = hf_greedy_chat(smollm2_dir, max_new_tokens=12)
    assert "paris" in answer.lower(), answer


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_target(arch, request):
    target = request.getfixturevalue(f"tiny_{arch}_dir")
    draft = request.getfixturevalue(f"tiny_{arch}_dflash_dir")
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["vocab_size"] == 49152 and cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0
    assert (target / "tokenizer.json").is_file() and is_complete(target)
    dcfg = _check_dflash_dir(draft, target, 8)
    assert dcfg["dflash_config"]["target_layer_ids"] == [1, 2, 3, 4, 5]

    # Random init is sane: greedy continuations depend on the prompt and are not one repeated token.
    outs = greedy_continuations(target, PROMPTS, max_new_tokens=16)
    assert len({tuple(o) for o in outs}) == len(outs), outs
    for o in outs:
        assert len(set(o)) >= 4, o


def test_tiny_hybrid_target(tiny_hybrid_dir, tiny_hybrid_dflash_dir):
    cfg = json.loads((tiny_hybrid_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next"
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    _check_dflash_dir(tiny_hybrid_dflash_dir, tiny_hybrid_dir, 8)
    outs = greedy_continuations(tiny_hybrid_dir, PROMPTS, max_new_tokens=16)
    assert len({tuple(o) for o in outs}) == len(outs), outs


# ------------------------------------------------------------------------------------------------------------------
# Cache behaviour
# ------------------------------------------------------------------------------------------------------------------
def _tmp_dirs(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if TMP_TAG in p.name]


def test_cache_reused(tmp_path, smollm2_dir, tiny_llama_dir):
    tgt = tiny_target_dir("llama", cache=tmp_path, tokenizer_dir=smollm2_dir, num_layers=2, hidden_size=64)
    assert tgt == tmp_path / "tiny-llama-h64-l2"
    drf = random_dflash_dir(tgt, block_size=16, num_layers=2, cache=tmp_path)
    stamps = {p: (p / MARKER).stat().st_mtime_ns for p in (tgt, drf)}
    inodes = {p: p.stat().st_ino for p in (tgt, drf)}
    assert tiny_target_dir("llama", cache=tmp_path, tokenizer_dir=smollm2_dir, num_layers=2,
                              hidden_size=64) == tgt
    assert random_dflash_dir(tgt, block_size=16, num_layers=2, cache=tmp_path) == drf
    # Reused, not rebuilt: the same marker write and the same directory (a rebuild renames a fresh one in).
    # No wall-clock bound: on a loaded 2-core CI box the reuse path's hashing is as slow as a tiny build.
    for p in (tgt, drf):
        assert (p / MARKER).stat().st_mtime_ns == stamps[p] and p.stat().st_ino == inodes[p]
    assert not _tmp_dirs(tmp_path)
    # The env var selects the cache; a different recipe (seed) is a different directory.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_DDTREE_CACHE", str(tmp_path))
        assert cache_dir() == tmp_path.resolve()
        assert random_dflash_dir(tgt, block_size=16, num_layers=2) == drf
        drf1 = random_dflash_dir(tgt, block_size=16, num_layers=2, seed=1)
    assert drf1 != drf and is_complete(drf1)
    from safetensors.torch import load_file

    w0, w1 = load_file(str(drf / "model.safetensors")), load_file(str(drf1 / "model.safetensors"))
    assert not w0["fc.weight"].equal(w1["fc.weight"])
    # Deterministic: a forced rebuild with the same seed gives identical bytes.
    before = (drf / "model.safetensors").read_bytes()
    random_dflash_dir(tgt, block_size=16, num_layers=2, cache=tmp_path, force=True)
    assert (drf / "model.safetensors").read_bytes() == before


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch, tiny_llama_dir):
    import safetensors.torch

    real_save = safetensors.torch.save_file
    final = tmp_path / f"dflash-random-{tiny_llama_dir.name}-b8-l1-s0"

    def exploding_save(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)  # a full weights file exists in the temp dir ...
        raise KeyboardInterrupt("simulated interrupt")  # ... but the build dies before the marker/rename

    monkeypatch.setattr(safetensors.torch, "save_file", exploding_save)
    with pytest.raises(KeyboardInterrupt):
        random_dflash_dir(tiny_llama_dir, cache=tmp_path)
    assert not final.exists()
    assert not _tmp_dirs(tmp_path)

    # A half directory at the final path (e.g. copied by hand, or from an older tool) is not trusted: rebuilt.
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    final.mkdir()
    (final / "config.json").write_text("{}")
    assert not is_complete(final)
    assert random_dflash_dir(tiny_llama_dir, cache=tmp_path) == final
    assert is_complete(final) and json.loads((final / "config.json").read_text())["architectures"]

    # A stale temp dir from a killed process is cleaned up by the next build of that name.
    stale = tmp_path / f".{final.name}{TMP_TAG}dead"
    stale.mkdir()
    random_dflash_dir(tiny_llama_dir, cache=tmp_path, force=True)
    assert not stale.exists()

    # A truncated weights file makes the directory incomplete again.
    with open(final / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert not is_complete(final)
