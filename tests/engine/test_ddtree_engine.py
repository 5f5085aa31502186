"""DDTree inside the real vLLM engine (CPU, float32): lossless greedy decoding, sampling, refused configs.

Each case runs ``ddtree_testkit.engine_run`` in a subprocess (one engine per configuration). The drafter is a
random-weight DFlash checkpoint; to make verify steps accept nodes, the ddtree runs replace its logits with an oracle
that knows the no-spec continuation (engine_run.install_oracle), so greedy equality covers accepted paths, KV
compaction, depth positions and the drafter's linearised inputs, not just rejected trees.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddtree_testkit.engine_run import run_engine


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


def test_a_second_turn_reuses_the_cached_blocks_ddtree_wrote(tiny_llama_dir, tiny_llama_dflash_dir):
    """Prefix caching across turns: the second turn's prompt is the first turn's prompt and output, so it hits the
    blocks the first turn left, generated tokens included, whose K/V ddtree's verify steps wrote and KV compaction
    moved onto the accepted path. Both turns' outputs are no-spec's."""
    block = 128  # the CPU engine's block size
    first_prompt = [(37 * i) % 4000 + 100 for i in range(200)]
    engine = {"model": str(tiny_llama_dir), "max_tokens": 200, "ignore_eos": True, "max_model_len": 1024,
              "enable_prefix_caching": True}
    first = run_engine(prompt_token_ids=[first_prompt], **engine)["token_ids"][0]
    second_prompt = first_prompt + first
    second = run_engine(prompt_token_ids=[second_prompt], **engine)["token_ids"][0]
    prompts, reference = [first_prompt, second_prompt], [first, second]
    result = run_engine(prompt_token_ids=prompts, one_at_a_time=True, spec=ddtree_spec(tiny_llama_dflash_dir, 16),
                        oracle={"prompt_token_ids": prompts, "continuations": reference, "seed": 11}, **engine)
    assert result["token_ids"] == reference
    # 400 tokens of prefix: blocks 0-2 full, one held back for the drafter (vLLM's EAGLE rule): blocks 0 and 1, the
    # second holding generated tokens 200-255.
    assert result["num_cached_tokens"] == [0, 2 * block], result["num_cached_tokens"]
    stats = result["spec_decode"]
    assert stats["vllm:spec_decode_num_accepted_tokens"] > stats["vllm:spec_decode_num_drafts"] // 2


def test_adaptive_budget_follows_the_batch_size_schedule(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    """The adaptive budget (vLLM's dynamic speculation schedule): every verify step of this batch of 4 verifies the
    first 3 nodes of a 16-node tree, and stays lossless."""
    assert len(prompt_ids) >= 2  # the batch falls in the schedule's second range
    spec = {**ddtree_spec(tiny_llama_dflash_dir, 16), "num_speculative_tokens_per_batch_size": [[1, 1, 16], [2, 8, 3]]}
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=48,
        ignore_eos=True,
        spec=spec,
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference, "seed": 3},
    )
    assert result["token_ids"] == reference
    stats = result["spec_decode"]
    assert stats["vllm:spec_decode_num_drafts"] > 0
    assert stats["vllm:spec_decode_num_draft_tokens"] == 3 * stats["vllm:spec_decode_num_drafts"]
    assert stats["vllm:spec_decode_num_accepted_tokens"] > stats["vllm:spec_decode_num_drafts"] // 2


@pytest.mark.parametrize("budgets, fewest", [([3, 16], 3), (["chain", 16], 7)], ids=["trees", "chain"])
def test_cost_aware_budget_verifies_several_budgets_losslessly(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids,
                                                              reference, budgets, fewest):
    """``tree_budgets``: ddtree's scheduler picks each step's budget (budget_policy.py); it tries both choices
    before it settles, and whichever it picks, the outputs are no-spec's. ``"chain"``: chain steps verify
    ``tree_depth`` = 7 drafts, the DFlash chain, causally; they accept the oracle drafter's chain. The drafter
    builds no tree before a step the scheduler already gave to the chain: it files the chain alone (``build_chain``).
    Each step verified at 16 also tells the policy what the fewest drafts would have accepted on its tokens
    (acceptance_by_choice.py, through patch 0002's hook); a step verified at the fewest tells nothing of 16."""
    spec = {"method": "ddtree", "model": str(tiny_llama_dflash_dir), "tree_budgets": budgets}
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=48,
        ignore_eos=True,
        spec=spec,
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference, "seed": 5},
    )
    assert result["token_ids"] == reference
    stats = result["spec_decode"]
    drafts, draft_tokens = stats["vllm:spec_decode_num_drafts"], stats["vllm:spec_decode_num_draft_tokens"]
    assert fewest * drafts < draft_tokens < 16 * drafts  # steps verified the fewest drafts and steps verified 16
    assert stats["vllm:spec_decode_num_accepted_tokens"] > drafts // 2
    policy = result["budget_policy"]
    assert policy["chain"] == (fewest if "chain" in budgets else None)
    fewest_accepted = policy["accepted"][str(fewest)]  # the oracle ranks the right token first at ~half the depths
    assert len(fewest_accepted) >= 8 and sum(a > 0 for a in fewest_accepted) >= len(fewest_accepted) // 4, policy
    assert (policy["chain_drafts"] > 0) == ("chain" in budgets), policy
    assert policy["counterfactual"][str(fewest)] > 0 and policy["counterfactual"]["16"] == 0, policy
    assert all(0 <= a <= 7 for a in fewest_accepted), policy  # at most the depth


