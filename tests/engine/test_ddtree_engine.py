"""DDTree inside the real vLLM engine (CPU, float32): lossless greedy decoding, sampling, refused configs.

Each case runs ``engine_run.py`` in a subprocess (one engine per configuration). The drafter is a random-weight
DFlash checkpoint; to make verify steps accept nodes, the ddtree runs replace its logits with an oracle that knows
the no-spec continuation (engine_run.install_oracle), so greedy equality covers accepted paths, KV compaction,
depth positions and the drafter's linearised inputs, not just rejected trees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("engine_run.py")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Translate to German: good morning",
    "import numpy as np\n",
    "Q: What is 12 * 7?\nA:",
    "The quick brown fox",
]


def run_engine(**args) -> dict:
    proc = subprocess.run([sys.executable, str(RUNNER), json.dumps(args)], capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("ENGINE_RESULT ") :])


@pytest.fixture(scope="module")
def prompt_ids(tiny_llama_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompt_ids) -> list[list[int]]:
    """Greedy no-spec continuations (ignore_eos: the random model would stop at arbitrary points otherwise)."""
    return run_engine(model=str(tiny_llama_dir), prompt_token_ids=prompt_ids, max_tokens=48, ignore_eos=True)[
        "token_ids"
    ]


def ddtree_spec(drafter: Path, budget: int) -> dict:
    return {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": budget}


@pytest.mark.parametrize("budget", [1, 8, 32, 64])
def test_greedy_ddtree_equals_no_spec_batched(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference, budget):
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=48,
        ignore_eos=True,
        spec=ddtree_spec(tiny_llama_dflash_dir, budget),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference, "seed": budget},
    )
    assert result["token_ids"] == reference
    stats = result["spec_decode"]
    assert stats["vllm:spec_decode_num_drafts"] > 0
    # The oracle makes trees accept; a walk that never accepts would leave this at 0 and prove nothing.
    assert stats["vllm:spec_decode_num_accepted_tokens"] > stats["vllm:spec_decode_num_drafts"] // 2


def test_greedy_ddtree_equals_no_spec_one_at_a_time(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids[:4],
        max_tokens=48,
        ignore_eos=True,
        one_at_a_time=True,
        spec=ddtree_spec(tiny_llama_dflash_dir, 16),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
    )
    assert result["token_ids"] == reference[:4]


def test_sampled_ddtree_runs_and_seed_reproduces(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    kwargs = dict(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids[:4],
        max_tokens=24,
        ignore_eos=True,
        temperature=0.8,
        seed=1234,
        spec=ddtree_spec(tiny_llama_dflash_dir, 8),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
    )
    first, second = run_engine(**kwargs), run_engine(**kwargs)
    assert all(len(t) == 24 for t in first["token_ids"])
    assert first["token_ids"] == second["token_ids"]
