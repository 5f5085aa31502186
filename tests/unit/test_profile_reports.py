"""benchmarks/kernel_profile.py, host_profile.py and the other readers of what a GPU run saved: the tables they print,
on small inputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kp = _load("kernel_profile")
hp = _load("host_profile")
br = _load("budget_record")


def test_kernel_profile_sums_matrix_products_and_counts_launches():
    """cuBLAS picks other kernels for 17 rows than for 16: per name they swap places by milliseconds, so the ranking
    compares their sum; launches per step are counted by class."""
    base = {"steps": 2, "wall_ms": 10.0, "kernels": {
        "nvjet_sm90_tst_192x16_TNT": {"us": 2000.0, "count": 2}, "argmax_reduce_kernel": {"us": 20.0, "count": 2}}}
    tree = {"steps": 2, "wall_ms": 12.0, "kernels": {
        "nvjet_sm90_tst_192x24_TNT": {"us": 2040.0, "count": 2}, "_tree_attn_kernel": {"us": 400.0, "count": 72}}}
    report = kp.compare({1: {"dflash": base, "ddtree": tree}}, "dflash", top=5)[1]
    diffs = {d["kernel"]: d["delta_us"] for d in report["largest_differences_from_base"]["ddtree"]}
    assert diffs == {"_tree_attn_kernel": 200.0, kp.GEMMS: 20.0, "argmax_reduce_kernel": -10.0}
    assert report["configs"]["ddtree"]["launches_per_step"] == {"gemm": 1.0, "tree attention (ours)": 36.0}


def test_host_profile_counts_only_the_engine_step(tmp_path):
    """Samples outside the engine core's step (start-up, compilation) are left out; a stack counts once per
    function it passes through (inclusive) and once for its innermost frame (self)."""
    step = "EngineCore.step (/site/vllm/v1/engine/core.py:580)"  # py-spy 0.4 names the class
    run = "GPUModelRunner.execute_model (/site/vllm/v1/worker/gpu/model_runner.py:1200)"
    ours = "walk (/repo/vllm_ddtree/verify_core.py:150)"
    (tmp_path / "ddtree.txt").write_text("\n".join([
        f"process 1;main (x.py:1);{step};{run};{ours};_walk_rows (/repo/vllm_ddtree/verify_core.py:170) 30",
        f"process 1;main (x.py:1);{step};{run};cudaLaunch (libcuda.so) 50",
        f"process 1;main (x.py:1);{step};Scheduler.schedule (/site/vllm/v1/core/sched/scheduler.py:430) 20",
        "process 1;main (x.py:1);compile (/site/torch/_inductor/compile.py:9) 900",
    ]) + "\n")
    (tmp_path / "ddtree.json").write_text('{"table": [{"ms_per_step": 4.5}]}')
    entry = hp.main([str(tmp_path)])["ddtree"]
    assert entry["loop_samples"] == 100
    assert entry["ms_per_step"] == 4.5
    assert entry["watched_pct"]["execute_model"] == 80.0 and entry["watched_pct"]["scheduler"] == 20.0
    assert entry["watched_pct"]["vllm_ddtree (all)"] == 30.0
    assert entry["ours_inclusive_pct"][ours] == 30.0
    assert entry["self_pct"]["cudaLaunch (libcuda.so)"] == pytest.approx(50.0)


def test_gc_pauses_counts_collections_per_generation(tmp_path):
    """vLLM's VLLM_GC_DEBUG lines (vllm/utils/gc_utils.py) among other log lines: counted per generation, with the
    total, the longest pause and the pauses of 5 ms or more; again for those between vLLM's start-up and shut-down."""
    gp = _load("gc_pauses")
    log = tmp_path / "tax.ddtree_default.log"
    log.write_text("\n".join([
        "(EngineCore pid=1) INFO 12-06 11:56:51 [gc_utils.py:84] GC took 0.120ms to complete. Collected 3 objects "
        "(out of 700) in GC generation 0.",
        "(EngineCore pid=1) INFO 12-06 11:56:51 [core.py:340] init engine (profile, create kv cache, warmup model) "
        "took 41.59 s (compilation: 6.31 s)",
        "(EngineCore pid=1) INFO 12-06 11:56:51 [loggers.py:182] Engine 000: Iteration(3): 0 context requests",
        "(EngineCore pid=1) INFO 12-06 11:56:52 [gc_utils.py:84] GC took 21.500ms to complete. Collected ? objects "
        "(out of 250000) in GC generation 2.",
        "(EngineCore pid=1) INFO 12-06 11:56:53 [gc_utils.py:84] GC took 0.380ms to complete. Collected 0 objects "
        "(out of 900) in GC generation 0.",
        "(EngineCore pid=1) INFO 12-06 11:56:54 [core.py:1326] [shutdown] EngineCore: exiting busy loop",
        "(EngineCore pid=1) INFO 12-06 11:56:55 [gc_utils.py:84] GC took 900.000ms to complete. Collected 9 objects "
        "(out of 1000000) in GC generation 2.",
    ]) + "\n")
    entry = gp.main([str(log)])[log.name]
    assert entry["collections"] == 4 and entry["total_ms"] == 922.0
    assert entry["by_generation"][0] == {"count": 2, "total_ms": 0.5, "max_ms": 0.38, "at_least_5_ms": 0,
                                         "max_objects": 900}
    assert entry["by_generation"][2]["at_least_5_ms"] == 2 and entry["by_generation"][2]["max_objects"] == 1000000
    # Between vLLM's start-up and shut-down lines: the first collection (start-up's) and the last are left out.
    assert entry["serving"]["collections"] == 2 and entry["serving"]["total_ms"] == 21.88
    assert entry["serving"]["by_generation"][0]["count"] == 1
    log.write_text(log.read_text().replace("init engine", "init"))
    assert gp.main([str(log)])[log.name]["serving"] is None


