"""The cost-aware budget (budget_policy.py, scheduler.py) against simulated engines: known step times and acceptance
per budget, a fake clock; the policy must settle on the budget with the most tokens per second."""

from __future__ import annotations

import random
from collections import Counter, deque
from types import SimpleNamespace

import pytest

from vllm_ddtree.budget_policy import PROBE_STEPS as PROBES
from vllm_ddtree.budget_policy import CostAwareBudget, batch_bucket


class Engine:
    """Steps of a batch of ``batch`` requests, each verifying the budget the policy picked; ``seconds(batch, b)`` and
    ``accepted(b)`` (accepted drafts per request) are the truth the policy must find."""

    def __init__(self, policy: CostAwareBudget, seconds, accepted):
        self.now = 0.0
        self.policy, self.seconds, self.accepted = policy, seconds, accepted
        policy.clock = lambda: self.now

    def run(self, batch: int, steps: int) -> list[int]:
        chosen = []
        for _ in range(steps):
            budget = self.policy[batch]
            self.now += self.seconds(batch, budget)
            for _ in range(batch):
                self.policy.observe_request(self.accepted(budget))
            self.policy.observe_step(batch, budget, verify_only=True)
            chosen.append(budget)
        return chosen


class PipelinedEngine(Engine):
    """Asynchronous scheduling on a host-bound engine: step k+1 is scheduled and launched (its host work,
    ``seconds(batch, b)``) before step k's output is taken, so the interval that ends at step k's output is step k+1's
    cost. ``report``: the scheduler tells the policy which step it scheduled next (``next_step``)."""

    def __init__(self, policy, seconds, accepted, report: bool = True):
        super().__init__(policy, seconds, accepted)
        self.report = report

    def run(self, batch: int, steps: int) -> list[int]:
        scheduled = [self.policy[batch]]
        for k in range(steps):
            scheduled.append(self.policy[batch])  # step k+1: scheduled, launched
            self.now += self.seconds(batch, scheduled[k + 1])
            for _ in range(batch):
                self.policy.observe_request(self.accepted(scheduled[k]))
            self.policy.observe_step(batch, scheduled[k], verify_only=True,
                                     next_step=(batch, scheduled[k + 1], True) if self.report else None)
        return scheduled[:steps]


def settled(chosen: list[int], last: int = 256) -> Counter:
    return Counter(chosen[-last:])


def rate(seconds, accepted, batch, b):
    return (1 + accepted(b)) / seconds(batch, b)


@pytest.mark.parametrize(
    "seconds, accepted, best",
    [
        # Nothing accepted (random weights): the smallest tree, the least work.
        ({16: 1.00, 32: 1.04, 64: 1.10}, {16: 0, 32: 0, 64: 0}, 16),
        # The paper's regime at batch 1: a larger tree costs little and accepts more.
        ({16: 1.00, 32: 1.03, 64: 1.08}, {16: 5.0, 32: 7.5, 64: 9.7}, 64),
        # A middle budget: 64 accepts more but costs too much.
        ({16: 1.00, 32: 1.20, 64: 2.00}, {16: 4.0, 32: 6.0, 64: 7.0}, 32),
    ],
)
def test_settles_on_the_budget_with_the_most_tokens_per_second(seconds, accepted, best):
    policy = CostAwareBudget([64, 16, 32], probe_every=32)
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: accepted[b]).run(batch=1, steps=600)
    assert max(seconds, key=lambda b: (1 + accepted[b]) / seconds[b]) == best  # the case is what it says
    counts = settled(chosen)
    assert counts[best] >= 256 - PROBES * (256 // 32) - 1, counts
    # Probes try the neighbour above the best budget (tokens/s is unimodal in the budget) and, in turn with it, every
    # budget below.
    probed = {16: {32}, 32: {16, 64}, 64: {16, 32}}[best]
    assert set(counts) - {best} == probed, counts


@pytest.mark.parametrize("accepted, best", [({15: 0.0, 16: 0.0, 32: 0.0, 64: 0.0}, 15),
                                             ({15: 2.0, 16: 3.0, 32: 4.0, 64: 4.2}, 32)])
def test_the_chain_fallback_is_one_more_choice_below_the_smallest_tree(accepted, best):
    """With nothing accepted the chain (``tree_depth`` drafts on vLLM's attention: the cheapest step) wins; where
    trees accept enough to pay for their verify, a tree does. The summary names the chain."""
    seconds = {15: 0.93, 16: 1.00, 32: 1.04, 64: 1.10}
    assert max(seconds, key=lambda b: (1 + accepted[b]) / seconds[b]) == best
    policy = CostAwareBudget([16, 32, 64, 15], chain=15, probe_every=32)
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: accepted[b]).run(batch=1, steps=400)
    assert settled(chosen).most_common(1)[0][0] == best
    assert policy.summary().startswith("batch 1: chain: ") and ", B=16: " in policy.summary()


