"""Cost-aware tree budget: each step's budget from measured step time and live acceptance (issue 19;
docs/cost-aware-budget.md).

With ``"tree_budgets": [b1, b2, ...]`` the engine can verify any of those budgets (each gets its CUDA graphs, as
vLLM's dynamic speculative decoding schedule does). Before each step, for the batch size n it is about to run, the
scheduler picks the budget b that maximises expected tokens per second,

    n * (1 + accepted(b)) / step_time(n, b)

- ``accepted(b)``: mean accepted drafts over the last ``window`` requests that tell what b accepts (a step at batch
  1 gives one sample, and one request's acceptance varies from 0 to the tree's depth: an average over requests, not
  steps). Where the engine reports it (``observe_step(by_choice=)``, acceptance_by_choice.py), a request verified at
  budget B tells every smaller choice's acceptance on the same tokens, the chain's too; ``accepted(b)`` is then the
  smallest choice's mean plus, choice by choice up to b, the mean gain of each over the next smaller one on the same
  requests (over the last ``gain_window`` requests that tell it). One request accepts anything from 0 to 8 drafts on
  the small pair, so a mean over 32 moves by about 0.3 tokens, more than B=64 gains over B=32 (about 0.15); each
  choice's own window held other requests (B=64's only those verified at B=64) and the choice followed that noise
  (H100, 2026-12-07, the small pair at batch 1: B=16 and B=32 took 825 of 1227 steps, B=64 making the most tokens
  per second: 0.75x fixed B=64's tokens/s; with gains over 32 requests and without the evidence rule below, 0.96x
  in the same lease). A gain is 0 or 1 draft for most requests and its mean moves little. Otherwise only requests
  verified at b count. Samples older than ``max_age`` engine
  steps no longer count: a choice that neither runs nor is probed becomes unmeasured and is explored again. Without
  that, a stretch of prompts on which nothing was accepted stayed in the larger trees' windows, refreshed by one
  probe sample now and then, and the way back to the best budget took one neighbour at a time (H100, 2026-12-06, the
  small pair at batch 1: B=16 and B=32 took 55% of the steps, B=64 being the best; 1.13x the chain against fixed
  B=64's 1.24x; a simulation of it takes about 1,750 steps to return to B=64 for ever-kept samples, 350 for 512);
- ``step_time(n, b)``: median of the last ``time_window`` wall times between consecutive step outputs, for steps
  of n's batch bucket (n rounded up to a power of two) verified at b; only steps that verified trees and nothing
  else, after a step that did the same, so prefills and idle gaps do not count. A median, not a moving average:
  a bucket's first steps of a kind can take many times their later cost, and a budget that is only probed now and
  then carried such a sample for the rest of a run (H100, 2026-12-05: the chain's estimate at batch 1 stayed at
  27-40 ms where its steps took about 3 ms, and the policy left it).
- Pipelined engines: with asynchronous scheduling vLLM schedules and launches step k+1 before it takes step k's
  output, so the interval that ends at step k's output holds step k+1's host work beside step k's device time.
  Where the host bounds the step (a small model), that interval is step k+1's cost. So it counts for b only where
  the step scheduled after k (``observe_step``'s ``next_step``) also verifies b alone at the same batch bucket,
  and probes run two steps: one interval then holds nothing but the probed budget. (H100, 2026-12-06, the small
  pair at batch 1: per-step medians chain 6.02, B=16 6.84, B=32 6.55, B=64 4.36 ms, where the default's steps
  averaged 6.3 ms and the chain engine's 4.6, as one-step probes timed on their neighbours' host work would read.)

Both come from what vLLM's scheduler already sees on the host (each output's accepted counts and when it arrives),
so the choice costs no device sync. Budgets not yet measured for a bucket (fewer than ``min_requests`` requests, or
fewer than ``min_steps`` step times) are tried first, smallest first, for as long as each measured one does at
least as well as the one below it: tokens/s is unimodal in the budget (CaDDTree), so past its peak the larger,
costlier trees (eager steps beyond the CUDA graphs at large batches) are not worth a try. Then every
``probe_every``-th step of a bucket and the one after it verify another budget, alternately the one above the best
and one below it, the choices below in turn from the nearest down, so the estimates follow the workload: when
nothing is accepted the smallest budget wins; when the trees' acceptance pays for a larger verify, a larger one does,
and the budgets above it come within reach. Every choice below the best is re-measured, not only its neighbour: the
estimates of budgets explored first come from an engine's first steps, and a choice never probed again keeps them
(H100, 2026-12-06, the small pair at batch 1: the chain's estimate stayed at 7.18 ms from its first 18 steps while
the chain engine's steps took about 2.7 ms, and B=32 / B=64 at 4.1-4.2 ms held the run at 0.76x the chain). Probes
below cost at most some acceptance for two steps; above, only the neighbour (a larger tree can cost several chain
steps). The chain fallback is one more choice (``chain``: its draft count, the tree depth), below the smallest tree.

A budget is chosen over a smaller one only where it also accepts more. Step times are medians of a few noisy
samples, and with nothing accepted two choices differ by a few percent (H100, 2026-12-06, Qwen3-8B shape at batch
1: chain 7.67 ms, B=16 7.86, B=32 8.81, B=64 8.89): ranked by time alone, trees whose medians dipped below the
chain's took 241 of 2079 steps, where the probes then took one in 32. A larger choice costs at least as much per
step, so where its acceptance is no higher the smaller one is the better choice.

For the same reason a budget known to accept no more than a smaller measured one is neither explored nor probed: its
step time cannot matter, and the budgets above it (trees nest: a larger tree holds the smaller) are not explored
either. Its acceptance samples expire after ``max_age`` steps, and it is then explored again. Timed anyway, on the
Qwen3-8B shape with nothing accepted (H100, 2026-12-06), B=16 took 19 / 10 / 9 of 315 / 126 / 124 steps at batch
5-8 / 17-32 / 33-64, each 10-25% dearer than a chain step: in a simulation of those steps 113 of 1730 steps and
1.2% of the time, now 4 steps and 0.07%. With gains, "known" takes evidence: the smaller choice accepts nothing
(random weights: the case above), or every gain between them fills its window. A larger tree gains on about one
request in eight on the small pair, so a few requests without gain are common ((7/8)^32: 32 in a row 1 in 70): ruled
out on them, B=64 stayed out until its samples expired, 512 steps (B=32 held 797 of 1201 batch-1 steps in the lease
above, B=64 being the best).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

PROBE_STEPS = 2  # consecutive steps per probe: the second's scheduling shares the first's interval (docstring)


class _Recent:
    """``statistic`` of the last ``size`` samples; None until ``least`` samples. With ``max_age``, samples stamped
    (``tick``, a counter read at ``extend``) more than ``max_age`` ticks ago no longer count."""

    def __init__(self, size: int, least: int, statistic: Callable[[Sequence[float]], float],
                 max_age: int | None = None, tick: Callable[[], int] = lambda: 0):
        self.samples: deque[float] = deque(maxlen=size)
        self._ticks: deque[int] = deque(maxlen=size)
        self.least = least
        self.statistic = statistic
        self.max_age, self.tick = max_age, tick

    def extend(self, samples: Sequence[float]) -> None:
        self.samples.extend(samples)
        self._ticks.extend([self.tick()] * len(samples))

    def _live(self) -> deque[float]:
        """The samples young enough to count (stamps only grow: the expired ones are the oldest, dropped for good)."""
        if self.max_age is not None:
            oldest = self.tick() - self.max_age
            while self._ticks and self._ticks[0] <= oldest:
                self._ticks.popleft()
                self.samples.popleft()
        return self.samples

    @property
    def value(self) -> float | None:
        samples = self._live()
        return self.statistic(samples) if len(samples) >= self.least else None

    @property
    def full(self) -> bool:
        """Whether the window holds ``size`` samples young enough to count."""
        return len(self._live()) == self.samples.maxlen


def batch_bucket(batch_size: int) -> int:
    """Batch sizes that share step-time estimates: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(batch_size - 1, 0).bit_length()