def test_trace_steps_splits_steps_by_kind_and_times_python_frames(tmp_path):
    """vLLM's step annotations cut the trace: the step after a prefill is the first decode; kernels, CUDA API calls
    and Python frames count in the step they start in, a frame's self time is its duration less its children's; the
    last annotation (no next start) is dropped; the differences are against the base configuration."""
    import gzip
    import json

    ts = _load("trace_steps")

    def trace(prefill_extra_us: float) -> list[dict]:
        events = []
        starts = [0.0, 1000.0 + prefill_extra_us]
        starts += [starts[-1] + 400.0 * i for i in (1, 2, 3)]
        names = ["execute_context_1(1)_generation_0(0)"] + ["execute_context_0(0)_generation_1(17)"] * 4
        for start, name in zip(starts, names):
            events.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": 50.0})
            events.append({"ph": "X", "cat": "kernel", "name": "k", "ts": start + 10, "dur": 100.0})
        # In the prefill step: propose (inclusive 300 + extra) calls build (200 + extra).
        events.append({"ph": "X", "cat": "python_function", "name": "propose", "ts": 100.0,
                       "dur": 300.0 + prefill_extra_us, "pid": 1, "tid": 1})
        events.append({"ph": "X", "cat": "python_function", "name": "build", "ts": 150.0,
                       "dur": 200.0 + prefill_extra_us, "pid": 1, "tid": 1})
        # Each later decode step: a graph launch, and with the extra one Triton launch and a 150 us wait.
        for start in starts[2:4]:
            events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": start + 5, "dur": 8.0})
            if prefill_extra_us:
                events.append({"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": start + 20,
                               "dur": 4.0})
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize",
                               "ts": start + 30, "dur": 150.0})
        return events

    for config, extra in (("dflash", 0.0), ("ddtree_B_64", 800.0)):
        (tmp_path / config).mkdir()
        with gzip.open(tmp_path / config / "rank0.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": trace(extra)}, f)
    report = ts.main([str(tmp_path), "--top", "5"])
    tree = report["ddtree_B_64"]
    assert tree["prefill"]["steps"] == 1 and tree["prefill"]["period_ms"] == 1.8
    assert tree["first decode"]["steps"] == 1 and tree["later decode"]["steps"] == 2
    assert tree["later decode"]["period_ms"] == 0.4 and tree["prefill"]["device_ms"] == 0.1
    assert tree["prefill"]["kernels"] == 1 and tree["prefill"]["launches"] == 0
    later = tree["later decode"]
    assert later["launches"] == 2 and report["dflash"]["later decode"]["launches"] == 1
    assert later["runtime_ms"]["cudaStreamSynchronize"] == 0.15
    assert dict(ts.differences(report, "dflash", "later decode", "runtime_calls", 5)["ddtree_B_64"]) == {
        "cuLaunchKernel": 1.0, "cudaStreamSynchronize": 1.0, "cudaGraphLaunch": 0.0}
    assert tree["prefill"]["inclusive_ms"] == {"propose": 1.1, "build": 1.0}
    assert tree["prefill"]["self_ms"] == {"build": 1.0, "propose": 0.1}
    assert "first decode" in report["dflash"] and not report["dflash"]["first decode"]["self_ms"]
    assert dict(ts.differences(report, "dflash", "prefill", "self_ms", 5)["ddtree_B_64"]) == {"build": 0.8,
                                                                                           "propose": 0.0}


