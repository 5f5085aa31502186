"""``--speculative-config`` for ddtree: what is accepted, what it resolves to, and every refusal's message."""

from __future__ import annotations

import json
import re

import pytest


def engine_config(target, **spec):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(target), dtype="float32", max_model_len=512, max_num_seqs=8, speculative_config=spec
    )
    return args.create_engine_config()


def test_ddtree_resolves_to_a_dflash_drafter_with_a_tree(tiny_llama_dir, tiny_llama_dflash_dir):
    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=4)
    spec = config.speculative_config
    assert spec.method == "dflash" and spec.tree_budget == 4
    assert spec.tree_depth == 4  # min(block_size 8 - 1, budget 4): a tree of 4 nodes is at most 4 deep
    assert spec.num_speculative_tokens == 4  # the budget: vLLM sizes its reservations by it
    assert config.scheduler_config.async_scheduling is False


def test_defaults_and_explicit_depth(tiny_llama_dir, tiny_llama_dflash_dir):
    """Without a budget: B=64 on the V1 runner (the CPU engine's), no schedule and vLLM's scheduler; the
    cost-aware default is Model Runner V2's (test_mrv2_ddtree.py)."""
    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir))
    spec = config.speculative_config
    assert (spec.tree_budget, spec.tree_depth, spec.num_speculative_tokens) == (64, 7, 64)
    assert spec.tree_budget_is_default and spec.tree_budgets is None
    assert spec.num_speculative_tokens_per_batch_size is None and config.scheduler_config.scheduler_cls is None
    spec = engine_config(
        tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=4, tree_depth=3
    ).speculative_config
    assert (spec.tree_budget, spec.tree_depth, spec.num_speculative_tokens) == (4, 3, 4)
    assert not spec.tree_budget_is_default


@pytest.mark.parametrize("budget", [None, 4, 64])
def test_the_tree_takes_no_more_of_each_steps_token_budget_than_the_chain(tiny_llama_dir, tiny_llama_dflash_dir,
                                                                          budget):
    """vLLM takes max_num_seqs x the drafter's new slots off every step's token budget (prefill included); a tree's
    drafter masks tree_depth tokens whatever its node budget, so the step keeps what the chain of tree_depth drafts
    keeps (patch 0001; by the budget, B=64 on 8 requests of 1024 tokens left 520)."""
    from vllm.engine.arg_utils import EngineArgs

    def scheduled_tokens(**spec):
        return EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                          max_num_batched_tokens=1024, speculative_config=spec,
                          ).create_engine_config().scheduler_config.max_num_scheduled_tokens

    tree = {"method": "ddtree", "model": str(tiny_llama_dflash_dir)}
    if budget is not None:
        tree["num_speculative_tokens"] = budget
    depth = min(7, budget or 7)  # block 8
    chain = scheduled_tokens(method="dflash", model=str(tiny_llama_dflash_dir), num_speculative_tokens=depth)
    assert scheduled_tokens(**tree) == chain == 1024 - 8 * (depth - 1)


