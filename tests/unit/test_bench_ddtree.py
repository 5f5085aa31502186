"""benchmarks/bench_ddtree.py's pure parts: ms/step, ratios, the tree tax and the step-phase mapping, checked against
saved H200 bench_e2e runs (the numbers benchmarks/README.md quotes), and the bench_e2e commands it builds."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_ddtree import step_timing

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "h200-2026-11-29b"
_spec = importlib.util.spec_from_file_location("bench_ddtree", REPO / "benchmarks" / "bench_ddtree.py")
bd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bd)


def _rows(name: str, workload: str) -> dict[tuple[str, int], dict]:
    result = json.loads((RESULTS / name).read_text())
    return {(r["config"], r["batch"]): r for r in bd.rows_from_e2e(workload, [result])}


def test_ms_per_step_is_batch_tau_over_throughput():
    assert bd.ms_per_step(407.0, 2.416, 1) == pytest.approx(5.936, abs=1e-3)
    assert bd.ms_per_step(749.4, 2.403, 8) == pytest.approx(25.652, abs=1e-3)
    assert bd.ms_per_step(460.5, None, 1) == pytest.approx(2.172, abs=1e-3)  # no-spec: one token per step
    assert bd.ms_per_step(0.0, 2.0, 1) is None


def test_phases_cover_every_step_timing_interval_once():
    cycle = {f"{a} -> {b}" for a, b in zip(step_timing.ORDER, step_timing.ORDER[1:] + step_timing.ORDER[:1])}
    intervals = [phase.interval for phase in bd.PHASES]
    assert sorted(intervals) == sorted(cycle)
    named = {phase.name: phase.interval for phase in bd.PHASES}
    assert named["draft"] == "linearised -> build" and named["tree_build"] == "build -> built"
    assert named["scheduler"] == "built -> prepare" and named["verify"] == "prepared -> sample"
    assert named["walk"] == "sample -> walked" and named["compaction"] == "walked -> compacted"


def test_smollm2_ratios_and_breakdown_match_the_saved_run():
    rows = _rows("bench_e2e_smollm2_trained.json", "smollm2")
    tree = rows[("ddtree B=64", 1)]
    assert tree["ms_per_step"] == pytest.approx(5.94, abs=0.01)
    assert tree["vs_chain"] == pytest.approx(0.803, abs=1e-3)       # chain as users run it (MRV2, async)
    assert tree["vs_chain_v1"] == pytest.approx(1.132, abs=1e-3)    # chain on DDTree's runner and backend
    assert tree["chain_v1_config"] == "dflash V1+tri"
    # tax = ms/step(tree) / ms/step(chain) - 1, with each side's own tau
    chain_v1_ms = 1000 * 1.923 / 359.6
    assert tree["tax_vs_chain_v1"] == pytest.approx(1000 * 2.416 / 407.0 / chain_v1_ms - 1, abs=1e-4)
    assert tree["tax_vs_chain"] == pytest.approx((1000 * 2.416 / 407.0) / (1000 * 1.927 / 506.6) - 1, abs=1e-4)
    b = tree["breakdown"]
    assert (b["draft"]["host_ms"], b["draft"]["device_ms"]) == (1.2741, 0.283)
    assert (b["tree_build"]["host_ms"], b["tree_build"]["device_ms"]) == (0.149, 0.6255)
    assert (b["scheduler"]["host_ms"], b["scheduler"]["device_ms"]) == (1.6816, 1.1094)
    assert (b["verify"]["host_ms"], b["verify"]["device_ms"]) == (0.5636, 2.4444)
    assert (b["walk"]["host_ms"], b["compaction"]["host_ms"]) == (0.098, 0.1556)
    assert tree["step_host_ms_median_sum"] == pytest.approx(4.7800, abs=1e-3)
    # That engine ran batch 1 and 8: its breakdown covers both and must say so; GPU idle is not derivable.
    assert tree["breakdown_batches"] == [1, 8] and tree["gpu_idle_ms"] is None
    # Over whole steps the host and device-stream means add up to the same wall time (why host - device != idle).
    assert tree["step_host_ms_mean_sum"] == pytest.approx(tree["step_device_ms_mean_sum"], rel=0.02)
    # Baselines carry ratios but no tax or breakdown; B=64 at batch 8 (520 tokens) outgrows the 512-token graphs.
    assert rows[("dflash", 1)]["vs_chain"] == 1.0 and rows[("dflash", 1)]["tax_vs_chain"] is None
    assert "breakdown" not in rows[("no-spec", 1)]
    assert rows[("ddtree B=64", 8)]["over_cuda_graph_capture"] and not rows[("ddtree B=16", 8)][
        "over_cuda_graph_capture"]
    assert rows[("ddtree B=64", 8)]["ms_per_step"] == pytest.approx(25.65, abs=0.01)


def test_qwen3_tree_tax_against_the_v1_chain():
    rows = _rows("tax_qwen3_8b_shape.json", "qwen3-8b")
    assert rows[("ddtree B=16", 1)]["tax_vs_chain_v1"] == pytest.approx(160.7 / 100.4 - 1, abs=1e-4)  # +60 %
    assert rows[("ddtree B=64", 1)]["tax_vs_chain_v1"] == pytest.approx(160.7 / 100.1 - 1, abs=1e-4)  # +61 %
    assert rows[("ddtree B=64", 1)]["chain_v1_config"] == "dflash V1"
    # That run had no chain on the default runner and no no-spec: those ratios are absent, not invented.
    assert rows[("ddtree B=64", 1)]["tax_vs_chain"] is None and rows[("ddtree B=64", 1)]["vs_no_spec"] is None
    assert rows[("ddtree B=16", 1)]["breakdown"]["scheduler"] == {"host_ms": 5.1578, "device_ms": 1.662, "count": 282}
    assert rows[("ddtree B=64", 1)]["breakdown_batches"] == [1]


def test_chain_v1_is_the_default_chain_only_when_it_ran_on_v1():
    assert bd.chain_v1_config({("dflash", 1): {"model_runner": "V1"}}) == "dflash"
    assert bd.chain_v1_config({("dflash", 1): {"model_runner": "V2"}}) is None
    assert bd.chain_v1_config({("dflash", 1): {"model_runner": "V1"}, ("dflash V1+tri", 1): {}}) == "dflash V1+tri"
    # the V1 chain on TRITON_ATTN is DDTree's runner and backend; the plain V1 chain only stands in for it
    assert bd.chain_v1_config({("dflash V1", 1): {}, ("dflash V1+tri", 1): {}}) == "dflash V1+tri"


def test_phase_breakdown_keeps_unknown_intervals_and_handles_missing_reports():
    assert bd.phase_breakdown(None) is None and bd.phase_breakdown({}) is None
    report = {"prepared -> sample": {"host_ms_median": 1.0, "device_ms_median": 3.0, "host_ms_mean": 1.5,
                                     "device_ms_mean": 3.5, "count": 4},
              "new -> mark": {"host_ms_median": 0.5, "device_ms_median": 0.25, "count": 4}}
    b = bd.phase_breakdown(report)
    assert b["verify"] == {"host_ms": 1.0, "device_ms": 3.0, "count": 4} and "new -> mark" in b
    assert b["_sum"] == {"host_ms": 1.5, "device_ms": 3.25} and b["_mean_sum"] == {"host_ms": 1.5, "device_ms": 3.5}


def test_table_and_json_from_saved_runs(tmp_path):
    out = tmp_path / "report.json"
    rc = bd.main(["--from-e2e", str(RESULTS / "bench_e2e_smollm2_trained.json"),
                  str(RESULTS / "tax_qwen3_8b_shape.json"), "--out", str(out), "--png", str(tmp_path / "r.png")])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {r["workload"] for r in report["rows"]} == {"smollm2", "qwen3-8b"}
    assert report["meta"]["phases"]["draft"]["interval"] == "linearised -> build"
    table = bd.format_table(report["rows"])
    line = next(x for x in table.splitlines() if re.match(r"qwen3-8b +ddtree B=64 ", x))
    assert "+61%" in line and "9.99" in line
    assert "DDTree step breakdown" in table
    pytest.importorskip("matplotlib")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_time_ddtree_per_batch_and_baselines_once(tmp_path):
    def runs(*extra):
        return bd.build_runs(bd.parse_args(["--workloads", "smollm2", "qwen3-8b", "--budgets", "16", "64",
                                            "--batch-sizes", "1", "64", "--out", str(tmp_path / "r.json"), *extra]))

    split = runs("--drafter", "d", "--capture-sizes", "vllm")
    assert [(r["workload"], r["tag"]) for r in split] == [
        ("smollm2", "baselines"), ("smollm2", "ddtree_b1"), ("smollm2", "ddtree_b64"),
        ("qwen3-8b", "baselines"), ("qwen3-8b", "ddtree_b1"), ("qwen3-8b", "ddtree_b64")]
    base, tree = split[0]["argv"], split[2]["argv"]
    assert "--same-backend-baselines" not in base and "--step-timing" not in base
    assert base[base.index("--batch-sizes") + 1: base.index("--batch-sizes") + 3] == ["1", "64"]
    assert base[base.index("--configs") + 1] == "no-spec,dflash"
    assert "--step-timing" in tree and tree[tree.index("--batch-sizes") + 1] == "64"
    assert tree[tree.index("--configs") + 1] == "ddtree B=16,ddtree B=64"
    assert tree[tree.index("--capture-sizes") + 1] == "vllm" and tree[-2:] == ["--out", split[2]["out"]]
    assert "--drafter" in base and "--drafter" not in split[3]["argv"]  # --shape replaces the drafter
    assert split[3]["argv"][:2] == ["--shape", "qwen3-8b"]
    shared = runs("--shared-engines", "--async-ab", "--same-backend-baselines")
    assert len(shared) == 2
    argv = shared[0]["argv"]
    assert {"--step-timing", "--same-backend-baselines", "--async-ab"} <= set(argv)
    assert argv[argv.index("--configs") + 1] == ("no-spec,dflash,no-spec V1+tri,dflash V1+tri,ddtree B=16,"
                                                 "ddtree B=64,ddtree B=16 async,ddtree B=64 async")
    cost_aware = runs("--tree-budgets", "16", "32", "64")[1]["argv"]
    assert cost_aware[cost_aware.index("--configs") + 1] == "ddtree B=16,ddtree B=64,ddtree cost-aware"
    assert cost_aware[cost_aware.index("--tree-budgets") + 1: cost_aware.index("--tree-budgets") + 4] == [
        "16", "32", "64"]
    fallback = runs("--ddtree-default", "--chain-fallback")[1]["argv"]
    assert {"--ddtree-default", "--chain-fallback"} <= set(fallback)
    assert fallback[fallback.index("--configs") + 1] == "ddtree B=16,ddtree B=64,ddtree default,ddtree chain fallback"


def test_paper_tau_and_prefill_workloads_run_what_they_say(tmp_path):
    runs = bd.build_runs(bd.parse_args(["--workloads", "qwen3-8b-paper-tau", "prefill-8k", "--budgets", "16",
                                        "--batch-sizes", "1", "8", "--max-tokens", "64", "--out",
                                        str(tmp_path / "r.json")]))
    assert [(r["workload"], r["tag"]) for r in runs] == [
        ("qwen3-8b-paper-tau", "baselines"), ("qwen3-8b-paper-tau", "ddtree_b1"), ("qwen3-8b-paper-tau", "ddtree_b8"),
        ("prefill-8k", "all")]
    synthetic = runs[1]["argv"]
    tau = synthetic.index("--synthetic-acceptance-length")
    assert synthetic[tau + 1: tau + 3] == ["7.79", "10.73"] and synthetic[:2] == ["--shape", "qwen3-8b"]
    prefill = runs[-1]["argv"]
    assert prefill[prefill.index("--prefill-tokens") + 1] == "8192" and "--max-tokens" not in prefill
    assert prefill[prefill.index("--batch-sizes") + 1: prefill.index("--batch-sizes") + 3] == ["1", "--configs"]
    assert prefill[prefill.index("--configs") + 1] == "no-spec,dflash,ddtree B=16"
    assert "--step-timing" not in prefill and prefill[prefill.index("--num-prompts") + 1] == "4"
    # saved runs find their workload again from bench_e2e's meta
    assert bd.workload_of({"shape": "qwen3-8b", "synthetic_acceptance_length": [7.79, 10.73]}) == "qwen3-8b-paper-tau"
    assert bd.workload_of({"shape": "qwen3-8b", "prefill_tokens": 8192}) == "prefill-8k"
    assert bd.workload_of({"shape": "qwen3-8b"}) == "qwen3-8b" and bd.workload_of({}) == "smollm2"


def test_prefill_rows_and_start_up_come_through():
    meta = {"shape": "qwen3-8b", "prefill_tokens": 8192, "device": "NVIDIA H200", "capture_sizes": "auto"}
    table = [{"config": "no-spec", "batch": 1, "tokens_per_s": 1.0, "tau": None, "engine_start_s": 61.0,
              "prefill_tokens_per_s": 40000.0, "prefill_vs_no_spec": 1.0},
             {"config": "ddtree B=16", "batch": 1, "tokens_per_s": 1.0, "tau": None, "engine_start_s": 95.5,
              "prefill_tokens_per_s": 38000.0, "prefill_vs_no_spec": 0.95}]
    rows = {r["config"]: r for r in bd.rows_from_e2e("prefill-8k", [{"meta": meta, "table": table}])}
    assert rows["ddtree B=16"]["prefill_vs_no_spec"] == 0.95 and rows["ddtree B=16"]["engine_start_s"] == 95.5
    assert rows["ddtree B=16"]["over_cuda_graph_capture"] is False  # "auto" covers every verify step
    line = next(x for x in bd.format_table(list(rows.values())).splitlines() if "ddtree B=16" in x)
    assert "prefill 38000 tok/s, x no-spec 0.950, start 96 s" in line


def test_largest_graph_follows_the_capture_choice():
    assert bd.largest_graph("auto", 520) == 528  # onto vLLM's grid (520 would be truncated to 512)
    assert bd.largest_graph("auto", 17) == 512 and bd.largest_graph("vllm", 520) == 512
    assert bd.largest_graph(None, 520) == 512  # runs saved before bench_e2e recorded the choice
    assert bd.largest_graph("1,8,64", 17) == 64
    assert bd.largest_graph("shared", 520) == 528


def test_shared_capture_sizes_pad_every_configurations_prefill_alike():
    """B=64 at batch 8 (2026-12-02, bf16): no-spec's default list ends at 16 (8 sequences x 1 x 2), the chain's at
    256, DDTree B=64's at 528, so a 371-token prefill runs eagerly in two engines and padded to 384 in a graph in
    the third (where one prompt's first token differed from no-spec's). "shared" gives all three 528."""
    be = _bench_e2e()
    chain, tree = {"num_speculative_tokens": 15}, {"num_speculative_tokens": 64}
    assert [be.largest_capture_size(s, [1, 8]) for s in (None, chain, tree)] == [16, 256, 528]
    assert be.largest_capture_size({"method": "ddtree", "model": "d"}, [1, 8]) == 528  # no budget: ddtree's largest
    every = [None, chain, tree]
    want = {"max_cudagraph_capture_size": 528}
    assert all(be.capture_sizes("shared", s, [1, 8], True, every) == want for s in every)
    assert be.capture_sizes("auto", None, [1, 8], True, every) is None  # vLLM's own list
    assert be.capture_sizes("shared", tree, [1, 8], False, every) is None  # no graphs


def test_split_runs_combine_per_workload(tmp_path):
    """The default mode's files (baselines over all batches, DDTree once per batch) make one set of rows: ratios
    across the files of one run, each DDTree row's breakdown from its own batch's engine."""
    def row(config, batch, tps, tau, runner):
        return {"config": config, "batch": batch, "tokens_per_s": tps, "tau": tau, "model_runner": runner}

    def timing(verify_ms):
        return [{"prepared -> sample": {"host_ms_median": 1.0, "device_ms_median": verify_ms, "count": 5}}]

    files = {
        "base": {"meta": {"shape": "qwen3-8b"}, "table": [
            row("dflash", 1, 200.0, 1.0, "V2"), row("dflash", 4, 600.0, 1.0, "V2"),
            row("dflash V1+tri", 1, 100.0, 1.0, "V1"), row("dflash V1+tri", 4, 400.0, 1.0, "V1")]},
        "b1": {"meta": {"shape": "qwen3-8b", "step_timing": {"ddtree B=16": timing(7.0)}},
               "table": [row("ddtree B=16", 1, 80.0, 1.0, "V1")]},
        "b4": {"meta": {"shape": "qwen3-8b", "step_timing": {"ddtree B=16": timing(9.0)}},
               "table": [row("ddtree B=16", 4, 320.0, 1.0, "V1")]},
    }
    paths = []
    for name, data in files.items():
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "r.json"
    assert bd.main(["--from-e2e", *map(str, paths), "--out", str(out), "--png", str(tmp_path / "r.png")]) == 0
    rows = {(r["config"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("ddtree B=16", 1)]["tax_vs_chain_v1"] == pytest.approx(0.25)   # 12.5 ms vs 10 ms
    assert rows[("ddtree B=16", 1)]["tax_vs_chain"] == pytest.approx(1.5)       # vs 5 ms
    assert rows[("ddtree B=16", 4)]["ms_per_step"] == pytest.approx(12.5)       # 1000 * 4 / 320
    assert rows[("ddtree B=16", 4)]["tax_vs_chain_v1"] == pytest.approx(0.25)
    assert rows[("ddtree B=16", 1)]["breakdown"]["verify"]["device_ms"] == 7.0
    assert rows[("ddtree B=16", 4)]["breakdown"]["verify"]["device_ms"] == 9.0
    assert rows[("ddtree B=16", 4)]["breakdown_batches"] == [4]
    assert rows[("ddtree B=16", 4)]["vs_no_spec"] is None  # no no-spec row: no ratio


def test_budget_schedule_picks_the_fastest_fixed_budget_per_batch():
    """The adaptive-budget recommendation: fastest fixed budget per batch size, ranges down to the previous size,
    equal neighbours merged; async/MRV2 variants and other workloads do not count."""
    def row(config, batch, tps, workload="smollm2"):
        return {"workload": workload, "config": config, "batch": batch, "tokens_per_s": tps}

    rows = [
        row("ddtree B=64", 1, 500.0), row("ddtree B=16", 1, 400.0), row("ddtree B=64 async", 1, 900.0),
        row("ddtree B=64", 4, 1500.0), row("ddtree B=16", 4, 1400.0),
        row("ddtree B=64", 16, 3000.0), row("ddtree B=16", 16, 3500.0), row("dflash", 16, 9000.0),
        row("ddtree B=64", 64, 5000.0), row("ddtree B=16", 64, 6000.0),
        row("ddtree B=16", 1, 9999.0, workload="qwen3-8b"),
    ]
    assert bd.budget_schedule(rows, "smollm2") == [[1, 4, 64], [5, 64, 16]]
    assert bd.budget_schedule(rows, "qwen3-8b") == [[1, 1, 16]]
    assert bd.budget_schedule([row("dflash", 1, 1.0)], "smollm2") is None


def test_projected_speedup_uses_the_papers_tau_over_the_step_cost():
    assert bd.projected_speedup(0.0) == pytest.approx(10.73 / 7.79, abs=1e-3)
    assert bd.projected_speedup(0.61) == pytest.approx(10.73 / 7.79 / 1.61, abs=1e-3)  # the 2026-11-29 tax: 0.86x
    assert bd.projected_speedup(None) is None


def _bench_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", REPO / "benchmarks" / "bench_e2e.py")
    be = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(be)
    return be


def test_bench_e2e_reads_a_workers_result_line_and_not_a_traceback_quoting_it():
    """A TP=2 worker that died at start-up (2026-11-30) left a traceback quoting the marker's print statement, which
    bench_e2e parsed as a result and crashed on, losing the other configurations' table."""
    be = _bench_e2e()
    traceback = '  File "bench_e2e.py", line 190, in main\n    print("BENCH_RESULT " + json.dumps(worker(x)))\n'
    assert be.worker_result("INFO starting\n" + traceback) is None
    assert be.worker_result('(Worker pid=7) partial BENCH_RESULT {"rows": [1]}\nINFO shutdown\n') == {"rows": [1]}


