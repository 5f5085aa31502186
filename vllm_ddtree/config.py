"""DDTree settings in vLLM's ``--speculative-config``: parse, default, validate, explain refusals.

Users write ``{"method": "ddtree", "model": DFLASH_DRAFTER, "num_speculative_tokens": B, "tree_depth": D}``:

- ``num_speculative_tokens``: the node budget B, i.e. the speculative tokens the target verifies per step (the tree's
  non-root nodes). Without it (and without the two keys below) ddtree chooses: on Model Runner V2 the cost-aware
  budget over ``DEFAULT_TREE_BUDGETS``, elsewhere ``DEFAULT_TREE_BUDGET`` (``settle_budget_policy``).
- ``num_speculative_tokens_per_batch_size`` (vLLM's dynamic speculative decoding schedule): the adaptive budget.
  vLLM's scheduler picks each step's draft count from the batch size; the proposer returns that prefix of its
  B-node tree, which in best-first order is the tree of that budget.
- ``tree_budgets``: the cost-aware budget: each step verifies one of these budgets, the one with the most
  expected tokens per second from live acceptance and measured step time (budget_policy.py); the largest is B.
  ``"chain"`` among them is the chain fallback: a step that verifies the DFlash chain (``tree_depth`` drafts) on
  vLLM's own attention, for when no tree pays for its verify (docs/cost-aware-budget.md).
- ``tree_depth``: the deepest node, i.e. how many DFlash draft positions feed the tree. Defaults to
  ``min(block_size - 1, B)`` (all positions one DFlash pass produces, but no deeper than B: a tree of B nodes is at
  most B deep); at most that.

The patched ``SpeculativeConfig`` (patches/vllm-0.26.0/0001) calls ``prepare_ddtree_method`` first thing in
``__post_init__``: it checks what needs no drafter, records the budget in ``tree_budget`` and turns the method into
``"dflash"``, so vLLM loads and runs the drafter exactly as it does for the DFlash chain and only the verify/accept
path differs. ``validate_ddtree_drafter`` runs at the end of validation, once the drafter's config is loaded: it
fixes ``tree_depth`` (at most the budget) and leaves ``num_speculative_tokens = budget``: vLLM sizes every per-step
reservation by it (scheduler lookahead slots and async placeholders, the drafter-fits check, Model Runner V2's
``draft_tokens`` and decode query of ``1 + B``), and a tree fills exactly B drafts.

Runners: patch 0001 asks ``mrv2_gaps`` which parts of a configuration ddtree does not cover on Model Runner V2, vLLM's
default runner for dense CUDA targets; any gap keeps the engine on the V1 runner, as do the targets vLLM itself runs
there (hybrid models) and the CPU engine. ``describe_runner`` is the start-up line that says which and why.
"""

from __future__ import annotations

import copy
import os
from typing import Any

DEFAULT_TREE_BUDGET = 64
# In ``tree_budgets``: the chain fallback, a step that verifies the DFlash chain instead of a tree.
CHAIN = "chain"
# The cost-aware budget's choices when the user gives no budget and the engine runs on Model Runner V2. The tree
# budgets since 2026-12-04 (H200: lossless in float32; 1.02x / 0.97x the chain at batch 1 / 8 on the small pair where
# B=64 made 1.00x / 1.01x in the same call), the chain fallback since 2026-12-05 (H100, one lease, benchmarks/README.md:
# lossless in float32; with nothing accepted on the Qwen3-8B shape 0.99x / 0.90x / 0.95x the chain at batch 1 / 8 / 32
# where the tree budgets alone made 0.98x / 0.84x / 0.76x; on the small pair 1.35x / 1.64x where they made 1.09x /
# 1.41x). Not on the V1 runner: a budget schedule there costs full CUDA graphs and async scheduling
# (``schedules_async_by_default``).
DEFAULT_TREE_BUDGETS = (CHAIN, 16, 32, DEFAULT_TREE_BUDGET)
# vLLM's scheduler, runner buffers and the output contract are sized by num_speculative_tokens; 128 is vLLM's own
# MAX_SPEC_LEN (v1/sample/rejection_sampler.py), which bounds what the rest of the V1 path has been exercised with.
MAX_TREE_BUDGET = 128
# DFlash drafters predict at most block_size - 1 positions; z-lab's largest block is 16.
MAX_TREE_DEPTH = 32
# Benchmark modes whose outputs are not the target's (synthetic acceptance) run only with this set to 1.
BENCHMARK_ENV = "VLLM_DDTREE_BENCHMARK"