def test_a_token_budget_the_drafter_fills_is_refused_naming_what_helps(tiny_llama_dir, tiny_llama_dflash_dir):
    """64 requests x 6 held slots (tree_depth 7) exceed 256 tokens: vLLM's own refusal would suggest a lower
    num_speculative_tokens, which holds nothing for ddtree; each of our suggestions starts."""
    from vllm.engine.arg_utils import EngineArgs

    def config(max_num_seqs, max_num_batched_tokens):
        return EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          speculative_config={"method": "ddtree", "model": str(tiny_llama_dflash_dir)},
                          ).create_engine_config()

    with pytest.raises(ValueError, match="ddtree: vLLM holds") as refused:  # vLLM's config wraps ours
        config(64, 256)
    message = str(refused.value)
    assert "64 x 6 = 384" in message and "does not change" in message
    seqs, most, tokens = re.search(r"--max-num-seqs (\d+) .*; (\d+) is the most that starts\) or "
                                   r"--max-num-batched-tokens (\d+)", message).groups()
    assert (int(seqs), int(most), int(tokens)) == (256 // 71, 255 // 6, 64 * 71)  # 71: 6 held + 1 + 64 nodes
    assert config(int(seqs), 256).scheduler_config.max_num_scheduled_tokens == 256 - 6 * int(seqs)
    assert config(int(most), 256).scheduler_config.max_num_scheduled_tokens > 0
    assert config(64, int(tokens)).scheduler_config.max_num_scheduled_tokens == 64 * 65
    with pytest.raises(ValueError, match="ddtree: vLLM holds"):
        config(int(most) + 1, 256)


def test_plain_dflash_is_untouched(tiny_llama_dir, tiny_llama_dflash_dir):
    spec = engine_config(
        tiny_llama_dir, method="dflash", model=str(tiny_llama_dflash_dir), num_speculative_tokens=7
    ).speculative_config
    assert spec.tree_budget is None and spec.tree_depth is None and spec.num_speculative_tokens == 7


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"num_speculative_tokens": 0}, "greater than 0"),
        ({"num_speculative_tokens": 129}, r"\[1, 128\]"),
        ({"tree_depth": 8}, "exceeds what one pass of this drafter predicts"),
        ({"num_speculative_tokens": 2, "tree_depth": 3}, "exceeds the node budget"),
        ({"tree_depth": 0}, "greater than or equal to 1"),
        ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0}, "VLLM_DDTREE_BENCHMARK=1"),
        ({"rejection_sample_method": "block"}, "drop rejection_sample_method"),
        ({"draft_sample_method": "probabilistic"}, "draft_sample_method"),
        ({"disable_padded_drafter_batch": True}, "disable_padded_drafter_batch"),
        ({"tree_budget": 8}, "give the budget as num_speculative_tokens"),
        ({"bogus_key": 1}, "bogus_key"),
        ({"num_speculative_tokens": -1}, "greater than 0"),
        ({"num_speculative_tokens": 8.5}, "valid integer"),
        ({"tree_depth": 2.5}, "valid integer"),
        ({"tree_depth": 33}, r"tree_depth must be in \[1, 32\]"),
        ({"num_speculative_tokens": 8, "num_speculative_tokens_per_batch_size": [[1, 4, 16]]},
         r"each budget must be in \[1, num_speculative_tokens = 8\]"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 0]]}, "each budget must be in"),
        ({"num_speculative_tokens_per_batch_size": [[2, 4, 8]]}, "must start at 1"),
        ({"num_speculative_tokens_per_batch_size": [[1, 4, 8], [3, 8, 4]]}, "non-overlapping"),
        ({"tree_budgets": [16]}, "at least two different choices"),
        ({"tree_budgets": [16, 200]}, r"at least two different choices: node budgets in \[1, 128\]"),
        ({"tree_budgets": ["chain"]}, "at least two different choices"),
        ({"tree_budgets": ["chain", "chain", 16]}, "at least two different choices"),
        ({"tree_budgets": ["tree", 16]}, 'optionally "chain"'),
        ({"tree_budgets": ["chain", 7, 16]}, "tree_depth = 7 drafts, and so would the tree budget 7"),
        ({"tree_budgets": ["chain", 4]}, "tree_depth = 4 drafts, and so would the tree budget 4"),
        ({"tree_budgets": [4, 8], "num_speculative_tokens_per_batch_size": [[1, 4, 8]]}, "drop one"),
        ({"tree_budgets": [4, 8], "num_speculative_tokens": 16}, "the node budget is the largest of tree_budgets"),
    ],
)
def test_refused_settings_name_the_fix(tiny_llama_dir, tiny_llama_dflash_dir, spec, message):
    with pytest.raises(Exception, match=message):
        engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), **spec)