def test_bench_e2e_records_the_steps_of_engines_on_vllms_scheduler_only(monkeypatch):
    """With the step record asked for, the chain, no-spec and a fixed budget record through step_record.py; the
    cost-aware engines keep their own scheduler (a scheduler_cls given to the default would turn its budget fixed)."""
    be = _bench_e2e()
    chain = {"method": "dflash", "num_speculative_tokens": 15}
    fixed = {"method": "ddtree", "num_speculative_tokens": 64}
    cost_aware = [{"method": "ddtree"}, {**fixed, "tree_budgets": [16, 64]},
                  {**fixed, "num_speculative_tokens_per_batch_size": [[1, 8, 64]]}]
    monkeypatch.delenv("VLLM_DDTREE_BUDGET_RECORD", raising=False)
    assert [be._step_record_scheduler(s) for s in (None, chain, fixed)] == [None] * 3
    monkeypatch.setenv("VLLM_DDTREE_BUDGET_RECORD", "/tmp/record")
    assert [be._step_record_scheduler(s) for s in (None, chain, fixed)] == ["step_record.make_scheduler"] * 3
    assert [be._step_record_scheduler(s) for s in cost_aware] == [None] * 3


def test_bench_e2e_runs_the_named_configurations_in_the_order_named(capsys):
    """Engines run one after another; running the same names in another order tells a drifting host from an engine's
    own cost (H100, 2026-12-07: the default, run last, cost 0.5-2.5 ms a step more than B=64 before it)."""
    be = _bench_e2e()
    configs = [("no-spec", None, {}), ("dflash", {"method": "dflash"}, {}), ("ddtree B=64", {"method": "ddtree"}, {}),
               ("ddtree default", {"method": "ddtree"}, {})]
    chosen = be.select_configs(configs, ["ddtree default,ddtree B=64", "dflash", "ddtree default"])
    assert [c[0] for c in chosen] == ["ddtree default", "ddtree B=64", "dflash"]
    assert capsys.readouterr().out == ""
    assert [c[0] for c in be.select_configs(configs, ["dflash,ddtree adaptive"])] == ["dflash"]
    assert "'ddtree adaptive'" in capsys.readouterr().out