# Settings of SpeculativeConfig that change the chain's sampling or batching in ways the tree does not implement,
# with the value DDTree needs and what the user should do instead.
_UNSUPPORTED_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("draft_sample_method", "greedy",
     "DDTree builds the tree from the drafter's top-k; drop draft_sample_method"),
    ("disable_padded_drafter_batch", False, "drop disable_padded_drafter_batch"),
    ("use_heterogeneous_vocab", False, "DDTree needs the drafter to share the target's vocabulary"),
)


class DDTreeConfigError(ValueError):
    """A refused ddtree configuration; the message names the fix."""


def prepare_ddtree_method(spec: Any) -> None:
    """Validate drafter-independent ddtree settings and run the drafter as DFlash (see module docstring)."""
    if spec.tree_budget is not None:
        raise DDTreeConfigError('tree_budget is set by method "ddtree"; give the budget as num_speculative_tokens')
    if spec.model is None:
        raise DDTreeConfigError(
            'method "ddtree" needs a DFlash drafter: add "model": "<path or name of a DFlash checkpoint>" to '
            "--speculative-config"
        )
    spec.tree_budget_is_default = (spec.num_speculative_tokens is None and spec.tree_budgets is None
                                   and spec.num_speculative_tokens_per_batch_size is None)
    _expand_tree_budgets(spec)
    if spec.num_speculative_tokens is None:
        spec.num_speculative_tokens = DEFAULT_TREE_BUDGET
    budget = spec.num_speculative_tokens
    if not isinstance(budget, int) or not 1 <= budget <= MAX_TREE_BUDGET:
        raise DDTreeConfigError(
            f"ddtree num_speculative_tokens (the tree's node budget) must be an integer in [1, {MAX_TREE_BUDGET}], "
            f"got {budget!r}"
        )
    depth = spec.tree_depth
    if depth is not None and not 1 <= depth <= MAX_TREE_DEPTH:
        raise DDTreeConfigError(f"ddtree tree_depth must be in [1, {MAX_TREE_DEPTH}], got {depth}")
    _check_budget_schedule(spec.num_speculative_tokens_per_batch_size, budget)
    _refuse_non_dflash_drafter(spec.model, spec.revision)
    for name, required, fix in _UNSUPPORTED_SETTINGS:
        if getattr(spec, name) != required:
            raise DDTreeConfigError(f"ddtree does not support {name}={getattr(spec, name)!r}: {fix}")
    _check_rejection_sample_method(spec.rejection_sample_method)
    spec.method = "dflash"
    spec.tree_budget = budget


def _check_rejection_sample_method(method: str) -> None:
    """The tree walk is ddtree's verification; "synthetic" is its benchmark mode (synthetic_acceptance.py)."""
    if method == "standard":
        return
    if method != "synthetic":
        raise DDTreeConfigError(f"ddtree does not support rejection_sample_method={method!r}: DDTree verifies with "
                                "its own tree walk; drop rejection_sample_method")
    if os.environ.get(BENCHMARK_ENV) != "1":
        raise DDTreeConfigError(
            'ddtree rejection_sample_method="synthetic" accepts tokens the target did not choose (a benchmark mode: '
            f"outputs are not the target's); set {BENCHMARK_ENV}=1 to time at a stated acceptance, or drop "
            "rejection_sample_method"
        )


def _check_synthetic_rates(spec: Any) -> None:
    """A tree accepts at most ``tree_depth`` nodes: synthetic acceptance deeper than that cannot be honoured."""
    if getattr(spec, "rejection_sample_method", "standard") != "synthetic":
        return
    if any(r > 0 for r in (spec.synthetic_acceptance_rates or [])[spec.tree_depth:]):
        raise DDTreeConfigError(
            f"ddtree synthetic acceptance beyond tree_depth={spec.tree_depth}: a tree accepts at most tree_depth "
            f"nodes; use synthetic_acceptance_length <= {spec.tree_depth + 1} or zero rates past position "
            f"{spec.tree_depth}"
        )