def test_synthetic_acceptance_is_a_benchmark_mode_within_the_tree_depth(tiny_llama_dir, tiny_llama_dflash_dir,
                                                                       monkeypatch):
    from vllm_ddtree.config import BENCHMARK_ENV
    from vllm_ddtree.synthetic_acceptance import synthetic_acceptance

    monkeypatch.setenv(BENCHMARK_ENV, "1")
    spec = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=16,
                         rejection_sample_method="synthetic", synthetic_acceptance_length=3.5).speculative_config
    assert (spec.tree_budget, spec.tree_depth) == (16, 7)
    assert spec.synthetic_acceptance_rates == [1.0, 1.0, 0.5] + [0.0] * 13  # vLLM's schedule over the budget
    assert synthetic_acceptance(spec, "cpu").conditional.tolist() == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(Exception, match=r"beyond tree_depth=7.*synthetic_acceptance_length <= 8"):
        engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=16,
                      rejection_sample_method="synthetic", synthetic_acceptance_length=8.5)


def test_budget_schedule_is_vllms_dynamic_speculation_schedule(tiny_llama_dir, tiny_llama_dflash_dir):
    """The adaptive budget: vLLM's scheduler reads the schedule as for any dynamic speculative decoding."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    schedule = [[1, 2, 16], [3, 8, 4]]
    spec = engine_config(
        tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=16,
        num_speculative_tokens_per_batch_size=schedule,
    ).speculative_config
    assert (spec.tree_budget, spec.num_speculative_tokens) == (16, 16)
    lookup = build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size, 8, 16)
    assert lookup[1:] == [16, 16, 4, 4, 4, 4, 4, 4]


def test_tree_budgets_run_the_cost_aware_scheduler(tiny_llama_dir, tiny_llama_dflash_dir):
    """The cost-aware budget: the largest budget is the node budget, vLLM's schedule lists every budget (so runners
    capture each verify width) and the engine core builds ddtree's scheduler."""
    from vllm_ddtree.scheduler import make_scheduler

    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), tree_budgets=[4, 16, 8])
    spec = config.speculative_config
    assert (spec.tree_budget, spec.num_speculative_tokens) == (16, 16)
    assert spec.num_speculative_tokens_per_batch_size == [[1, 1, 16], [2, 2, 8], [3, 3, 4]]
    assert config.scheduler_config.get_scheduler_cls() is make_scheduler
    with pytest.raises(Exception, match="drop --scheduler-cls"):
        from vllm.engine.arg_utils import EngineArgs

        EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=512, max_num_seqs=8,
                   scheduler_cls="vllm.v1.core.sched.scheduler.Scheduler",
                   speculative_config={"method": "ddtree", "model": str(tiny_llama_dflash_dir),
                                       "tree_budgets": [4, 8]}).create_engine_config()


def test_the_chain_fallback_is_a_choice_of_tree_depth_drafts(tiny_llama_dir, tiny_llama_dflash_dir):
    """``"chain"`` in tree_budgets: vLLM's schedule gets the chain's entry (``tree_depth`` drafts, once the drafter's
    block size fixes the depth), the node budget is the largest tree's, and the chain's width is not a verify
    width (its steps are causal, vLLM's attention)."""
    from vllm_ddtree.config import chain_fallback, describe_runner, tree_budget_choices
    from vllm_ddtree.verify_core import verify_widths

    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir),
                           tree_budgets=[16, "chain", 4])
    spec = config.speculative_config
    assert (spec.tree_budget, spec.num_speculative_tokens, spec.tree_depth) == (16, 16, 7)
    assert chain_fallback(spec) and tree_budget_choices(spec) == [4, 7, 16]
    assert spec.num_speculative_tokens_per_batch_size == [[1, 1, 16], [2, 2, 7], [3, 3, 4]]
    assert verify_widths(spec) == {5, 17}
    assert "cost-aware node budget among [4, 16] or the DFlash chain (7 drafts)" in describe_runner(config, False)
    spec = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), tree_budgets=["chain", 4],
                         tree_depth=3).speculative_config
    assert spec.num_speculative_tokens_per_batch_size == [[1, 1, 4], [2, 2, 3]] and verify_widths(spec) == {5}