def test_bench_e2e_keeps_ddtrees_start_up_line_and_budget_choices_from_the_engines_log():
    """The H200 runs of 2026-12-04 lost them: they are logged in the worker's log, which a clean run deletes."""
    be = _bench_e2e()
    start_up = "ddtree runs on Model Runner V2 (vLLM's default runner for this target); cost-aware node budget among"
    summary = "batch 1: B=16: 3 steps, B=64: 40 steps (2.90 tokens / 5.99 ms); batch 5-8: B=16: 9 steps"
    log = (f"(EngineCore pid=9) INFO 12-04 20:13:01 [speculator.py:73] {start_up} [16, 32, 64]\n"
           "(EngineCore pid=9) INFO 12-04 20:14:01 [scheduler.py:56] ddtree cost-aware budget, verify steps: "
           f"{summary}\nINFO shutdown\n")
    assert be.ddtree_log_lines(log) == {"start_up": f"{start_up} [16, 32, 64]", "budget_choices": summary}
    assert be.ddtree_log_lines("INFO starting\nBENCH_RESULT {}\n") == {}


def test_engines_started_side_by_side_measure_one_at_a_time_once_all_have_started(tmp_path):
    """--concurrent-engines: no engine measures while another may still compile or capture (ready, or its worker
    gone), and two never measure at once."""
    be = _bench_e2e()
    events, inside = [], threading.Lock()

    def engine(me):
        with be._alone_on_the_device({"dir": str(tmp_path), "me": me, "engines": ["a", "b", "c"]}):
            assert inside.acquire(blocking=False), "two engines measured at once"
            events.append(me)
            time.sleep(0.2)
            inside.release()

    threads = [threading.Thread(target=engine, args=(me,)) for me in ("a", "b")]
    for t in threads:
        t.start()
    time.sleep(1.0)
    assert events == []  # c has neither started nor died
    (tmp_path / "gone.c").touch()
    for t in threads:
        t.join(timeout=30)
    assert sorted(events) == ["a", "b"]