def _check_budget_schedule(schedule: Any, budget: int) -> None:
    """The adaptive budget is vLLM's dynamic speculative decoding schedule (``num_speculative_tokens_per_batch_size``:
    ``[[first batch size, last batch size, budget], ...]``): vLLM's scheduler picks each step's draft count from the
    batch size and ddtree verifies the first that many nodes of its tree, which are, in best-first order, the tree
    of that budget. Checked here so a bad schedule fails at start-up with the fix, not when the scheduler is built."""
    if schedule is None:
        return
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        entries = validate_and_normalize_dynamic_sd_schedule(schedule)
    except (TypeError, ValueError) as e:
        raise DDTreeConfigError(
            f"ddtree num_speculative_tokens_per_batch_size: {e} Give [[first batch size, last batch size, budget], "
            "...], ranges from batch size 1 upwards, e.g. [[1, 4, 64], [5, 16, 32], [17, 256, 16]]"
        ) from None
    for first, last, size in entries:
        if not 1 <= size <= budget:
            raise DDTreeConfigError(
                f"ddtree num_speculative_tokens_per_batch_size entry ({first}, {last}, {size}): each budget must be in "
                f"[1, num_speculative_tokens = {budget}] (the largest tree; set num_speculative_tokens to the "
                "schedule's largest budget)"
            )


def chain_fallback(spec: Any) -> bool:
    """Whether steps may verify the DFlash chain instead of a tree (``"chain"`` in ``tree_budgets``)."""
    return CHAIN in (getattr(spec, "tree_budgets", None) or ())


def tree_budget_choices(spec: Any) -> list[int]:
    """The drafts a step may verify under ``tree_budgets``, ascending: each tree budget, and with the chain
    fallback ``tree_depth`` (once known: the drafter's block size sets it)."""
    choices = {b for b in spec.tree_budgets if b != CHAIN}
    if chain_fallback(spec) and spec.tree_depth is not None:
        choices.add(spec.tree_depth)
    return sorted(choices)


def budget_choices(spec: Any) -> list[int] | None:
    """``tree_budget_choices`` under the cost-aware budget, None for a fixed budget (the walk then reports no
    acceptance by choice)."""
    return tree_budget_choices(spec) if getattr(spec, "tree_budgets", None) else None


def _expand_tree_budgets(spec: Any) -> None:
    """``tree_budgets``: the cost-aware budget (budget_policy.py) picks each step's budget among these. The largest
    is the node budget (``num_speculative_tokens``); vLLM's dynamic speculative decoding schedule gets one entry per
    choice (``tree_budget_choices``), so its runners size and capture every verify width, and
    ``scheduler.make_scheduler`` replaces the schedule's lookup by the live choice (``settle_budget_policy``)."""
    budgets = spec.tree_budgets
    if budgets is None:
        return
    trees = [b for b in budgets if b != CHAIN] if isinstance(budgets, list) else []
    if (not isinstance(budgets, list) or len(set(budgets)) < 2 or not trees or budgets.count(CHAIN) > 1
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_TREE_BUDGET for b in trees)):
        raise DDTreeConfigError(
            f"ddtree tree_budgets must list at least two different choices: node budgets in [1, {MAX_TREE_BUDGET}] "
            f'and optionally "{CHAIN}" (the DFlash chain), e.g. [16, 32, 64] or ["{CHAIN}", 16, 32, 64], got '
            f"{budgets!r}; for one budget give num_speculative_tokens instead"
        )
    if spec.num_speculative_tokens_per_batch_size is not None:
        raise DDTreeConfigError(
            "ddtree tree_budgets (each step's budget from live acceptance and step time) and "
            "num_speculative_tokens_per_batch_size (the budget from the batch size) are two ways to choose it; "
            "drop one"
        )
    largest = max(trees)
    if spec.num_speculative_tokens not in (None, largest):
        raise DDTreeConfigError(
            f"ddtree num_speculative_tokens={spec.num_speculative_tokens} with tree_budgets {budgets}: the node "
            f"budget is the largest of tree_budgets ({largest}); drop num_speculative_tokens"
        )
    spec.num_speculative_tokens = largest
    _schedule_budget_choices(spec)