def test_with_equal_acceptance_a_larger_choice_never_wins_on_time_alone():
    """Nothing accepted, and noise has put the trees' step-time medians below the chain's (H100, 2026-12-06: trees
    took 241 of 2079 steps that way): the chain wins every step, since no tree accepts more (nor is probed)."""
    seconds = {15: 1.00, 16: 0.97, 32: 0.98, 64: 0.99}  # inverted by noise
    policy = CostAwareBudget([16, 32, 64, 15], chain=15, probe_every=32)
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: 0).run(batch=1, steps=400)
    assert settled(chosen) == Counter({15: 256}), settled(chosen)
    # Where the larger choice does accept more, its rate decides as before.
    policy = CostAwareBudget([16, 32, 64, 15], chain=15, probe_every=32)
    more = {15: 0.0, 16: 0.2, 32: 0.5, 64: 0.5}
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: more[b]).run(batch=1, steps=400)
    assert settled(chosen).most_common(1)[0][0] == 32


def test_a_pipelined_engine_times_each_budget_on_its_own_steps():
    """With asynchronous scheduling on a host-bound engine (H100, 2026-12-06, the small pair at batch 1: medians
    chain 6.02, B=16 6.84, B=32 6.55, B=64 4.36 ms where steps averaged 6.3 ms), an output interval is the next
    step's cost: a one-step probe was timed on the best budget's host work, and a wrong budget won. Intervals now
    count only where the next step verifies the same budget, and probes run two steps."""
    seconds = {15: 1.0, 16: 1.3}
    accepted = {15: 2.0, 16: 2.3}  # tokens/s: chain 3.0, B=16 2.54
    policy = CostAwareBudget([15, 16], chain=15, probe_every=32)
    chosen = PipelinedEngine(policy, lambda n, b: seconds[b], lambda b: accepted[b]).run(batch=1, steps=600)
    assert settled(chosen)[15] == 256 - PROBES * (256 // 32), settled(chosen)
    assert policy._time(0, 15).value == pytest.approx(1.0) and policy._time(0, 16).value == pytest.approx(1.3)
    # Timed on whatever came next, the probes of B=16 read the chain's cost, and B=16 takes over.
    policy = CostAwareBudget([15, 16], chain=15, probe_every=32)
    chosen = PipelinedEngine(policy, lambda n, b: seconds[b], lambda b: accepted[b], report=False).run(1, 600)
    assert settled(chosen).most_common(1)[0][0] == 16, settled(chosen)


def test_a_choice_explored_in_the_engines_first_steps_is_measured_again():
    """The chain is explored first, in an engine's first steps, which are slow (H100, 2026-12-06, the small pair at
    batch 1: its estimate stayed at 7.18 ms while the chain engine's steps took about 2.7 ms). Trees then lead, and a
    probe of their neighbours only never timed the chain again: B=64 held the run at 0.76x the chain. Probes below
    the best reach every choice below it, and the chain, the best here, takes over."""
    seconds = {15: 0.6, 16: 1.0, 32: 1.02, 64: 1.05}
    accepted = {15: 1.04, 16: 1.38, 32: 1.59, 64: 1.78}  # tokens/s: chain 3.4, B=64 2.65
    steps = iter(range(10**6))

    def step_seconds(n, b):
        return seconds[b] * (7.0 if next(steps) < 8 else 1.0)

    policy = CostAwareBudget([16, 32, 64, 15], chain=15, probe_every=32)
    chosen = Engine(policy, step_seconds, lambda b: accepted[b]).run(batch=1, steps=900)
    assert Counter(chosen[:8]) == Counter({15: 8}), Counter(chosen[:8])  # the slow steps were the chain's
    counts = settled(chosen)
    assert counts[15] >= 256 - PROBES * (256 // 32) - 1, counts


def test_settles_at_batch_1_where_each_request_accepts_anything_from_0_to_the_depth():
    """One request per step, its accepted count drawn from 0..2 x mean (a step's sample says little): the choice
    rests on the last requests' mean, not on the last step."""
    import random

    draw = random.Random(0)
    seconds = {16: 1.0, 32: 1.2, 64: 2.0}
    mean = {16: 3.0, 32: 6.0, 64: 7.0}  # tokens per second 4, 5.83, 4

    policy = CostAwareBudget([16, 32, 64])
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: draw.randint(0, int(2 * mean[b]))).run(1, 800)
    counts = settled(chosen, 512)
    assert counts[32] >= 512 - PROBES * (512 // 32) - 8, counts


def test_each_batch_bucket_gets_its_own_budget():
    """Verify cost grows with the tokens a step verifies (batch x (1 + budget)) past a memory-bound floor: a big
    tree pays at batch 1 and not at batch 16, with the same acceptance."""
    accepted = {16: 5.0, 32: 7.0, 64: 8.5}

    def seconds(n, b):
        return max(1.0, n * (1 + b) / 80)

    policy = CostAwareBudget([16, 32, 64])
    engine = Engine(policy, seconds, lambda b: accepted[b])
    engine.run(batch=1, steps=300)
    engine.run(batch=16, steps=300)
    assert settled(engine.run(batch=1, steps=100), 64).most_common(1)[0][0] == 64
    assert settled(engine.run(batch=16, steps=100), 64).most_common(1)[0][0] == 16
    assert batch_bucket(1) != batch_bucket(16)


def test_follows_a_drop_in_acceptance():
    """The workload changes under it: trees that accepted 9 drafts accept none; the policy walks down to the smallest
    budget (its own measurements at the larger budgets drop, then the probes refresh the smaller ones)."""
    seconds = {16: 1.00, 32: 1.04, 64: 1.10}
    accepted = {16: 5.0, 32: 7.5, 64: 9.0}
    policy = CostAwareBudget([16, 32, 64], probe_every=16)
    engine = Engine(policy, lambda n, b: seconds[b], lambda b: accepted[b])
    assert settled(engine.run(1, 300), 64).most_common(1)[0][0] == 64
    accepted.update({16: 0.0, 32: 0.0, 64: 0.0})
    assert settled(engine.run(1, 400), 128).most_common(1)[0][0] == 16


def test_only_verify_steps_after_verify_steps_are_timed():
    """A prefill step is not a verify step's cost, and neither is the step after it (its interval starts at a
    prefill's output). Acceptance counts from every verify step."""
    now = [0.0]
    policy = CostAwareBudget([8, 16], min_steps=1, clock=lambda: now[0])
    for step, verify_only in enumerate([False, True, True, False, True]):
        now[0] += 10.0 if not verify_only else 1.0
        policy.observe_request(3)
        policy.observe_step(1, 8, verify_only=verify_only)
        if step == 1:
            assert policy.step_time.get((0, 8)) is None or policy.step_time[(0, 8)].value is None
            assert list(policy.accepted[8].samples) == [3]
    assert policy.step_time[(0, 8)].value == 1.0  # step 2 only: steps 1 and 4 followed a prefill
    # 3 requests: not yet a measurement
    assert policy.summary() == "batch 1: B=8: 3 steps, B=16: 0 steps, between steps of one budget 1000.00 ms (1 steps)"
    assert list(policy.accepted[8].samples) == [3, 3, 3]


def test_the_summary_tells_steps_around_a_change_of_budget_from_the_rest():
    """The estimates time a budget only between steps of that budget; the steps next to a change are reported apart
    (H100 2026-12-07: the default's steps cost more while its choice scattered; around a change they cost what the
    others did)."""
    now = [0.0]
    policy = CostAwareBudget([16, 32], clock=lambda: now[0])
    steps = [(16, 16, 1e-3), (16, 32, 2e-3), (32, 16, 2e-3), (16, 16, 2e-3), (16, 16, 1e-3)]  # budget, next, seconds
    for budget, after, seconds in steps:
        now[0] += seconds
        policy.observe_step(1, budget, verify_only=True, next_step=(1, after, True))
    assert policy.summary().endswith("between steps of one budget 1.00 ms (1 steps), around a change 2.00 ms (3 steps)")


def test_unmeasured_budgets_are_tried_first():
    """Measured: at least min_requests requests' acceptance and min_steps step times for the batch bucket."""
    policy = CostAwareBudget([32, 8, 16], min_requests=4, min_steps=3)
    assert policy[4] == 8
    policy._time(batch_bucket(4), 8).extend([1.0, 1.0, 1.0])
    policy.accepted[8].extend([2, 2, 2])  # one request short
    assert policy[4] == 8 and policy.expected_rate(4, 8) is None
    policy.accepted[8].extend([2])
    assert policy[4] == 16 and policy.expected_rate(4, 8) == 3.0
    policy._time(batch_bucket(4), 16).extend([1.0, 1.0])  # one step time short
    policy.accepted[16].extend([3, 3, 3, 3])
    assert policy[4] == 16 and policy.expected_rate(4, 16) is None
    policy._time(batch_bucket(4), 16).extend([1.0])
    assert policy[4] == 32 and policy.expected_rate(4, 16) == 4.0
    # Known to accept no more than B=16, B=32 is not tried: its step time could not make it the choice.
    policy.accepted[32].extend([3, 3, 3, 3])
    assert policy[4] == 16 and policy.expected_rate(4, 32) is None


def test_exploration_stops_past_the_peak():
    """Nothing accepted at batch 32 (Qwen3-8B shape on an H100, 2026-12-05: chain 15 ms, B=16 17, B=32 31, B=64 57
    per step): once B=16 measures below the chain, B=32 and B=64 are never verified (tokens/s is unimodal in the
    budget). With acceptance that pays for trees the exploration climbs to the top and settles there."""
    seconds = {15: 15.0, 16: 17.0, 32: 31.0, 64: 57.0}
    policy = CostAwareBudget([15, 16, 32, 64], chain=15)
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: 0.0).run(batch=32, steps=300)
    assert set(chosen) == {15, 16} and Counter(chosen)[16] < PROBES * (300 // 32) + 8, Counter(chosen)

    seconds = {15: 1.0, 16: 1.02, 32: 1.05, 64: 1.1}
    accepted = {15: 4.0, 16: 5.0, 32: 6.5, 64: 8.0}
    policy = CostAwareBudget([15, 16, 32, 64], chain=15)
    chosen = Engine(policy, lambda n, b: seconds[b], lambda b: accepted[b]).run(batch=1, steps=300)
    assert settled(chosen, 128).most_common(1)[0][0] == 64


def test_a_slow_first_step_does_not_keep_a_budget_out():
    """An engine's first steps are many times slower than the rest (kernels compiled on first use; on an H100,
    2026-12-05, the chain's estimate stayed at 27-40 ms against steps of about 3 ms), and they fall on the budget
    explored first, the chain. Step times are a median, so the chain, cheapest with nothing accepted, still wins: a
    moving average kept the first sample for hundreds of steps, as the chain is only probed now and then once a tree
    leads."""
    seconds = {15: 0.93, 16: 1.00, 32: 1.04, 64: 1.10}
    steps = iter(range(10**6))

    def step_seconds(n, b):
        return seconds[b] * (40.0 if next(steps) < 2 else 1.0)

    policy = CostAwareBudget([15, 16, 32, 64], chain=15, probe_every=32)
    chosen = Engine(policy, step_seconds, lambda b: 0.0).run(batch=1, steps=400)
    counts = settled(chosen)
    assert counts[15] >= 256 - PROBES * (256 // 32) - 1, counts
    assert 1e3 * policy._time(0, 15).value == pytest.approx(930.0)


def _output(num_scheduled, drafts, new_reqs=()):
    return SimpleNamespace(num_scheduled_tokens=num_scheduled, scheduled_spec_decode_tokens=drafts,
                           scheduled_new_reqs=list(new_reqs))


@pytest.mark.parametrize(
    "output, expected",
    [
        (_output({"a": 17, "b": 17}, {"a": [0] * 16, "b": [0] * 16}), (16, True)),
        # A prefill chunk beside the verify rows.
        (_output({"a": 17, "b": 200}, {"a": [0] * 16}), (16, False)),
        # A request verifying fewer drafts (near its length limit).
        (_output({"a": 17, "b": 5}, {"a": [0] * 16, "b": [0] * 4}), (16, False)),
        # A new request's first step.
        (_output({"a": 17}, {"a": [0] * 16}, new_reqs=["b"]), (16, False)),
        (_output({"a": 1}, {}), (0, False)),
    ],
)
def test_verified_budget_reads_the_step_from_the_scheduler_output(output, expected):
    from vllm_ddtree.scheduler import verified_budget

    assert verified_budget(output) == expected


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_make_scheduler_builds_on_the_scheduler_the_engine_runs(monkeypatch, async_scheduling):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_ddtree import scheduler

    built = {}

    def init(self, *, vllm_config, **kwargs):
        built.update(kwargs, cls=type(self))

    monkeypatch.setattr(scheduler._CostAwareBudgetMixin, "__init__", init)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    made = scheduler.make_scheduler(vllm_config=config, log_stats=False)
    assert isinstance(made, AsyncScheduler) == async_scheduling
    assert built == {"log_stats": False, "cls": type(made)}


def test_a_step_reported_by_choice_fills_every_known_choices_window():
    """A step verified at 32 tells what the chain (15) and 16 would have accepted on the same tokens (-1: unknown,
    here 64 and a request that verified nothing); the windows take those instead of the step's own samples."""
    policy = CostAwareBudget([16, 32, 64, 15], chain=15, min_steps=1)
    for accepted in (3, 4, 0):
        policy.observe_request(accepted)
    policy.observe_step(3, 32, verify_only=True, by_choice=[[2, 3, 3, -1], [4, 4, 4, -1], [-1, -1, -1, -1]])
    assert {b: list(w.samples) for b, w in policy.accepted.items()} == {15: [2, 4], 16: [3, 4], 32: [3, 4], 64: []}
    assert policy.counterfactual == {15: 2, 16: 2, 32: 0, 64: 0}
    assert policy.verified == {(batch_bucket(3), 32): 1}  # a step verified at 32, whatever it told of the others
    assert policy.summary().endswith("; samples from steps at another budget: chain 2, B=16 2, B=32 0, B=64 0")
    # Without it, as before: the verified budget's window takes the requests' own counts.
    policy.observe_request(5)
    policy.observe_step(1, 64, verify_only=True)
    assert list(policy.accepted[64].samples) == [5] and policy.counterfactual[64] == 0
    # Not a verify-only step: nothing counts, reported or not.
    policy.observe_request(7)
    policy.observe_step(2, 64, verify_only=False, by_choice=[[1, 1, 1, 1]])
    assert list(policy.accepted[64].samples) == [5] and list(policy.accepted[15].samples) == [2, 4]


@pytest.mark.parametrize("by_choice", [[[1, 2, 3]], [1, 2, 3, 4], [[1, 2, 3, 4, 5]]])
def test_a_report_without_one_column_per_choice_is_refused(by_choice):
    policy = CostAwareBudget([16, 32, 64, 15], chain=15)
    with pytest.raises(ValueError, match=r"one column per choice \(15, 16, 32, 64\)"):
        policy.observe_step(1, 32, verify_only=True, by_choice=by_choice)


def test_counterfactual_samples_let_the_policy_see_a_larger_tree_accept_more():
    """The windows compare budgets on the same tokens: a run whose acceptance drifts (hard prompts while 64 was
    explored, easy ones at 32) no longer reads 32 above 64, which holds it. Without reports it does."""
    def run(report: bool) -> dict[int, float]:
        policy = CostAwareBudget([16, 32, 64], min_steps=1, probe_every=0)
        for step in range(64):
            easy = step < 32
            budget = 32 if easy else 64  # 32 saw the easy prompts, 64 the hard ones
            accepted = {16: 2, 32: 4, 64: 5} if easy else {16: 0, 32: 1, 64: 1}
            policy.observe_request(accepted[budget])
            by_choice = [[accepted[16], accepted[32], accepted[64] if budget == 64 else -1]] if report else None
            policy.observe_step(1, budget, verify_only=True, by_choice=by_choice)
        return {b: w.value for b, w in policy.accepted.items()}

    assert run(report=False)[32] > run(report=False)[64]
    assert run(report=True)[32] <= run(report=True)[64]


def test_the_scheduler_hands_the_policy_the_rows_of_requests_with_drafts():
    """``update_from_output`` reads ``ddtree_acceptance`` (rows in ``req_ids`` order) and passes the rows of the
    requests that verified drafts; without it the policy gets the requests' own counts, as before."""
    import numpy as np

    from vllm_ddtree import scheduler

    class Base:
        def update_from_output(self, scheduler_output, model_runner_output):
            for _ in scheduler_output.num_scheduled_tokens:  # vLLM's make_spec_decoding_stats, per request
                self.budget_policy.observe_request(1)
            return "outputs"

    class Fake(scheduler._CostAwareBudgetMixin, Base):
        def __init__(self):
            self.budget_policy = CostAwareBudget([7, 16], chain=7)
            self._in_flight = deque()

    step = _output({"a": 17, "b": 17}, {"a": [0] * 16, "b": [0] * 16})
    fake = Fake()
    runner_output = SimpleNamespace(req_ids=["b", "a"], ddtree_acceptance=np.array([[2, 3], [5, 6]], np.int32))
    assert fake.update_from_output(step, runner_output) == "outputs"
    assert list(fake.budget_policy.accepted[7].samples) == [2, 5]
    assert list(fake.budget_policy.accepted[16].samples) == [3, 6]
    fake = Fake()
    fake.update_from_output(step, SimpleNamespace(req_ids=["b", "a"]))
    assert list(fake.budget_policy.accepted[16].samples) == [1, 1] and not fake.budget_policy.accepted[7].samples

    mixed = _output({"a": 17, "p": 40, "c": 1}, {"a": [0] * 16})  # a prefill chunk and a decode without drafts
    rows = scheduler.acceptance_of_drafted(
        mixed, SimpleNamespace(req_ids=["p", "a", "c"], ddtree_acceptance=np.array([[-1, -1], [4, 4], [-1, -1]])))
    assert rows.tolist() == [[4, 4]]
    assert scheduler.acceptance_of_drafted(mixed, SimpleNamespace(req_ids=["p", "a", "c"])) is None


def test_the_scheduler_tells_the_policy_which_step_it_scheduled_next():
    """Asynchronous scheduling: step 2 is scheduled before step 1's output arrives; the policy hears of it with step
    1 (``next_step``), and of nothing after the last step or for a step it never saw scheduled."""
    from vllm_ddtree import scheduler

    steps = [_output({"a": 17}, {"a": [0] * 16}), _output({"a": 33, "b": 33}, {"a": [0] * 32, "b": [0] * 32})]
    queue = list(steps)
    heard = []

    class Base:
        def schedule(self):
            return queue.pop(0)

        def update_from_output(self, scheduler_output, model_runner_output):
            return None

    class Policy(CostAwareBudget):
        def observe_step(self, *args, next_step=None, **kwargs):
            heard.append(next_step)

    class Fake(scheduler._CostAwareBudgetMixin, Base):
        def __init__(self):
            self.budget_policy = Policy([16, 32])
            self._in_flight = deque()

    fake = Fake()
    assert fake.schedule() is steps[0] and fake.schedule() is steps[1]
    fake.update_from_output(steps[0], SimpleNamespace(req_ids=["a"]))
    fake.update_from_output(steps[1], SimpleNamespace(req_ids=["a", "b"]))
    fake.update_from_output(_output({"c": 1}, {}), SimpleNamespace(req_ids=["c"]))
    assert heard == [(2, 32, True), None, None]
    assert not fake._in_flight


def _started_scheduler(scheduler, **methods):
    """The cost-aware scheduler built through its own ``__init__`` (the environment read at start-up), over a
    stand-in for vLLM's scheduler with these ``methods`` and a speculative config of tree depth 15."""

    class Base:
        def __init__(self):
            self.vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(tree_depth=15))

    for name, method in methods.items():
        setattr(Base, name, method)
    return type("Fake", (scheduler._CostAwareBudgetMixin, Base), {})()


@pytest.mark.parametrize("asked", [True, False])
def test_the_scheduler_records_each_step_where_asked(monkeypatch, tmp_path, asked):
    """With ``VLLM_DDTREE_BUDGET_RECORD`` the engine core writes, as it stops, one row per step output: its batch
    size, budget, the interval since the output before and whether that interval timed the budget (a step after a
    prefill does not), and one row per choice with why it was made; without it, nothing is kept."""
    import json

    from vllm_ddtree import scheduler

    if asked:
        monkeypatch.setenv(scheduler.RECORD_ENV, str(tmp_path / "records"))
    else:
        monkeypatch.delenv(scheduler.RECORD_ENV, raising=False)
    monkeypatch.setattr(scheduler, "tree_budget_choices", lambda spec: [15, 16, 64])
    now = iter([0.0, 0.004, 0.009, 0.012])

    def stop(self):
        self.stopped = True

    fake = _started_scheduler(scheduler, update_from_output=lambda self, output, runner_output: None, shutdown=stop)
    fake.budget_policy.clock = lambda: next(now)
    chosen = fake.budget_policy[1]  # nothing measured: the smallest choice, explored
    for step in (_output({"a": 40}, {}, new_reqs=["a"]), _output({"a": 17}, {"a": [0] * 16}),
                 _output({"a": 17}, {"a": [0] * 16}), _output({"a": 65}, {"a": [0] * 64})):
        fake.update_from_output(step, SimpleNamespace(req_ids=["a"]))
    fake.shutdown()
    assert fake.stopped
    written = list(tmp_path.glob("records/budget_record_*.json"))
    if not asked:
        assert fake.budget_policy.record is None and not written
        return
    record = json.loads(written[0].read_text())
    assert record["columns"][-2:] == ["ms_since_last_output", "timed"]
    assert record["steps"] == [[1, 1, 0, False, None, False], [2, 1, 16, True, 4.0, False],
                               [3, 1, 16, True, 5.0, True], [4, 1, 64, True, 3.0, True]]
    assert record["decisions"] == [[0, 1, chosen, "explore", [None] * 3, [None] * 3]] and chosen == 15
    assert len(fake.budget_policy._time(0, 16).samples) == 1


class ReportingEngine(Engine):
    """As Model Runner V2's ddtree engine reports: a tree step at budget B tells what every choice up to B accepted
    on its tokens (acceptance_by_choice.py), a chain step (vLLM's rejection sampler) only the chain's own count."""

    def __init__(self, policy, seconds, accepted, chain: int):
        super().__init__(policy, seconds, accepted)
        self.chain = chain

    def request(self) -> dict[int, float]:
        """What each choice accepts on one request's tokens."""
        return {b: self.accepted(b) for b in self.policy.budgets}

    def run(self, batch: int, steps: int) -> list[int]:
        chosen = []
        for _ in range(steps):
            budget = self.policy[batch]
            self.now += self.seconds(batch, budget)
            rows = [self.request() for _ in range(batch)]
            by_choice = None
            if budget == self.chain:
                for row in rows:
                    self.policy.observe_request(row[budget])
            else:
                by_choice = [[row[b] if b <= budget else -1 for b in self.policy.budgets] for row in rows]
            self.policy.observe_step(batch, budget, verify_only=True, by_choice=by_choice)
            chosen.append(budget)
        return chosen


@pytest.mark.parametrize("max_age", [512, None])
def test_after_a_stretch_that_accepts_nothing_the_larger_trees_are_measured_afresh(max_age):
    """The small pair on a host where B=64 pays (H100, 2026-12-06: tokens / ms chain 1.50 / 2.88, B=16 1.78 / 3.11,
    B=32 2.09 / 3.11, B=64 2.75 / 3.23), whose default spent 55% of its batch-1 steps at B=16 and B=32. After prompts
    on which nothing is accepted the chain is right; once acceptance returns, the trees' windows still hold that
    stretch, refreshed only by probes of the best's neighbour (one sample per probe step at batch 1), and the climb
    back to B=64 takes one neighbour at a time. Samples older than ``max_age`` steps no longer count: a tree choice
    left unmeasured is explored again, and B=64 is back within a few hundred steps (without: not in 700)."""
    seconds = {15: 2.88, 16: 3.11, 32: 3.11, 64: 3.23}
    accepted = {15: 0.50, 16: 0.78, 32: 1.09, 64: 1.75}
    high = dict(accepted)
    policy = CostAwareBudget([15, 16, 32, 64], chain=15, max_age=max_age)
    engine = ReportingEngine(policy, lambda n, b: seconds[b], lambda b: accepted[b], chain=15)
    assert settled(engine.run(1, 400), 128).most_common(1)[0][0] == 64
    accepted.update(dict.fromkeys(accepted, 0.0))
    assert settled(engine.run(1, 300), 128).most_common(1)[0][0] == 15
    accepted.update(high)
    counts = settled(engine.run(1, 700), 200)
    if max_age is None:
        assert counts[64] < 100, counts
    else:
        assert counts[64] >= 200 - PROBES * (200 // 32) - 4, counts


def test_with_nothing_accepted_the_trees_are_not_timed_at_each_batch_size():
    """The Qwen3-8B shape with nothing accepted (H100, 2026-12-06, ms per step at batch 8 / 32 / 64 below; the chain
    took 291 / 116 / 115 steps, B=16 19 / 10 / 9): once a tree is known to accept no more than the chain, neither the
    exploration of a new batch bucket nor the probes time it, until its samples expire (``max_age``)."""
    seconds = {8: {15: 8.09, 16: 8.94, 32: 10.08, 64: 12.5}, 32: {15: 14.5, 16: 17.05, 32: 31.0, 64: 57.0},
               64: {15: 26.41, 16: 32.99, 32: 57.0, 64: 110.0}}
    policy = CostAwareBudget([15, 16, 32, 64], chain=15)
    engine = ReportingEngine(policy, lambda n, b: seconds[n][b], lambda b: 0.0, chain=15)
    chosen = [b for n, steps in ((8, 315), (32, 126), (64, 124), (8, 315)) for b in engine.run(n, steps)]
    # B=16 at most twice: once to learn that it accepts none, once more when that has expired.
    assert Counter(chosen)[15] >= len(chosen) - 2, Counter(chosen)
    assert policy.accepted[16].value == 0.0
    # Samples expire: B=16 is tried again after max_age steps, once.
    chosen = engine.run(32, 512)
    assert 1 <= len(chosen) - Counter(chosen)[15] <= 2, Counter(chosen)


@pytest.mark.parametrize("pin", ["64", "15", "48", "chain"])
def test_a_pinned_engine_verifies_its_choice_on_every_step_and_keeps_measuring(monkeypatch, pin):
    """``VLLM_DDTREE_BUDGET_PIN`` bisects the default's cost against a fixed budget: every step verifies the pinned
    choice while acceptance by choice and the estimates go on; a value that is not one of the engine's choices
    stops the engine at start-up with the choices named."""
    from vllm_ddtree import scheduler

    monkeypatch.setenv(scheduler.PIN_ENV, pin)
    monkeypatch.setattr(scheduler, "tree_budget_choices", lambda spec: [15, 16, 32, 64])
    if pin in ("48", "chain"):
        with pytest.raises(ValueError, match=r"VLLM_DDTREE_BUDGET_PIN='(48|chain)'.*\[15, 16, 32, 64\]"):
            _started_scheduler(scheduler)
        return
    policy = _started_scheduler(scheduler).budget_policy
    seconds = {15: 2.0, 16: 2.1, 32: 2.2, 64: 2.3}
    accepted = {15: 0.5, 16: 0.8, 32: 1.2, 64: 2.0}  # B=64 makes the most tokens per second
    chosen = ReportingEngine(policy, lambda n, b: seconds[b], lambda b: accepted[b], chain=15).run(1, 100)
    assert set(chosen) == {int(pin)}
    assert policy.acceptance()[15] == pytest.approx(0.5)  # the chain's column: known on every tree step too
    if pin == "64":
        assert policy.acceptance()[32] == pytest.approx(1.2)


class SampledEngine(ReportingEngine):
    """``ReportingEngine`` with each request's acceptance drawn (``draw(rng) -> {choice: accepted}``, nested as trees
    are: a larger tree accepts at least what a smaller one does), so the policy sees the spread of real requests;
    ``drawn`` keeps them in order."""

    def __init__(self, policy, seconds, draw, chain: int, seed: int):
        super().__init__(policy, seconds, None, chain)
        self.draw, self.rng = draw, random.Random(seed)
        self.drawn: list[dict[int, int]] = []

    def request(self) -> dict[int, int]:
        self.drawn.append(self.draw(self.rng))
        return self.drawn[-1]


def pair_request(rng: random.Random) -> dict[int, int]:
    """One request of the small pair at batch 1 (H100, 2026-12-07: B=64 accepted at least d drafts with probability
    0.79, 0.54, 0.31, 0.14, 0.07, 0.03, 0.02, 0.01 for d = 1..8); the smaller trees and the chain lose some of it."""
    u = rng.random()
    a64 = sum(u < p for p in (0.79, 0.54, 0.31, 0.14, 0.07, 0.03, 0.02, 0.01))
    a32 = a64 - (a64 > 0 and rng.random() < 0.15)
    a16 = a32 - (a32 > 0 and rng.random() < 0.30)
    return {15: a16 - (a16 > 0 and rng.random() < 0.45), 16: a16, 32: a32, 64: a64}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_requests_that_vary_do_not_scatter_the_choice(seed):
    """One request accepts 0 to 8 drafts, so a mean over 32 requests moves by about 0.3 tokens, more than B=64 gains
    over B=32 (about 0.15). Each choice's own window holds other requests (B=64's only those verified at B=64), and
    on the small pair at batch 1 (H100, 2026-12-07) the default spent 825 of 1227 steps at B=16 and B=32 while B=64
    made the most tokens per second. A choice's gain over the next smaller one, measured on the same requests, is
    what sets them apart: B=64 on all steps but the probes."""
    seconds = {15: 2.84, 16: 3.05, 32: 3.09, 64: 3.13}
    policy = CostAwareBudget([15, 16, 32, 64], chain=15)
    chosen = SampledEngine(policy, lambda n, b: seconds[b], pair_request, chain=15, seed=seed).run(1, 1500)
    counts = settled(chosen, 1000)
    assert counts[64] >= 1000 - PROBES * (1000 // 32) - 100, counts  # (each choice's own window: 417-685)


def test_a_larger_tree_that_gained_nothing_on_a_few_requests_is_still_probed():
    """B=64 accepts what B=32 does on its first requests; that rules it out only where the smaller choice accepts
    nothing at all (random weights: test_with_nothing_accepted_...), or over a full gain window. Here B=32 accepts
    1.7 drafts, so B=64 stays among the probes, and once it gains it is the choice within a few probes (it was left
    out until its samples expired, 512 steps)."""
    seconds = {15: 2.84, 16: 3.05, 32: 3.09, 64: 3.13}
    accepted = {15: 1.0, 16: 1.4, 32: 1.7, 64: 1.7}
    policy = CostAwareBudget([15, 16, 32, 64], chain=15)
    engine = ReportingEngine(policy, lambda n, b: seconds[b], lambda b: accepted[b], chain=15)
    assert settled(engine.run(1, 200), 100).most_common(1)[0][0] == 32
    assert policy.acceptance()[64] == pytest.approx(1.7)
    accepted[64] = 2.1
    counts = settled(engine.run(1, 300), 150)
    assert counts[64] >= 150 - PROBES * (150 // 32) - 4, counts
    assert policy.acceptance()[64] == pytest.approx(2.1)


def test_with_noisy_step_times_the_choice_makes_nearly_fixed_b64s_tokens_per_second():
    """The small pair at batch 1, B=64 the best, each step's time off its mean by a lognormal factor (sigma 0.1) as
    a host-bound engine's are: the choice scatters on those times (twentieth session, batch 1: B=16 300, B=32 493,
    B=64 389 of 1219 steps), but the choices' rates lie within a few percent, so the tokens per second it gives up
    against fixed B=64 on the same requests and times must stay small. Mean over six seeds: 0.982 (each choice's
    own window, the policy before acceptance by choice: 0.946, one seed 0.881)."""
    seconds = {15: 2.84, 16: 3.05, 32: 3.09, 64: 3.13}

    def tokens_per_second(seed: int, fixed: int | None) -> float:
        noise = random.Random(seed + 100)
        policy = CostAwareBudget([15, 16, 32, 64], chain=15)
        policy.pinned = fixed
        engine = SampledEngine(policy, lambda n, b: seconds[b] * noise.lognormvariate(0, 0.1), pair_request,
                               chain=15, seed=seed)
        chosen = engine.run(1, 1500)  # one request a step: the draws in step order
        return sum(1 + row[b] for row, b in zip(engine.drawn, chosen, strict=True)) / engine.now

    ratios = [tokens_per_second(seed, None) / tokens_per_second(seed, 64) for seed in range(6)]
    assert sum(ratios) / len(ratios) >= 0.97, ratios