def test_resume_skips_the_runs_an_earlier_call_finished(tmp_path, monkeypatch):
    """A report longer than one device call: the repeated command runs only what is left."""
    started = []

    def fake_bench_e2e(cmd, cwd):
        argv = cmd[2:]
        started.append(argv[argv.index("--configs") + 1])
        configs = argv[argv.index("--configs") + 1].split(",")
        table = [{"config": c, "batch": 1, "tokens_per_s": 100.0, "tau": None if c == "no-spec" else 2.0}
                 for c in configs]
        Path(argv[argv.index("--out") + 1]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[argv.index("--out") + 1]).write_text(json.dumps({"meta": {}, "table": table}))
        return subprocess.CompletedProcess(cmd, 1 if "ddtree B=16" in configs and len(started) < 3 else 0)

    monkeypatch.setattr(bd.subprocess, "run", fake_bench_e2e)
    argv = ["--workloads", "smollm2", "--budgets", "16", "--batch-sizes", "1", "--out", str(tmp_path / "r.json"),
            "--png", str(tmp_path / "r.png")]
    assert bd.main(argv) == 1  # the DDTree run failed (e.g. cut by the call's time limit)
    assert started == ["no-spec,dflash", "ddtree B=16"]
    assert bd.main([*argv, "--resume"]) == 0
    assert started[2:] == ["ddtree B=16"]  # the baselines were not run again
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r.get("resumed", False) for r in report["meta"]["runs"]] == [True, False]
    assert {r["config"] for r in report["rows"]} == {"no-spec", "dflash", "ddtree B=16"}


