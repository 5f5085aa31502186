"""Shared fixtures for engine tests.

# --- offline models (ddtree_testkit) -----------------------------------------------------------------------------
Session-scoped paths to the offline model directories (built on first use in the model cache,
``$VLLM_DDTREE_CACHE`` or ``<repo>/.cache/models``; `python -m ddtree_testkit fetch-all` pre-builds them). Other
sections may be added below.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddtree_testkit import smollm2, tiny_targets
from ddtree_testkit.random_dflash import random_dflash_dir

# The engines run as on a CPU without AMX, whatever this one has (no test may depend on the CPU model): the engine
# processes report no AMX tiles (ddtree_testkit.engine_run), and so does this one, where configs are built; on a CPU
# with AMX, vLLM 0.26.0 would take other paths (AMX CPU attention for bf16, whose cache layout ddtree's tree attention
# avoids: attention/backend.py vector_cache_isa; an AMX GatedDeltaNet path). oneDNN is capped below AMX for every
# process the tests start: vLLM's own GDN prefill kernel (chunk_gated_delta_rule_cpu, oneDNN brgemm) died with
# SIGILL on a sandboxed Sapphire Rapids CI box (2026-12-05, no-spec too) and ran with the cap. CPUs without AMX run
# as before.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
torch.cpu._is_amx_tile_supported = lambda: False


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, bf16 HF dir (llama arch, 30 layers, H 576, vocab 49152)."""
    return smollm2.smollm2_dir()


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_dir) -> Path:
    """Random tiny Llama target (8 layers, H 256, 4/2 heads, head_dim 64, SmolLM2 tokenizer)."""
    return tiny_targets.tiny_target_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(smollm2_dir) -> Path:
    """Random tiny Qwen3 target (same shape as tiny_llama_dir, with q/k norms)."""
    return tiny_targets.tiny_target_dir("qwen3")


@pytest.fixture(scope="session")
def tiny_hybrid_dir(smollm2_dir) -> Path:
    """Random tiny Qwen3-Next target: GatedDeltaNet layers with every 4th full attention, a 4-expert MoE."""
    return tiny_targets.tiny_target_dir("qwen3_next")


@pytest.fixture(scope="session")
def tiny_hybrid_dflash_dir(tiny_hybrid_dir) -> Path:
    return random_dflash_dir(tiny_hybrid_dir, block_size=8)


@pytest.fixture(scope="session")
def tiny_llama_dflash_dir(tiny_llama_dir) -> Path:
    """Random 1-layer DFlash drafter (block 8, target_layer_ids [1,2,3,4,5]) for tiny_llama_dir."""
    return random_dflash_dir(tiny_llama_dir, block_size=8)


@pytest.fixture(scope="session")
def tiny_qwen3_dflash_dir(tiny_qwen3_dir) -> Path:
    """Random 1-layer DFlash drafter (block 8) for tiny_qwen3_dir."""
    return random_dflash_dir(tiny_qwen3_dir, block_size=8)


@pytest.fixture(scope="session")
def smollm2_dflash_dir(smollm2_dir) -> Path:
    """Random 1-layer DFlash drafter (block 8, target_layer_ids [1,8,14,20,27]) for SmolLM2."""
    return random_dflash_dir(smollm2_dir, block_size=8)


# --- end offline models ------------------------------------------------------------------------------------------


# --- ddtree engine runs -------------------------------------------------------------------------------------------
from ddtree_testkit.engine_run import PROMPTS, run_engine  # noqa: E402


@pytest.fixture(scope="session")
def prompt_ids(tiny_llama_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="session")
def reference(tiny_llama_dir, prompt_ids) -> list[list[int]]:
    """Greedy no-spec continuations (ignore_eos: the random model would stop at arbitrary points otherwise)."""
    return run_engine(model=str(tiny_llama_dir), prompt_token_ids=prompt_ids, max_tokens=48, ignore_eos=True)[
        "token_ids"
    ]


