"""The per-step helpers around the tree core: graph buckets (cuda_graphs.py) and the step timer (step_timing.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree import LOGGER_NAME, step_timing
from vllm_ddtree.cuda_graphs import GraphedStep, largest_bucket, row_bucket


def test_row_buckets_are_the_next_power_of_two():
    assert [row_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    # Buffers hold max_reqs rows: a bucket must never exceed them.
    assert [largest_bucket(n) for n in (1, 3, 6, 8, 200)] == [1, 2, 4, 8, 8]


def test_graphed_step_runs_eagerly_off_cuda():
    calls = []
    step = GraphedStep(calls.append, max_rows=8, device=torch.device("cpu"))
    assert not step.replays(3)
    step(3)
    assert calls == [3]  # the live row count, not a padded bucket


def test_step_timer_reports_each_interval_of_complete_cycles(tmp_path, monkeypatch):
    monkeypatch.setenv(step_timing.TIMING_ENV, str(tmp_path))
    timer = step_timing.StepTimer(torch.device("cpu"))
    for _ in range(3):
        for name in step_timing.ORDER:
            timer.mark(name)
    timer.mark("prepare")
    timer.mark("propose")  # out of order (a step without a verify): this pair must not be reported
    timer.flush()
    (report,) = step_timing.read_reports(tmp_path)
    cycle = list(zip(step_timing.ORDER, step_timing.ORDER[1:] + step_timing.ORDER[:1], strict=True))
    assert set(report) == {f"{a} -> {b}" for a, b in cycle}
    assert all(v["count"] == 3 for v in report.values())
    assert all(v["host_ms_median"] >= 0 and v["device_ms_median"] == v["host_ms_median"] for v in report.values())


def test_step_timer_is_inert_when_off(tmp_path, monkeypatch):
    monkeypatch.delenv(step_timing.TIMING_ENV, raising=False)
    timer = step_timing.StepTimer(torch.device("cpu"))
    timer.mark("prepare")
    assert not timer.enabled and timer.marks == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_step_replays_the_captured_work():
    src = torch.zeros(8, device="cuda")
    dst = torch.zeros(8, device="cuda")

    def double(rows):
        dst[:rows] = src[:rows] * 2

    step = GraphedStep(double, max_rows=8, device=torch.device("cuda"))
    for value in (1.0, 5.0):
        src.fill_(value)
        step(3)
        assert dst[:3].tolist() == [2 * value] * 3
    assert list(step.graphs) == [4]


def test_warns_when_verify_steps_outgrow_cuda_graphs(ddtree_log):
    """B=64 at 8 requests is 520 tokens, past vLLM's default 512-token graphs: say so at start-up, with the fix."""
    from vllm_ddtree.cuda_graphs import warn_if_trees_outgrow_graphs

    def config(max_seqs, sizes, eager=False):
        return SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_capture_sizes=sizes),
            model_config=SimpleNamespace(enforce_eager=eager),
            scheduler_config=SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=8192),
        )

    def warnings():
        return [r.getMessage() for r in ddtree_log.records if r.name == LOGGER_NAME]

    sizes = list(range(65, 513, 65))
    with ddtree_log.at_level("WARNING", logger=LOGGER_NAME):
        warn_if_trees_outgrow_graphs(config(7, sizes), 64)
        warn_if_trees_outgrow_graphs(config(8, sizes, eager=True), 64)
        assert not warnings()
        warn_if_trees_outgrow_graphs(config(8, sizes), 64)
    [message] = warnings()
    # 520 is off vLLM's grid (vLLM would truncate it to 512): the advice names the grid point that holds it
    assert "more than 7 requests" in message and '"max_cudagraph_capture_size": 528' in message