def _schedule_budget_choices(spec: Any) -> None:
    """One entry of vLLM's dynamic speculative decoding schedule per choice (the batch ranges are placeholders: the
    cost-aware scheduler's lookup replaces the schedule's). Run again once ``tree_depth`` is known, which gives the
    chain fallback its entry; a step of ``tree_depth`` drafts is then the chain's, so no tree budget may equal it."""
    if chain_fallback(spec) and spec.tree_depth in spec.tree_budgets:
        raise DDTreeConfigError(
            f'ddtree tree_budgets {spec.tree_budgets}: "{CHAIN}" verifies tree_depth = {spec.tree_depth} drafts, '
            f"and so would the tree budget {spec.tree_depth}; drop that budget or set another tree_depth"
        )
    ordered = tree_budget_choices(spec)[::-1]
    spec.num_speculative_tokens_per_batch_size = [[i + 1, i + 1, b] for i, b in enumerate(ordered)]


def settle_budget_policy(vllm_config: Any) -> None:
    """Patch 0001 calls this once the VllmConfig knows its model runner, before CUDA-graph sizes are set. Without a
    budget from the user, an engine on Model Runner V2 gets the cost-aware budget over ``DEFAULT_TREE_BUDGETS``
    (its runner captures every verify width in full graphs); on the V1 runner, beside the user's own
    ``--scheduler-cls``, or on Model Runner V2 without async scheduling, the budget stays ``DEFAULT_TREE_BUDGET``.
    With ``tree_budgets`` the engine runs ``scheduler.make_scheduler``.

    Model Runner V2 without async scheduling hands the scheduler all B drafts of the step before (its
    ``DraftTokensHandler`` returns B placeholders), so a budget picked per step would never be verified there.
    First, a step token budget that the drafter's share leaves empty is refused (``_check_step_token_budget``)."""
    _check_step_token_budget(vllm_config)
    spec = vllm_config.speculative_config
    scheduler_config = vllm_config.scheduler_config
    mrv2_sync = vllm_config.use_v2_model_runner and getattr(scheduler_config, "async_scheduling", None) is False
    if (spec.tree_budget_is_default and scheduler_config.scheduler_cls is None and vllm_config.use_v2_model_runner
            and not mrv2_sync):
        # A tree budget equal to tree_depth would verify as many drafts as a chain step: the chain takes that width.
        spec.tree_budgets = [b for b in DEFAULT_TREE_BUDGETS if b != spec.tree_depth]
        _expand_tree_budgets(spec)
    if spec.tree_budgets is None:
        return
    if mrv2_sync:
        raise DDTreeConfigError(
            "ddtree tree_budgets needs async scheduling on Model Runner V2 (synchronously it schedules every request "
            "all the drafts of the step before, whatever budget is picked); drop --no-async-scheduling, or give one "
            "budget as num_speculative_tokens"
        )
    ours = "vllm_ddtree.scheduler.make_scheduler"
    if scheduler_config.scheduler_cls not in (None, ours):
        raise DDTreeConfigError(
            f"ddtree tree_budgets chooses each step's budget in its own scheduler; drop --scheduler-cls "
            f"{scheduler_config.scheduler_cls!r} or tree_budgets"
        )
    if spec.num_speculative_tokens_per_batch_size is None:  # vLLM drops the schedule under data parallelism
        raise DDTreeConfigError(
            "ddtree tree_budgets does not run with data parallelism (ranks could verify different budgets); "
            "give one budget as num_speculative_tokens"
        )
    scheduler_config.scheduler_cls = ours