# The one host synchronisation DDTree's code may make in a step on the CPU engine: its PyTorch KV compaction
# (``nonzero``). GPU engines compact with the Triton kernel instead (kv_layout.TargetKVCompaction picks it when every
# target layer is on TreeTritonAttentionImpl).
CPU_ONLY_SYNCS = {("nonzero", "vllm_ddtree/kv_compact.py", "kv_compact_torch")}


@pytest.mark.parametrize("budgets", [None, ["chain", 16]], ids=["fixed", "cost_aware"])
def test_decode_steps_make_no_host_sync_in_ddtree_code(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference,
                                                       budgets):
    """Every torch call of every engine step is watched (sync_audit.py); none under vllm_ddtree code may make a GPU
    host wait: tree build, verify preparation, walk, compaction, linearisation, the next draft's inputs; under budget
    choices also the chain steps and each choice's acceptance (acceptance_by_choice.py)."""
    spec = ddtree_spec(tiny_llama_dflash_dir, 16)
    if budgets is not None:
        spec = {"method": "ddtree", "model": str(tiny_llama_dflash_dir), "tree_budgets": budgets}
    result = run_engine(
        env={"VLLM_DDTREE_CHECK_TREES": "0", "VLLM_DDTREE_CHECK_RANKS": "0"},  # both sync on purpose (checks)
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=24,
        ignore_eos=True,
        spec=spec,
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference, "seed": 11},
        audit_syncs=True,
    )
    assert [t[:24] for t in reference] == result["token_ids"]
    assert result["spec_decode"]["vllm:spec_decode_num_accepted_tokens"] > 0  # accepted paths were compacted
    syncs = [r for r in result["sync_audit"]
             if (r["call"], r["in"].split(":")[0], r["in"].split()[-1]) not in CPU_ONLY_SYNCS]
    assert syncs == []
    if not torch.cuda.is_available():  # (GPU sessions run this too; there the Triton compaction has no sync)
        assert result["sync_audit"], "the CPU compaction's nonzero was not seen: is the audit watching the steps?"


def test_greedy_ddtree_stays_lossless_when_vllm_skips_drafting(
    tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference
):
    """Within B + 1 tokens of max_model_len vLLM skips the drafter for the whole batch and schedules placeholder
    drafts; the trees of the step before are then stale and must not be verified (they were, and outputs changed)."""
    budget = 32
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=48,
        ignore_eos=True,
        max_model_len=max(len(p) for p in prompt_ids) + 48 + 4,
        spec=ddtree_spec(tiny_llama_dflash_dir, budget),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference, "seed": 5},
    )
    assert result["token_ids"] == reference
    assert result["spec_decode"]["vllm:spec_decode_num_accepted_tokens"] > 0


def assert_trees_accepted(result: dict) -> None:
    """The oracle drafter got tree nodes accepted: without it greedy equality would hold for a walk that never
    accepts (every step then emits only the target's own token)."""
    stats = result["spec_decode"]
    assert stats["vllm:spec_decode_num_drafts"] > 0 and stats["vllm:spec_decode_num_accepted_tokens"] > 0, stats


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
    assert_trees_accepted(result)