def bucket_range(bucket: int) -> str:
    """A batch bucket's batch sizes as the summary writes them: 1, 2, 3-4, 5-8, ..."""
    first, last = (1, 1) if bucket == 0 else (2 ** (bucket - 1) + 1, 2 ** bucket)
    return str(first) if first == last else f"{first}-{last}"


class CostAwareBudget:
    """Chooses each step's tree budget among ``budgets`` (module docstring).

    ``budget[batch_size]`` stands in for vLLM's dynamic speculative decoding lookup (``Scheduler.dynamic_sd_lookup``);
    the scheduler reports each verified request (``observe_request``) and each step's output (``observe_step``)."""

    def __init__(self, budgets: Sequence[int], *, chain: int | None = None, window: int = 32, min_requests: int = 8,
                 gain_window: int = 128, time_window: int = 9, min_steps: int = 3, probe_every: int = 32,
                 max_age: int | None = 512, clock: Callable[[], float] = time.monotonic):
        """``chain``: the choice among ``budgets`` that verifies the DFlash chain (named so in the summary).
        ``gain_window``: requests behind each choice's gain over the next smaller one (module docstring).
        ``max_age``: acceptance samples count for this many engine steps (module docstring); None: for ever."""
        self.budgets = tuple(sorted(set(budgets)))
        self.chain = chain
        self.time_window, self.min_steps = time_window, min_steps
        self.probe_every = probe_every
        self.clock = clock
        self.steps = 0  # step outputs observed, every kind: the acceptance samples' age
        self.accepted = {b: _Recent(window, min_requests, statistics.fmean, max_age, lambda: self.steps)
                         for b in self.budgets}
        # Per choice above the smallest: what it accepts beyond the next smaller choice, on the same requests
        # (acceptance by choice; module docstring).
        self.gain = {b: _Recent(gain_window, min_requests, statistics.fmean, max_age, lambda: self.steps)
                     for b in self.budgets[1:]}
        self.step_time: dict[tuple[int, int], _Recent] = {}
        self.choices: dict[int, int] = {}  # per bucket: steps chosen so far
        self.verified: dict[tuple[int, int], int] = {}  # (bucket, budget): verify-only steps seen
        self.counterfactual = dict.fromkeys(self.budgets, 0)  # samples from steps verified at another budget
        self._step_accepted: list[int] = []
        self._last_output: float | None = None
        self._last_clean = False
        self._last_budget: int | None = None
        # Per batch bucket, the intervals of verify-only steps whose neighbours verified the same budget ("same") or
        # not ("change"): what a change of budget costs, which the estimates above never time (summary, shut-down).
        self.neighbours: dict[tuple[int, str], _Recent] = {}
        # Opt-in (scheduler.RECORD_ENV): per step output (steps, batch size, budget, verify_only, ms since the last
        # output or None, whether that interval timed the budget), the record behind the summary's medians.
        self.record: deque[tuple] | None = None
        # Opt-in with ``record``: per choice (steps, batch size, budget, why, each choice's expected tokens per ms
        # and accepted drafts, None where unmeasured): what the policy saw when it chose.
        self.decisions: deque[tuple] | None = None
        # A benchmark's bisection (scheduler.PIN_ENV): every step verifies this choice while the rest of the
        # machinery (acceptance by choice, estimates, every choice's graphs) runs as it would; None: the policy chooses.
        self.pinned: int | None = None

    def __getitem__(self, batch_size: int) -> int:
        return self.choose(batch_size)

    def expected_rate(self, batch_size: int, budget: int) -> float | None:
        """Expected tokens per second per request at this budget (None until measured)."""
        return self._rate(batch_bucket(batch_size), budget, self.acceptance()[budget])

    def acceptance(self) -> dict[int, float | None]:
        """Mean accepted drafts per choice (None: unmeasured): the smallest choice's own mean, and each larger
        choice's as the one below it plus its mean gain over it on the same requests, where acceptance by choice
        measured that gain; else its own mean."""
        out: dict[int, float | None] = {}
        below = None
        for b in self.budgets:
            gain = self.gain[b].value if below is not None else None
            out[b] = out[below] + gain if gain is not None and out[below] is not None else self.accepted[b].value
            below = b
        return out

    def _rate(self, bucket: int, budget: int, accepted: float | None) -> float | None:
        seconds = self._time(bucket, budget).value
        if accepted is None or seconds is None or seconds <= 0:
            return None
        return (1 + accepted) / seconds

    def choose(self, batch_size: int) -> int:
        bucket = batch_bucket(batch_size)
        count = self.choices[bucket] = self.choices.get(bucket, 0) + 1
        accepted = self.acceptance()  # each window read once (ages filter it)
        rates = {b: self._rate(bucket, b, accepted[b]) for b in self.budgets}
        budget, why = (self.pinned, "pinned") if self.pinned is not None else self._choose(count, accepted, rates)
        if self.decisions is not None:
            self.decisions.append((self.steps, batch_size, budget, why,
                                   [None if r is None else round(r / 1e3, 5) for r in rates.values()],
                                   [None if a is None else round(a, 4) for a in accepted.values()]))
        return budget

    def _choose(self, count: int, accepted: dict[int, float | None],
                rates: dict[int, float | None]) -> tuple[int, str]:
        """The budget for a bucket's ``count``-th step, and why: "explore", "probe" or "best"."""

        def accepts_more(larger: int, smaller: int) -> bool:
            """Whether ``larger`` may accept more than the measured ``smaller``: unmeasured, or measured higher."""
            return accepted[larger] is None or accepted[larger] > accepted[smaller]

        def may_pay(larger: int, smaller: int) -> bool:
            """Whether ``larger`` is worth a step's time: not known to accept no more than ``smaller``."""
            return accepts_more(larger, smaller) or not self._settled(smaller, larger, accepted[smaller])

        peak = None
        for b in self.budgets:  # explore upwards while tokens/s climbs
            if peak is not None and not may_pay(b, peak):
                break  # known to accept no more: its time need not be measured (module docstring)
            if rates[b] is None:
                return b, "explore"
            if peak is not None and rates[b] < rates[peak]:
                break
            peak = b
        best = None
        for b in (b for b in self.budgets if rates[b] is not None):
            # A larger budget must also accept more: with equal acceptance its extra verify rows cannot pay, and
            # step-time noise alone would choose it (module docstring).
            if best is None or (rates[b] > rates[best] and accepts_more(b, best)):
                best = b
        if self.probe_every and count % self.probe_every < PROBE_STEPS:
            i = self.budgets.index(best)
            below = self.budgets[:i][::-1]  # nearest first
            above = self.budgets[i + 1] if i + 1 < len(self.budgets) else None
            if above is not None and not may_pay(above, best):
                above = None
            probe = count // self.probe_every
            if above is not None and (probe % 2 == 0 or not below):
                return above, "probe"
            if below:
                return below[(probe // 2 if above is not None else probe) % len(below)], "probe"
        return best, "best"

    def _settled(self, smaller: int, larger: int, smaller_accepts: float) -> bool:
        """Whether ``larger``'s acceptance against the measured ``smaller`` is evidence enough to stop timing it
        (module docstring): where acceptance by choice measures the gains between them, ``smaller`` accepts nothing or
        every gain fills its window; else as measured."""
        gains = [self.gain[b] for b in self.budgets if smaller < b <= larger]
        return any(g.value is None for g in gains) or smaller_accepts == 0 or all(g.full for g in gains)

    def observe_request(self, num_accepted_tokens: int) -> None:
        """One request of the step whose output is being processed: the drafts it accepted."""
        self._step_accepted.append(num_accepted_tokens)

    def observe_step(self, batch_size: int, budget: int, verify_only: bool, by_choice=None,
                     next_step: tuple[int, int, bool] | None = None) -> None:
        """A step's output arrived (after its ``observe_request`` calls). ``verify_only``: every request of the step
        verified exactly ``budget`` drafts and nothing else ran (no prefill chunk). ``by_choice`` ``[requests,
        choices]`` (-1: unknown; columns in ``budgets`` order): what each choice would have accepted for each
        request verified in the step; it then stands for the ``observe_request`` samples, and every choice's window
        takes its known entries. ``next_step``: ``(batch_size, budget, verify_only)`` of the step the engine
        scheduled after this one before this output arrived (asynchronous scheduling), None where it had not."""
        now = self.clock()
        self.steps += 1
        interval = None if self._last_output is None else now - self._last_output  # since the output before
        timed = False
        accepted, self._step_accepted = self._step_accepted, []
        if by_choice is not None:
            by_choice = np.asarray(by_choice)
            if by_choice.ndim != 2 or by_choice.shape[1] != len(self.budgets):
                raise ValueError(f"by_choice has shape {by_choice.shape}, expected [requests, {len(self.budgets)}]: "
                                 f"one column per choice {self.budgets}")
        if verify_only and budget in self.accepted:
            key = (batch_bucket(batch_size), budget)
            self.verified[key] = self.verified.get(key, 0) + 1
            if by_choice is None:
                self.accepted[budget].extend(accepted)
            for b, column in zip(self.budgets, by_choice.T if by_choice is not None else ()):
                known = column[column >= 0].tolist()
                self.accepted[b].extend(known)
                self.counterfactual[b] += len(known) if b != budget else 0
            if by_choice is not None:
                both = (by_choice[:, 1:] >= 0) & (by_choice[:, :-1] >= 0)
                gains = by_choice[:, 1:] - by_choice[:, :-1]
                for i, b in enumerate(self.budgets[1:]):
                    self.gain[b].extend(gains[both[:, i], i].tolist())
            # The interval holds the next step's host work where one was scheduled before this output (above).
            pure = next_step is None or (batch_bucket(next_step[0]), next_step[1], next_step[2]) == (*key, True)
            if self._last_clean and interval is not None:
                if pure:
                    self._time(*key).extend([interval])
                    timed = True
                kind = "same" if pure and self._last_budget == budget else "change"
                self._neighbour_steps(key[0], kind).extend([interval])
        if self.record is not None:
            since = None if interval is None else round(1e3 * interval, 4)
            self.record.append((self.steps, batch_size, budget, verify_only, since, timed))
        self._last_output, self._last_clean, self._last_budget = now, verify_only, budget

    def summary(self) -> str:
        """Verify steps per budget by batch range, with the estimates behind the choice (the scheduler logs it at
        shutdown)."""
        parts = []
        acceptance = self.acceptance()
        for bucket in sorted({k[0] for k in self.verified}):
            cells = []
            for b in self.budgets:
                seconds = self._time(bucket, b).value
                accepted = acceptance[b]
                cells.append(f"{self._label(b)}: {self.verified.get((bucket, b), 0)} steps"
                             + (f" ({1 + accepted:.2f} tokens / {1e3 * seconds:.2f} ms)"
                                if seconds is not None and accepted is not None else ""))
            for kind, label in (("same", "between steps of one budget"), ("change", "around a change")):
                if (window := self.neighbours.get((bucket, kind))) is not None:
                    cells.append(f"{label} {1e3 * window.value:.2f} ms ({len(window.samples)} steps)")
            parts.append(f"batch {bucket_range(bucket)}: " + ", ".join(cells))
        if any(self.counterfactual.values()):  # acceptance by choice reached the policy
            parts.append("samples from steps at another budget: " + ", ".join(
                f"{self._label(b)} {n}" for b, n in self.counterfactual.items()))
        return "; ".join(parts) or "no verify steps"

    def _label(self, budget: int) -> str:
        return "chain" if budget == self.chain else f"B={budget}"

    def _neighbour_steps(self, bucket: int, kind: str) -> _Recent:
        key = (bucket, kind)
        if key not in self.neighbours:
            self.neighbours[key] = _Recent(1024, 1, statistics.median)
        return self.neighbours[key]

    def _time(self, bucket: int, budget: int) -> _Recent:
        key = (bucket, budget)
        if key not in self.step_time:
            self.step_time[key] = _Recent(self.time_window, self.min_steps, statistics.median)
        return self.step_time[key]