def _check_step_token_budget(vllm_config: Any) -> None:
    """vLLM holds ``max_num_seqs`` x the drafter's new slots (``tree_depth - 1`` for a tree, patch 0001) of every
    step's ``max_num_batched_tokens`` and refuses an engine with nothing left, suggesting a lower
    num_speculative_tokens, which for ddtree is the node budget and holds nothing. On an H100 / H200, `vllm serve`'s
    defaults (8192 tokens, 1024 sequences) leave nothing for a 15-deep drafter, the DFlash chain's too; so the
    refusal names what does help."""
    spec, scheduler = vllm_config.speculative_config, vllm_config.scheduler_config
    slots = spec.max_num_new_slots_for_drafting
    held = scheduler.max_num_seqs * slots
    tokens = scheduler.max_num_batched_tokens
    if scheduler.max_num_scheduled_tokens is not None or tokens > held:  # a split of the user's own: vLLM checks it
        return
    full_step = slots + 1 + spec.num_speculative_tokens  # per request: held slots and a verify of the whole tree
    raise DDTreeConfigError(
        f"ddtree: vLLM holds max_num_seqs x (tree_depth - 1) = {scheduler.max_num_seqs} x {slots} = {held} tokens of "
        f"each step's max_num_batched_tokens ({tokens}) for the drafter's queries, as for the DFlash chain of "
        f"{spec.tree_depth} drafts, which leaves none to schedule. Pass --max-num-seqs {max(tokens // full_step, 1)} "
        f"(every request then verifies its whole tree of {spec.num_speculative_tokens} nodes each step; "
        f"{(tokens - 1) // max(slots, 1)} is the most that starts) or --max-num-batched-tokens "
        f"{scheduler.max_num_seqs * full_step}; "
        "num_speculative_tokens, the node budget, does not change what is held"
    )


def _refuse_non_dflash_drafter(model: str, revision: str | None) -> None:
    """Read the drafter's config.json before vLLM wraps it as a DFlash drafter (and fails on it obscurely)."""
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(model, revision=revision)
    except Exception:  # unreadable here (e.g. a hub name not cached): vLLM reports it when it loads the drafter
        return
    archs = config.get("architectures") or []
    if not (any("DFlash" in a for a in archs) or "dflash_config" in config):
        raise DDTreeConfigError(
            f"ddtree needs a DFlash drafter (architecture DFlashDraftModel with a dflash_config); "
            f"{model} has architectures {archs or 'none'}"
        )


def _check_hybrid_target(target: Any) -> None:
    """GatedDeltaNet hybrids (Qwen3-Next, Qwen3.5/3.6) verify trees through patch 0005; other state-space layers
    (Mamba, Mamba2, short convolutions) have no tree kernels."""
    chain = 'use "method": "dflash" (the chain) for this target'
    if getattr(target.hf_text_config, "linear_num_value_heads", None) is None:
        raise DDTreeConfigError(
            f"ddtree supports hybrid targets only with GatedDeltaNet layers (Qwen3-Next, Qwen3.5/3.6); "
            f"{target.model} has other recurrent layers, whose state follows a chain of tokens, not a tree: {chain}"
        )


def validate_ddtree_drafter(spec: Any) -> None:
    """Check the loaded drafter is DFlash, fix ``tree_depth`` from its block size, size vLLM's reservations."""
    if spec.tree_budget is None:
        raise DDTreeConfigError('tree_depth is a ddtree setting: add "method": "ddtree" or drop tree_depth')
    hf_config = spec.draft_model_config.hf_config
    archs = list(getattr(spec.draft_model_config, "architectures", None) or [])
    archs += list(getattr(hf_config, "architectures", None) or [])
    if not any("DFlash" in a for a in archs):
        raise DDTreeConfigError(
            f"ddtree needs a DFlash drafter (architecture DFlashDraftModel); {spec.model} has {archs or 'none'}"
        )
    _refuse_drafter_for_another_target(spec, hf_config)
    target = spec.target_model_config
    if target is not None and getattr(target, "is_hybrid", False):
        _check_hybrid_target(target)
    block_size = drafter_block_size(hf_config)
    max_depth = block_size - 1
    budget = spec.tree_budget
    if spec.tree_depth is None:
        spec.tree_depth = min(max_depth, budget)
    elif spec.tree_depth > max_depth:
        raise DDTreeConfigError(
            f"ddtree tree_depth={spec.tree_depth} exceeds what one pass of this drafter predicts "
            f"(block_size {block_size} - 1 = {max_depth}); use tree_depth <= {max_depth}"
        )
    elif spec.tree_depth > budget:
        raise DDTreeConfigError(
            f"ddtree tree_depth={spec.tree_depth} exceeds the node budget (num_speculative_tokens={budget}): a tree "
            f"of {budget} nodes is at most {budget} deep; use tree_depth <= {budget} or drop it"
        )
    _check_synthetic_rates(spec)
    if chain_fallback(spec):
        _schedule_budget_choices(spec)
    spec.num_speculative_tokens = budget