def test_sampled_ddtree_runs_and_seed_reproduces(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    """Seeded sampling through accepted tree paths. A node is accepted only when the target's sample at its parent
    is its token, and the random target's distributions are flat: its greedy token has probability about 0.001 at
    T = 0.8, where nothing was ever accepted here. At T = 0.02 (0.93 on average) the oracle's drafts are accepted
    (32 tokens, paths up to 4 deep) and most outputs still leave the greedy ones (6 of 8)."""
    kwargs = dict(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=24,
        ignore_eos=True,
        temperature=0.02,
        seed=1234,
        spec=ddtree_spec(tiny_llama_dflash_dir, 8),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
    )
    first, second = run_engine(**kwargs), run_engine(**kwargs)
    assert all(len(t) == 24 for t in first["token_ids"])
    assert first["token_ids"] == second["token_ids"]
    assert first["token_ids"] != [r[:24] for r in reference], "sampled, yet equal to greedy"
    assert_trees_accepted(first)


def test_synthetic_acceptance_accepts_the_stated_depth(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids):
    """The benchmark mode (synthetic_acceptance.py) through the engine: rates [1, 1, 0, ...] (τ = 3) make every
    verify step accept two nodes of the random drafter's best-first path, which alone accepts nothing."""
    result = run_engine(
        model=str(tiny_llama_dir), prompt_token_ids=prompt_ids[:4], max_tokens=24, ignore_eos=True,
        spec={**ddtree_spec(tiny_llama_dflash_dir, 16), "rejection_sample_method": "synthetic",
              "synthetic_acceptance_length": 3.0},
        env={"VLLM_DDTREE_BENCHMARK": "1"},
    )
    stats = result["spec_decode"]
    drafts, per_depth = stats["vllm:spec_decode_num_drafts"], stats["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0 and per_depth[0] >= per_depth[1] >= 0.9 * drafts, stats
    assert sum(per_depth[2:]) <= 0.1 * drafts, stats  # deeper only where the target's own draw is a child's token
    assert all(len(t) == 24 for t in result["token_ids"])


def test_logprobs_match_no_spec(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    kwargs = dict(
        model=str(tiny_llama_dir), prompt_token_ids=prompt_ids[:3], max_tokens=24, ignore_eos=True, logprobs=2
    )
    base = run_engine(**kwargs)
    tree = run_engine(
        **kwargs,
        spec=ddtree_spec(tiny_llama_dflash_dir, 8),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
    )
    assert tree["token_ids"] == base["token_ids"]
    assert_trees_accepted(tree)  # accepted tokens' logprobs too, not only each step's bonus token
    for ours, theirs in zip(tree["logprobs"], base["logprobs"]):
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_preemption_with_a_tiny_kv_cache_stays_lossless(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=48,
        ignore_eos=True,
        spec=ddtree_spec(tiny_llama_dflash_dir, 16),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
        num_gpu_blocks=12,
        block_size=16,
        max_model_len=128,
    )
    assert result["token_ids"] == reference
    assert result["preemptions"] > 0, "the KV cache was meant to be too small for all requests at once"
    assert_trees_accepted(result)


def test_aborted_requests_free_their_blocks(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids,
        max_tokens=48,
        ignore_eos=True,
        spec=ddtree_spec(tiny_llama_dflash_dir, 16),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
        abort_after_steps=4,
    )
    assert result["free_at_end"] == result["free_at_start"]
    finished = result["finished"]
    assert sorted(finished) == [f"req-{i}" for i in range(1, len(prompt_ids), 2)]
    for rid, tokens in finished.items():
        assert tokens == reference[int(rid.split("-")[1])]


def test_tensor_parallel_2_equals_tp1_and_no_spec(tiny_llama_dir, tiny_llama_dflash_dir, prompt_ids, reference):
    """Two ranks (one process and one core each) build, walk and compact identically: every step's accepted paths
    are compared across ranks (VLLM_DDTREE_CHECK_RANKS), and the output equals single-rank no-spec."""
    result = run_engine(
        model=str(tiny_llama_dir),
        prompt_token_ids=prompt_ids[:4],
        max_tokens=48,
        ignore_eos=True,
        tensor_parallel_size=2,
        spec=ddtree_spec(tiny_llama_dflash_dir, 16),
        oracle={"prompt_token_ids": prompt_ids, "continuations": reference},
    )
    assert result["token_ids"] == reference[:4]
    stats = result["spec_decode"]
    assert stats["vllm:spec_decode_num_accepted_tokens"] > stats["vllm:spec_decode_num_drafts"] // 2
