"""vLLM's scheduler with the cost-aware tree budget (``"tree_budgets"``; budget_policy.py).

vLLM's scheduler already picks each step's draft count from ``dynamic_sd_lookup[batch size]`` (its dynamic
speculative decoding schedule); here that lookup is a ``CostAwareBudget``, fed from what ``update_from_output``
sees: each verified request's accepted count (through ``make_spec_decoding_stats``, which vLLM calls once per
request with drafts) and the time each step's output arrives; where the runner reports what each choice would have
accepted (``ModelRunnerOutput.ddtree_acceptance``, acceptance_by_choice.py), that, per request, instead of the
counts. ``config.settle_budget_policy`` names ``make_scheduler`` as vLLM's ``scheduler_cls``; it builds on vLLM's
synchronous or asynchronous scheduler, whichever the engine runs.

Set ``VLLM_DDTREE_BUDGET_RECORD=<directory>`` to have the engine core write, as it stops, the policy's per-step
record (``budget_record_<pid>.json``: each step output's batch size, budget, interval and whether that interval timed
the budget; each choice with why it was made and the estimates it saw; the last ``RECORD_STEPS`` of each): which
choice ran when and why, behind the shut-down summary's medians (``benchmarks/budget_record.py`` reads it).

``VLLM_DDTREE_BUDGET_PIN=<choice>`` is a benchmark's bisection: every step verifies that choice while everything
else the cost-aware engine does runs as usual, so its tokens/s against a fixed-budget engine of the same budget is
what the machinery costs, and against the unpinned engine what the choice costs.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ddtree import LOGGER_NAME
from vllm_ddtree.budget_policy import CostAwareBudget
from vllm_ddtree.config import chain_fallback, tree_budget_choices

logger = logging.getLogger(LOGGER_NAME)

RECORD_ENV = "VLLM_DDTREE_BUDGET_RECORD"
PIN_ENV = "VLLM_DDTREE_BUDGET_PIN"
RECORD_STEPS = 1 << 18
RECORD_COLUMNS = ("step", "batch_size", "budget", "verify_only", "ms_since_last_output", "timed")
DECISION_COLUMNS = ("step", "batch_size", "budget", "why", "tokens_per_ms", "accepted")


def verified_budget(scheduler_output: Any) -> tuple[int, bool]:
    """The drafts per request a step verified, and whether the step verified exactly that many for every request
    and ran nothing else."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    counts = {len(drafts.get(req, ())) for req in scheduler_output.num_scheduled_tokens}
    budget = max(counts, default=0)
    verify_only = (
        budget > 0 and len(counts) == 1 and not scheduler_output.scheduled_new_reqs
        and all(n == 1 + budget for n in scheduler_output.num_scheduled_tokens.values())
    )
    return budget, verify_only


def acceptance_of_drafted(scheduler_output: Any, model_runner_output: Any):
    """The rows of ``ddtree_acceptance`` (``[requests, choices]``, the runner's, in ``req_ids`` order) of the
    requests that verified drafts this step; None where the runner reported none (fixed budget, V1's asynchronous
    output, steps without trees)."""
    acceptance = getattr(model_runner_output, "ddtree_acceptance", None)
    if acceptance is None:
        return None
    drafts = scheduler_output.scheduled_spec_decode_tokens
    return acceptance[[i for i, req in enumerate(model_runner_output.req_ids) if drafts.get(req)]]


def pinned_choice(value: str, choices: tuple[int, ...]) -> int:
    """``VLLM_DDTREE_BUDGET_PIN``'s choice, checked at start-up against the engine's choices."""
    if not value.strip().isdigit() or int(value) not in choices:
        raise ValueError(f"{PIN_ENV}={value!r}: give one of this engine's budget choices {list(choices)} (the "
                         f"chain's is its draft count), or unset it to let the cost-aware budget choose")
    return int(value)


