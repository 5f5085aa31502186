"""The trained SmolLM2 drafter shipped in fixtures/ inside the CPU engine (float32): it loads as vLLM's ``dflash``
and as ``ddtree``, it really accepts (a random drafter gives τ ≈ 1), and greedy ddtree with it equals no-spec."""

from __future__ import annotations

from transformers import AutoTokenizer

from ddtree_testkit.engine_run import run_engine
from ddtree_testkit.smollm2 import trained_smollm2_drafter_dir

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Q: A train travels 60 km in 45 minutes. What is its speed in km/h?",
    "Explain why the sky is blue in two sentences.",
]
MIN_TAU = 1.4  # measured on the CPU engine: chain 1.65, ddtree B=16 2.07 on these prompts (random drafter: 1.0)


def tau(result: dict) -> float:
    stats = result["spec_decode"]
    return 1 + stats["vllm:spec_decode_num_accepted_tokens"] / stats["vllm:spec_decode_num_drafts"]


def test_trained_drafter_accepts_as_chain_and_tree_and_stays_lossless(smollm2_dir):
    drafter = str(trained_smollm2_drafter_dir())
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt_ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False).input_ids
                  for p in PROMPTS]
    common = {"model": str(smollm2_dir), "prompt_token_ids": prompt_ids, "max_tokens": 32, "ignore_eos": True}
    reference = run_engine(**common)["token_ids"]
    chain = run_engine(**common, spec={"method": "dflash", "model": drafter, "num_speculative_tokens": 15})
    tree = run_engine(**common, spec={"method": "ddtree", "model": drafter, "num_speculative_tokens": 16})
    print(f"chain τ {tau(chain):.3f}, ddtree τ {tau(tree):.3f}")
    assert tree["token_ids"] == reference
    assert chain["token_ids"] == reference
    assert tau(chain) > MIN_TAU, f"chain τ {tau(chain):.3f}"
    assert tau(tree) > MIN_TAU, f"ddtree τ {tau(tree):.3f}"