def test_request_latencies_split_the_first_token_on_the_engine_cores_clock():
    """The default's first token came about one decode step after the chain's (H100, 2026-12-06): whether a request
    waits for a step or waits in one is the split of its engine-core timestamps."""
    be = _bench_e2e()

    def output(queued, scheduled, first, last, latency, tokens):
        metrics = SimpleNamespace(queued_ts=queued, scheduled_ts=scheduled, first_token_ts=first,
                                  last_token_ts=last, first_token_latency=latency)
        return SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[0] * tokens)])

    lat = be.request_latencies([output(10.0, 10.002, 10.030, 10.330, 0.031, 11),
                                output(20.0, 20.0075, 20.020, 20.020, 0.021, 1)])
    assert lat["queued_ms_each"] == [2.0, 7.5]
    assert lat["scheduled_to_first_token_ms_each"] == [28.0, 12.5]
    assert lat["first_token_ms_each"] == [31.0, 21.0]
    assert lat["decode_ms_per_token"] == pytest.approx(30.0)  # the one-token request has no decode


def test_bench_e2e_prints_each_rows_host_cpu_use(capsys):
    """The host CPU line under the table (ddtree_testkit/host_load.py): the engine's own use, the rest's, the
    busiest other process and the steal share; a row without it (a saved run, no /proc) prints none."""
    be = _bench_e2e()
    row = {"batch": 8, "tokens_per_s": 100.0, "tau": 2.0, "token_ids": [[1, 2]], "accepted_per_position": None}
    cpu = {"own": 1.25, "elsewhere": 0.5, "busiest": [["EngineCore[42]", 0.4]], "steal": 0.02, "seconds": 12.0}
    table = be.summarise({"ddtree B=64": {"rows": [{**row, "host_cpu": cpu}]}, "dflash": {"rows": [row]}})
    be.print_table(table)
    lines = [line for line in capsys.readouterr().out.splitlines() if "host CPUs used" in line]
    assert lines == ["ddtree B=64                  8 host CPUs used: engine 1.25, elsewhere 0.50 (EngineCore[42] "
                     "0.40), steal 2.0%, over 12.0 s"]