def test_accepts_a_gated_delta_net_hybrid_target_on_the_cpu(tiny_hybrid_dir, tiny_hybrid_dflash_dir):
    spec = engine_config(
        tiny_hybrid_dir, method="ddtree", model=str(tiny_hybrid_dflash_dir), num_speculative_tokens=8
    ).speculative_config
    assert (spec.tree_budget, spec.num_speculative_tokens) == (8, 8)  # 1 + 8 GDN state slots per request


def test_hybrid_targets_other_than_gated_delta_net_are_refused(monkeypatch):
    """GatedDeltaNet hybrids run on the CPU engine and on GPU (the lossless test passed on an H200 on 2026-12-02)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_ddtree.config import DDTreeConfigError, _check_hybrid_target

    mamba = SimpleNamespace(model="a-mamba2-hybrid", hf_text_config=SimpleNamespace())
    with pytest.raises(DDTreeConfigError, match='only with GatedDeltaNet layers.* use "method": "dflash"'):
        _check_hybrid_target(mamba)
    gdn = SimpleNamespace(model="qwen3-next", hf_text_config=SimpleNamespace(linear_num_value_heads=32))
    _check_hybrid_target(gdn)  # the CPU engine
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    _check_hybrid_target(gdn)  # a GPU
    with pytest.raises(DDTreeConfigError, match="only with GatedDeltaNet layers"):
        _check_hybrid_target(mamba)


def test_refuses_a_drafter_that_is_not_dflash(tiny_llama_dir, tiny_qwen3_dir):
    with pytest.raises(Exception, match="needs a DFlash drafter"):
        engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_qwen3_dir), num_speculative_tokens=4)


def test_refuses_missing_drafter(tiny_llama_dir):
    with pytest.raises(Exception, match='needs a DFlash drafter: add "model"'):
        engine_config(tiny_llama_dir, method="ddtree", num_speculative_tokens=4)


def test_refuses_a_drafter_path_that_does_not_exist(tiny_llama_dir, tmp_path):
    with pytest.raises(Exception, match="Invalid repository ID or local directory"):
        engine_config(tiny_llama_dir, method="ddtree", model=str(tmp_path / "missing"), num_speculative_tokens=4)


def test_numeric_strings_are_coerced(tiny_llama_dir, tiny_llama_dflash_dir):
    spec = engine_config(
        tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens="4", tree_depth="3"
    ).speculative_config
    assert (spec.tree_budget, spec.tree_depth) == (4, 3)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": 576}, "reads target hidden states of size 576, but the target's hidden size is 256"),
        ({"target_hidden_size": 512}, "reads target hidden states of size 512"),
        ({"vocab_size": 32000}, "has vocab size 32000, the target 49152"),
        ({"dflash_config": {"mask_token_id": 0, "target_layer_ids": [1, 2, 3, 4, 8]}}, "the target has 8 layers"),
    ],
)
def test_refuses_a_drafter_built_for_another_target(tiny_llama_dir, tiny_llama_dflash_dir, tmp_path, changes, message):
    """Such a drafter passed vLLM's checks and then killed the engine on the first request (fc shape error)."""
    config = json.loads((tiny_llama_dflash_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))  # config checks never load weights
    with pytest.raises(Exception, match=message):
        engine_config(tiny_llama_dir, method="ddtree", model=str(tmp_path), num_speculative_tokens=4)


def test_tree_depth_needs_ddtree(tiny_llama_dir, tiny_llama_dflash_dir):
    with pytest.raises(Exception, match="tree_depth is a ddtree setting"):
        engine_config(
            tiny_llama_dir, method="dflash", model=str(tiny_llama_dflash_dir), num_speculative_tokens=7, tree_depth=3
        )