def check_async_scheduling(spec: Any) -> None:
    """Explicit ``--async-scheduling`` with ddtree (on CUDA also the default, ``schedules_async_by_default``;
    vLLM's CPU engine turns it off). The async scheduler schedules ``num_speculative_tokens`` placeholder drafts per
    request before it sees the tree, so the tree must fill every one of them: ``validate_ddtree_drafter`` keeps the
    depth within the budget and ``num_speculative_tokens`` equal to it; this guards that invariant."""
    if spec.tree_depth > spec.tree_budget or spec.num_speculative_tokens != spec.tree_budget:
        raise DDTreeConfigError(
            f"ddtree with async scheduling needs tree_depth ({spec.tree_depth}) <= num_speculative_tokens (the node "
            f"budget, {spec.tree_budget}); set tree_depth <= budget, or use --no-async-scheduling"
        )


def mrv2_gaps(vllm_config: Any) -> list[str]:
    """What of this ddtree configuration Model Runner V2 cannot run; vLLM then uses the V1 runner.

    Called from ``VllmConfig._get_v2_model_runner_unsupported_features`` (patch 0001), i.e. from inside
    ``use_v2_model_runner``: it must not read that property.
    """
    gaps = []
    model_config = vllm_config.model_config
    if model_config is not None and (
        getattr(model_config, "uses_mrope", False) or getattr(model_config, "is_multimodal_model", False)
    ):
        # model_state.prepare_inputs recomputes M-RoPE positions after the depth-position hook.
        gaps.append("ddtree with M-RoPE or multimodal targets")
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1:
        gaps.append("ddtree with data parallelism (untested on Model Runner V2)")
    if parallel.pipeline_parallel_size > 1:
        gaps.append("ddtree with pipeline parallelism")
    if getattr(vllm_config.speculative_config, "use_local_argmax_reduction", False):
        gaps.append("ddtree with use_local_argmax_reduction (the tree build needs the full draft logits)")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        gaps.append("ddtree off CUDA GPUs")
    return gaps