@pytest.mark.parametrize("tokens", [1, 3, 5, 8, 17, 136, 255, 256, 257, 512, 520, 1040])
def test_capture_size_covering_is_on_vllms_capture_grid(tokens):
    """vLLM keeps a max_cudagraph_capture_size only on its default capture list; off it, the size is truncated."""
    from vllm_ddtree.cuda_graphs import capture_size_covering

    size = capture_size_covering(tokens)
    grid = [*(s for s in (1, 2, 4) if s <= size), *range(8, min(size + 1, 256), 8), *range(256, size + 1, 16)]
    assert grid[-1] == size >= tokens
    assert len(grid) == 1 or grid[-2] < tokens


def test_tensor_parallel_graphs_warn_at_start_up(ddtree_log):
    from vllm_ddtree.cuda_graphs import warn_if_tensor_parallel_graphs

    def config(tp, eager=False):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp), model_config=SimpleNamespace(enforce_eager=eager)
        )

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    with ddtree_log.at_level("WARNING", logger=LOGGER_NAME):
        for cfg, device in ((config(1), cuda), (config(2), cpu), (config(2, eager=True), cuda)):
            warn_if_tensor_parallel_graphs(cfg, device)
        assert not ddtree_log.records
        warn_if_tensor_parallel_graphs(config(2), cuda)
    [record] = ddtree_log.records
    assert "tensor_parallel_size=2" in record.getMessage() and "--disable-custom-all-reduce" in record.getMessage()


def test_drafter_capture_once_replays_nothing_inside_a_capture_pass(monkeypatch):
    """vLLM's V1 capture: a memory-profile pass over the two largest sizes, then the real pass over all of them,
    each in descending order; DFlash's dummy pass runs at min(size, max_query_tokens) = 136 for every size above
    it. Only the first run at a drafter size in each pass may use graphs (capture); later ones would replay."""
    from vllm_ddtree.cuda_graphs import DRAFTER_CAPTURE_ONCE_ENV, DrafterCaptureOnce

    monkeypatch.delenv(DRAFTER_CAPTURE_ONCE_ENV, raising=False)
    assert not DrafterCaptureOnce().enabled and DrafterCaptureOnce(tensor_parallel_size=2).enabled
    monkeypatch.setenv(DRAFTER_CAPTURE_ONCE_ENV, "0")
    assert not DrafterCaptureOnce(tensor_parallel_size=2).enabled
    monkeypatch.setenv(DRAFTER_CAPTURE_ONCE_ENV, "1")
    guard = DrafterCaptureOnce()
    assert guard.enabled

    def drafter_key(size: int) -> tuple[str, int]:
        return ("PIECEWISE", min(size, 136))

    profile = [guard.use_graphs(drafter_key(n), n) for n in (272, 256)]
    capture = {n: guard.use_graphs(drafter_key(n), n) for n in (272, 256, 248, 136, 128, 8)}
    assert profile == [True, False]
    assert capture == {272: True, 256: False, 248: False, 136: False, 128: True, 8: True}


def test_a_budget_schedule_on_the_v1_runner_warns_that_full_graphs_are_gone(ddtree_log):
    """vLLM drops V1 to piecewise graphs under a budget schedule; on GPU with graphs say so, with the fix."""
    from vllm_ddtree.cuda_graphs import warn_if_budget_schedule_drops_full_graphs

    def config(schedule, eager=False):
        return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=schedule),
                               model_config=SimpleNamespace(enforce_eager=eager))

    schedule, cuda, cpu = [[1, 1, 64], [2, 8, 16]], torch.device("cuda"), torch.device("cpu")
    with ddtree_log.at_level("WARNING", logger=LOGGER_NAME):
        for cfg, device in ((config(None), cuda), (config(schedule), cpu), (config(schedule, eager=True), cuda)):
            warn_if_budget_schedule_drops_full_graphs(cfg, device)
        assert not ddtree_log.records
        warn_if_budget_schedule_drops_full_graphs(config(schedule), cuda)
    [record] = ddtree_log.records
    assert "piecewise" in record.getMessage() and "fixed num_speculative_tokens" in record.getMessage()