def write_step_record(directory: str, budgets, chain: int | None, steps, decisions) -> None:
    """``budget_record_<pid>.json`` under ``directory``: ``steps`` rows in ``RECORD_COLUMNS``, ``decisions`` rows in
    ``DECISION_COLUMNS`` (benchmarks/budget_record.py reads it). A diagnostic: a path that cannot be written is
    logged, and the engine's stop goes on."""
    path = Path(directory) / f"budget_record_{os.getpid()}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"budgets": list(budgets), "chain": chain, "columns": RECORD_COLUMNS,
                                    "steps": list(steps), "decision_columns": DECISION_COLUMNS,
                                    "decisions": list(decisions)}))
        logger.info("ddtree step record: %d steps recorded in %s", len(steps), path)
    except OSError as error:
        logger.warning("ddtree step record could not be written (%s)", error)


class _CostAwareBudgetMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        spec = self.vllm_config.speculative_config
        self.budget_policy = CostAwareBudget(tree_budget_choices(spec),
                                             chain=spec.tree_depth if chain_fallback(spec) else None)
        self.dynamic_sd_lookup = self.budget_policy
        # Scheduled steps whose outputs have not arrived, oldest first: with asynchronous scheduling the engine
        # schedules (and launches) the next step before it takes a step's output (budget_policy: pipelined engines).
        self._in_flight: deque[Any] = deque()
        if (pin := os.environ.get(PIN_ENV)) is not None:
            self.budget_policy.pinned = pinned_choice(pin, self.budget_policy.budgets)
        self._record_dir = os.environ.get(RECORD_ENV)
        if self._record_dir:
            self.budget_policy.record = deque(maxlen=RECORD_STEPS)
            self.budget_policy.decisions = deque(maxlen=RECORD_STEPS)

    def schedule(self, *args: Any, **kwargs: Any):
        scheduler_output = super().schedule(*args, **kwargs)
        self._in_flight.append(scheduler_output)
        return scheduler_output

    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                 num_invalid_spec_tokens, request_id):
        self.budget_policy.observe_request(num_accepted_tokens)
        return super().make_spec_decoding_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                                                num_invalid_spec_tokens, request_id)

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        budget, verify_only = verified_budget(scheduler_output)
        self.budget_policy.observe_step(len(scheduler_output.num_scheduled_tokens), budget, verify_only,
                                        by_choice=acceptance_of_drafted(scheduler_output, model_runner_output),
                                        next_step=self._scheduled_after(scheduler_output))
        return outputs

    def _scheduled_after(self, scheduler_output) -> tuple[int, int, bool] | None:
        """Drop this step (and any older) from the steps in flight; the one scheduled after it, if any, as
        ``(batch size, budget, verify_only)``."""
        if not any(s is scheduler_output for s in self._in_flight):  # not scheduled here: nothing known
            return None
        while self._in_flight.popleft() is not scheduler_output:
            pass
        if not self._in_flight:
            return None
        after = self._in_flight[0]
        return (len(after.num_scheduled_tokens), *verified_budget(after))

    def shutdown(self) -> None:
        logger.info("ddtree cost-aware budget, verify steps: %s", self.budget_policy.summary())
        if (record := self.budget_policy.record) is not None:
            write_step_record(self._record_dir, self.budget_policy.budgets, self.budget_policy.chain, record,
                              self.budget_policy.decisions)
        super().shutdown()


class CostAwareScheduler(_CostAwareBudgetMixin, Scheduler):
    pass


class AsyncCostAwareScheduler(_CostAwareBudgetMixin, AsyncScheduler):
    pass


def make_scheduler(*, vllm_config: Any, **kwargs: Any) -> Scheduler:
    """vLLM's ``scheduler_cls``: called as the class would be, once the engine knows whether it schedules
    asynchronously (the CPU platform turns it off after the config's default)."""
    cls = AsyncCostAwareScheduler if vllm_config.scheduler_config.async_scheduling else CostAwareScheduler
    return cls(vllm_config=vllm_config, **kwargs)