def schedules_async_by_default(vllm_config: Any) -> bool:
    """Whether ddtree schedules asynchronously without --async-scheduling (patch 0001 asks; vLLM's own
    incompatibilities still turn it off): on CUDA, on either model runner, as vLLM does for the DFlash chain.

    On the V1 runner (hybrid targets, and what Model Runner V2 cannot run) this is the default since 2026-12-04:
    lossless there on an H200 (dense float32 greedy equality, 2026-11-30; the tiny Qwen3.5's teacher-forced test
    with CUDA graphs, 2026-12-04), and a Qwen3.6-27B-shaped B=64 step then cost +26% over the chain's where it had
    cost +54% synchronously (benchmarks/README.md). Except with a budget schedule on V1: never run asynchronously
    there (and vLLM keeps only piecewise graphs for it, ``cuda_graphs.warn_if_budget_schedule_drops_full_graphs``).
    Off elsewhere: vLLM's CPU engine cannot run it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return False
    schedule = getattr(vllm_config.speculative_config, "num_speculative_tokens_per_batch_size", None)
    return bool(vllm_config.use_v2_model_runner) or schedule is None


def describe_runner(vllm_config: Any, on_mrv2: bool) -> str:
    """The start-up line saying which model runner ddtree runs on, and why."""
    spec = vllm_config.speculative_config
    if spec.tree_budgets is not None:
        trees = sorted(b for b in spec.tree_budgets if b != CHAIN)
        budget = f"cost-aware node budget among {trees}"
        if chain_fallback(spec):
            budget += f" or the DFlash chain ({spec.tree_depth} drafts)"
    else:
        budget = f"node budget {spec.tree_budget}"
    budget += " (ddtree's default; num_speculative_tokens fixes it)" if spec.tree_budget_is_default else ""
    return f"{_runner_line(vllm_config, on_mrv2)}; {budget}"


def _runner_line(vllm_config: Any, on_mrv2: bool) -> str:
    if on_mrv2:
        return "ddtree runs on Model Runner V2 (vLLM's default runner for this target)"
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        why = "the CPU engine has only this runner"
    elif os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        why = "VLLM_USE_V2_MODEL_RUNNER=0"
    elif getattr(vllm_config.model_config, "is_hybrid", False):
        why = "vLLM runs hybrid (recurrent-state) targets, and their DFlash chain, on it"
    elif gaps := mrv2_gaps(vllm_config):
        why = "Model Runner V2 does not cover " + "; ".join(gaps)
    else:
        why = "vLLM chose it for this target"
    return f"ddtree runs on the V1 model runner: {why}"


def _refuse_drafter_for_another_target(spec: Any, hf_config: Any) -> None:
    """A drafter built for another target passes vLLM's checks, starts, and then kills the engine on the first
    request (shape errors in the drafter's fc or the shared embedding / lm_head): refuse it at start-up instead."""
    target = getattr(spec, "target_model_config", None)
    if target is None:
        return
    fix = "use a DFlash drafter trained for this target"
    target_hidden, target_vocab = target.get_hidden_size(), target.get_vocab_size()
    target_layers = target.hf_text_config.num_hidden_layers
    reads_hidden = getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size
    if reads_hidden != target_hidden:
        raise DDTreeConfigError(
            f"the DFlash drafter {spec.model} reads target hidden states of size {reads_hidden}, but the target's "
            f"hidden size is {target_hidden}: {fix}"
        )
    if hf_config.vocab_size != target_vocab:
        raise DDTreeConfigError(
            f"the DFlash drafter {spec.model} has vocab size {hf_config.vocab_size}, the target {target_vocab}; "
            f"ddtree needs the drafter to share the target's vocabulary: {fix}"
        )
    dflash = getattr(hf_config, "dflash_config", None) or {}
    layer_ids = (dflash.get("target_layer_ids") if isinstance(dflash, dict) else None) or []
    if any(not -1 <= i < target_layers for i in layer_ids):
        raise DDTreeConfigError(
            f"the DFlash drafter {spec.model} reads target layers {list(layer_ids)}, but the target has "
            f"{target_layers} layers: {fix}"
        )


def drafter_block_size(hf_config: Any) -> int:
    """The DFlash block size: top-level ``block_size`` or ``dflash_config.block_size`` (both exist in the wild)."""
    for source in (hf_config, getattr(hf_config, "dflash_config", None) or {}):
        value = source.get("block_size") if isinstance(source, dict) else getattr(source, "block_size", None)
        if value:
            return int(value)
    raise DDTreeConfigError("the DFlash drafter's config has no block_size; add it to its config.json")


# Request settings whose effect depends on the tokens before each tree node (the node's own path), which the tree
# sampler does not model yet: each with the value that keeps it off.
_PATH_DEPENDENT_REQUEST_SETTINGS: tuple[tuple[str, Any], ...] = (
    ("presence_penalty", 0.0),
    ("frequency_penalty", 0.0),
    ("repetition_penalty", 1.0),
    ("min_tokens", 0),
)


def validate_ddtree_request(params: Any) -> None:
    """Refuse, per request and before it reaches the engine, sampling settings the tree sampler cannot honour."""
    for name, off in _PATH_DEPENDENT_REQUEST_SETTINGS:
        if getattr(params, name) != off:
            raise ValueError(f"{name}={getattr(params, name)} is not supported with ddtree speculative decoding yet")
    if params.bad_words:
        raise ValueError("bad_words is not supported with ddtree speculative decoding yet")
    if params.structured_outputs is not None:
        raise ValueError("structured outputs are not supported with ddtree speculative decoding yet")


def without_budget_schedule(vllm_config: Any) -> Any:
    """A shallow view of ``vllm_config`` whose speculative config has no ``num_speculative_tokens_per_batch_size``
    (copies, not ``dataclasses.replace``: no ``__post_init__`` runs again); every other part is shared."""
    spec = copy.copy(vllm_config.speculative_config)
    spec.num_speculative_tokens_per_batch_size = None
    view = copy.copy(vllm_config)
    view.speculative_config = spec
    return view