def test_bench_e2e_keeps_each_groups_time_and_its_ratio_to_the_chains(capsys):
    """Each row keeps its groups' wall times, and beside the chain's (same prompts, same tokens) each group's ratio:
    a whole-run ratio over two or three groups is read with its groups' spread. Rows whose groups do not pair up
    with the chain's (another count) get none."""
    be = _bench_e2e()
    row = {"batch": 8, "tokens_per_s": 100.0, "tau": 2.0, "token_ids": [[1, 2]], "accepted_per_position": None}
    table = be.summarise({"dflash": {"rows": [{**row, "group_seconds": [2.0, 1.0, 0.5]}]},
                          "ddtree default": {"rows": [{**row, "group_seconds": [1.6, 1.25, 0.5]}]},
                          "ddtree B=64": {"rows": [{**row, "group_seconds": [1.0, 1.0]}]}})
    by_name = {t["config"]: t for t in table}
    assert by_name["ddtree default"]["group_seconds"] == [1.6, 1.25, 0.5]
    assert by_name["ddtree default"]["vs_chain_by_group"] == [1.25, 0.8, 1.0]
    assert by_name["dflash"]["vs_chain_by_group"] == [1.0, 1.0, 1.0]
    assert by_name["ddtree B=64"]["vs_chain_by_group"] is None
    be.print_table(table)
    lines = [line for line in capsys.readouterr().out.splitlines() if "by group" in line]
    assert lines == ["ddtree default               8 x chain by group: 1.250 0.800 1.000"]