def test_host_cpu_use_splits_the_timed_engine_from_other_processes(tmp_path):
    """bench_e2e's host CPU line: the timed engine's process tree (its engine core a child), every other process
    (a pid reused by another program counts whole), and the machine's steal share, from two /proc snapshots."""
    from ddtree_testkit import host_load

    tick = host_load._TICK

    def write(procs: dict, cpu_line: str):
        for pid, (name, ppid, ticks) in procs.items():
            (tmp_path / str(pid)).mkdir(exist_ok=True)
            # utime and stime are fields 14 and 15 of /proc/<pid>/stat; the name may hold spaces and parentheses
            (tmp_path / str(pid) / "stat").write_text(
                f"{pid} ({name}) S {ppid} 0 0 0 0 0 0 0 0 0 {ticks} {ticks} 0 0 20 0 1 0\n")
        (tmp_path / "stat").write_text(cpu_line + "\ncpu0 1 2 3\n")

    write({10: ("bench (worker)", 1, 0), 11: ("EngineCore", 10, 0), 20: ("noisy", 1, tick), 30: ("old", 1, 0)},
          "cpu  100 0 100 700 0 0 0 100 0 0")
    before = host_load.snapshot(0.0, tmp_path)
    # 2 s later: the engine tree used 2 + 3 CPU-s, "noisy" 1 more, pid 30 now another program that used 0.5
    write({10: ("bench (worker)", 1, tick), 11: ("EngineCore", 10, 3 * tick // 2), 20: ("noisy", 1, 3 * tick // 2),
           30: ("new", 1, tick // 4)},
          "cpu  200 0 200 1400 0 0 0 200 0 0")
    use = host_load.cpu_use(before, host_load.snapshot(2.0, tmp_path), own_root=10)
    assert use["own"] == pytest.approx(2.5)
    assert use["elsewhere"] == pytest.approx(0.75)
    assert use["busiest"] == [["noisy[20]", 0.5], ["new[30]", 0.25]]
    assert use["steal"] == pytest.approx(0.1)
    assert host_load.cpu_use(before, before, own_root=10) is None  # no interval


def test_budget_record_splits_intervals_by_run_and_finds_the_best_stretches(tmp_path):
    """Steps of one budget at one batch bucket form a run; an interval after a step of the same run is "same", after
    any other verify step "change", and none after a prefill; the best choice's stretches skip probes."""
    import json

    steps = [[1, 1, 0, False, None, False], [2, 1, 15, True, 4.0, False], [3, 1, 15, True, 4.0, True],
             [4, 1, 64, True, 6.0, True], [5, 1, 64, True, 3.0, False], [6, 1, 15, True, 5.0, True],
             [7, 3, 15, True, 9.0, True]]
    unseen = [None] * 3
    decisions = [[0, 1, 15, "explore", unseen, unseen], [1, 1, 15, "explore", unseen, unseen],
                 [2, 1, 64, "probe", [0.25, None, None], [0, None, None]], [3, 1, 64, "probe", unseen, unseen],
                 [4, 1, 15, "best", [0.25, None, 0.3], [0, None, 0.5]], [5, 3, 15, "best", unseen, unseen],
                 [5, 1, 64, "probe", unseen, unseen], [6, 1, 15, "best", unseen, unseen],
                 [7, 1, 64, "best", [0.25, None, 0.4], [0, None, 0.5]]]
    record = {"budgets": [15, 16, 64], "chain": 15, "columns": ["step", "batch_size", "budget", "verify_only",
                                                                 "ms_since_last_output", "timed"],
              "steps": steps, "decision_columns": ["step", "batch_size", "budget", "why", "tokens_per_ms",
                                                   "accepted"], "decisions": decisions}
    (tmp_path / "budget_record_7.json").write_text(json.dumps(record))
    [(name, loaded)] = br.load([tmp_path])
    table = br.choice_table(loaded)
    assert table["1"][15] == {"steps": 3, "runs": 2, "median_run": 1.5, "ms_after_same": 4.0, "ms_after_change": 5.0,
                              "ms_timed": 4.5, "why": {"explore": 2, "best": 2}}
    assert table["1"][64] == {"steps": 2, "runs": 1, "median_run": 2, "ms_after_same": 3.0, "ms_after_change": 6.0,
                              "ms_timed": 6.0, "why": {"probe": 3, "best": 1}}
    assert table["3-4"][15]["ms_after_change"] == 9.0 and table["3-4"][15]["runs"] == 1
    stretches = br.best_stretches(loaded)
    assert [(s["budget"], s["from_step"], s["decisions"]) for s in stretches["1"]] == [(15, 4, 2), (64, 7, 1)]
    assert stretches["1"][1]["tokens_per_ms"] == {15: 0.25, 16: None, 64: 0.4}
    text = br.report(name, loaded, table, stretches, top=8, groups=[])
    assert "| 1 | chain | 3 | 2 | 1.5 | 4.0 | 5.0 | 4.5 | best 2, explore 2 |" in text
    assert "from step 7: B=64 for 1 decisions; tokens/ms seen: chain 0.250, B=64 0.400" in text


def test_budget_record_splits_each_group_at_its_first_finished_request():
    """A prefill without drafts starts a group (a second prefill chunk before any decode step does not); its steps at
    the group's batch size are the full batch, the rest its tail; an empty engine's output (batch 0) is neither."""
    steps = [[1, 4, 0, False, None, False], [2, 4, 0, False, 3.0, False], [3, 4, 64, True, 5.0, False],
             [4, 4, 64, True, 5.5, True], [5, 3, 64, False, 9.0, False], [6, 3, 15, True, 4.0, False],
             [7, 1, 15, True, 3.5, False], [8, 0, 0, False, 0.1, False],
             [9, 2, 0, False, 40.0, False], [10, 2, 32, True, 4.5, False], [11, 1, 32, True, 3.0, False]]
    record = {"budgets": [15, 32, 64], "chain": 15, "columns": ["step", "batch_size", "budget", "verify_only",
                                                                 "ms_since_last_output", "timed"], "steps": steps}
    groups = br.group_table(record)
    assert groups == [
        {"size": 4, "prefill_ms": None, "full_steps": 2, "full_ms": 10.5, "full_median_ms": 5.25, "tail_steps": 2,
         "tail_ms": 7.5, "tail_budgets": {15: 2}},
        {"size": 2, "prefill_ms": 40.0, "full_steps": 1, "full_ms": 4.5, "full_median_ms": 4.5, "tail_steps": 1,
         "tail_ms": 3.0, "tail_budgets": {32: 1}},
    ]
    assert "| 0 | 4 | None | 2 | 10.5 | 5.25 | 2 | 7.5 | 0.42 | chain 2 |" in br.report("r", record, {}, {}, 8, groups)


def test_an_engine_on_vllms_scheduler_records_steps_the_group_table_reads(tmp_path, monkeypatch):
    """bench_e2e's chain engine (vLLM's scheduler with step_record.py's recording) writes the cost-aware engine's
    record: one row per step output with its batch size, verified drafts and interval, read by the group table."""
    import json
    from types import SimpleNamespace

    sr = _load("step_record")
    monkeypatch.setenv("VLLM_DDTREE_BUDGET_RECORD", str(tmp_path))
    clock = iter([10.0, 10.040, 10.045, 10.0455, 10.050])
    monkeypatch.setattr(sr.time, "monotonic", lambda: next(clock))

    class VLLMScheduler:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config

        def update_from_output(self, scheduler_output, model_runner_output):
            return "outputs"

        def shutdown(self):
            self.stopped = True

    class Recording(sr._StepRecordMixin, VLLMScheduler):
        pass

    config = SimpleNamespace(speculative_config=SimpleNamespace(method="dflash", num_speculative_tokens=15))
    scheduler = Recording(vllm_config=config)
    prefill = SimpleNamespace(num_scheduled_tokens={"a": 9, "b": 7}, scheduled_spec_decode_tokens={},
                              scheduled_new_reqs=["a", "b"])
    both = SimpleNamespace(num_scheduled_tokens={"a": 16, "b": 16}, scheduled_new_reqs=[],
                           scheduled_spec_decode_tokens={"a": [1] * 15, "b": [1] * 15})
    last = SimpleNamespace(num_scheduled_tokens={"b": 16}, scheduled_spec_decode_tokens={"b": [1] * 15},
                           scheduled_new_reqs=[])
    for step in (prefill, both, both, last):
        assert scheduler.update_from_output(step, None) == "outputs"
    scheduler.shutdown()
    assert scheduler.stopped
    [(name, record)] = br.load([tmp_path])
    assert record["budgets"] == [15] and record["chain"] == 15 and record["decisions"] == []
    assert [row[:5] for row in record["steps"]] == [[1, 2, 0, False, None], [2, 2, 15, True, 40.0],
                                                    [3, 2, 15, True, 5.0], [4, 1, 15, True, 0.5]]
    assert br.group_table(record) == [{"size": 2, "prefill_ms": None, "full_steps": 2, "full_ms": 45.0,
                                       "full_median_ms": 22.5, "tail_steps": 1, "tail_ms": 0.5,
                                       "tail_budgets": {15: 1}}]
    assert json.loads((tmp_path / name).read_text())["columns"][4] == "ms_since_last_output"