@pytest.mark.parametrize("budget", [4, 8])
def test_explicit_async_scheduling_is_accepted(tiny_llama_dir, tiny_llama_dflash_dir, budget):
    """The async scheduler schedules num_speculative_tokens placeholder drafts per request; with the depth capped by
    the budget, num_speculative_tokens is the budget and every tree fills them all, so any budget is accepted."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        async_scheduling=True,
        speculative_config={
            "method": "ddtree", "model": str(tiny_llama_dflash_dir), "num_speculative_tokens": budget,
        },
    )
    config = args.create_engine_config()  # accepted; vLLM's CPU platform then turns async scheduling off
    assert config.speculative_config.num_speculative_tokens == budget
    assert config.speculative_config.tree_depth == min(budget, 7)


def test_the_cpu_engine_runs_ddtree_on_the_v1_runner(tiny_llama_dir, tiny_llama_dflash_dir, monkeypatch):
    """The CPU platform is a Model Runner V2 gap: the V1 runner, and async scheduling off by default."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=4)
    assert config.use_v2_model_runner is False
    assert config.scheduler_config.async_scheduling is False


@pytest.fixture
def gpu_platform(monkeypatch):
    """A platform where Model Runner V2 can run, faked: CUDA and Triton."""
    import inspect

    import vllm.config.vllm as vllm_config_module
    from vllm.platforms import current_platform

    if "mrv2_gaps" not in inspect.getsource(vllm_config_module.VllmConfig._get_v2_model_runner_unsupported_features):
        pytest.skip("the installed vLLM carries another branch's patch 0001")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)


@pytest.mark.parametrize("v2_env, on_v2", [(None, True), ("0", False)])
def test_ddtree_runs_on_model_runner_v2_on_a_gpu_platform(tiny_llama_dir, tiny_llama_dflash_dir, gpu_platform,
                                                           monkeypatch, v2_env, on_v2):
    """On a platform where Model Runner V2 can run, ddtree uses it with nothing set; VLLM_USE_V2_MODEL_RUNNER=0
    (vLLM's own switch) still selects the V1 runner. (Async scheduling by default on either: test_mrv2_ddtree; the
    faked platform's CPU engine turns it off here.)"""
    if v2_env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_env)
    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=4)
    assert config.use_v2_model_runner is on_v2
    assert config._get_v2_model_runner_unsupported_features() == []


def test_without_a_budget_model_runner_v2_verifies_trees_or_the_chain(tiny_llama_dir, tiny_llama_dflash_dir,
                                                                        gpu_platform):
    """The default on Model Runner V2, through vLLM's own config: the cost-aware budget over 16, 32 and 64 nodes and
    the DFlash chain (tree_depth = 7 drafts for this block-8 drafter), each a width of vLLM's schedule, ddtree's
    scheduler named."""
    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir))
    spec = config.speculative_config
    assert config.use_v2_model_runner
    assert (spec.tree_budgets, spec.tree_depth, spec.num_speculative_tokens) == (["chain", 16, 32, 64], 7, 64)
    assert spec.num_speculative_tokens_per_batch_size == [[1, 1, 64], [2, 2, 32], [3, 3, 16], [4, 4, 7]]
    assert config.scheduler_config.scheduler_cls == "vllm_ddtree.scheduler.make_scheduler"


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_tokens": 4}, "min_tokens"),
        ({"bad_words": ["foo"]}, "bad_words"),
        # vLLM's own refusals under speculative decoding, beside patch 0003's hook: the tree sampler relies on them
        # (verifier.py ignores min_p and logit_bias)
        ({"min_p": 0.1}, "min_p"),
        ({"logit_bias": {5: 3.0}}, "logit_bias"),
    ],
)
def test_unsupported_request_settings_are_refused_per_request(tiny_llama_dir, tiny_llama_dflash_dir, setting, message):
    from vllm import SamplingParams

    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=4)
    params = SamplingParams(max_tokens=8, **setting)
    with pytest.raises(ValueError, match=message):
        params.verify(config.model_config, config.speculative_config, config.structured_outputs_config, None)
    # The same request is fine without speculative decoding.
    params.verify(config.model_config, None, config.structured_outputs_config, None)


def test_supported_request_settings_pass(tiny_llama_dir, tiny_llama_dflash_dir):
    from vllm import SamplingParams

    config = engine_config(tiny_llama_dir, method="ddtree", model=str(tiny_llama_dflash_dir), num_speculative_tokens=4)
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=3, logprobs=2, n=2)
    params.verify(config.model_config, config.speculative_config, config.structured_outputs_config, None)
