"""The cost-aware scheduler's step record (``VLLM_DDTREE_BUDGET_RECORD=<directory>``, vllm_ddtree/scheduler.py) for
engines that run vLLM's own scheduler: the DFlash chain, a fixed ddtree budget, no-spec.

bench_e2e names ``make_scheduler`` as their ``scheduler_cls`` while the variable is set, so budget_record.py's
per-group table (prefill, full batch, tail) and its intervals by batch size read the chain engine's steps beside the
cost-aware engine's. Until then the chain engine kept no record: on the small pair at batch 32 / 64 the default's
group tails took 44-60% of its decode time (H100, 2026-12-07), and whether the chain's took as long was unknown.
Each step output is one row (``RECORD_COLUMNS``; ``budget``: the drafts each request verified, the chain's draft
count on a chain step, 0 with none), never ``timed``; there are no decisions.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_ddtree.scheduler import RECORD_ENV, RECORD_STEPS, verified_budget, write_step_record


class _StepRecordMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._record_dir = os.environ[RECORD_ENV]
        self._steps: deque[tuple] = deque(maxlen=RECORD_STEPS)
        self._last_output: float | None = None
        self._outputs = 0
        spec = self.vllm_config.speculative_config  # a chain engine's steps read "chain" in budget_record.py
        self._chain = spec.num_speculative_tokens if spec is not None and spec.method != "ddtree" else None

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        now = time.monotonic()  # the cost-aware policy's clock
        budget, verify_only = verified_budget(scheduler_output)
        since = None if self._last_output is None else round(1e3 * (now - self._last_output), 4)
        self._outputs += 1
        self._steps.append((self._outputs, len(scheduler_output.num_scheduled_tokens), budget, verify_only,
                            since, False))
        self._last_output = now
        return outputs

    def shutdown(self) -> None:
        budgets = sorted({row[2] for row in self._steps if row[3]})  # those of the verify-only steps
        write_step_record(self._record_dir, budgets, self._chain, self._steps, ())
        super().shutdown()


class StepRecordScheduler(_StepRecordMixin, Scheduler):
    pass


class AsyncStepRecordScheduler(_StepRecordMixin, AsyncScheduler):
    pass


def make_scheduler(*, vllm_config: Any, **kwargs: Any) -> Scheduler:
    """vLLM's ``scheduler_cls``: vLLM's synchronous or asynchronous scheduler, whichever the engine runs, recording."""
    cls = AsyncStepRecordScheduler if vllm_config.scheduler_config.async_scheduling else StepRecordScheduler
    return cls(vllm_config=vllm_config, **kwargs)
