"""lossless_check's run cache (GPU sessions repeat the hybrid phase across device calls): a finished run is reused
only for the same inputs, environment and code; a run that did not finish leaves nothing behind."""

from __future__ import annotations

import json

import lossless_check as lc
import pytest
import torch


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """run_engine that records like the teacher site does (rows.pt at the config's "record" path) and counts calls."""
    calls = []

    def run_engine(env, spec, **args):
        config = json.loads(open(env[lc.TEACHER_ENV]).read())
        if args.get("fail"):
            raise AssertionError("engine run failed")
        torch.save({"reference": {(1, 2): torch.tensor([float(len(calls))])}}, config["record"])
        calls.append(spec)
        return {"token_ids": [[len(calls)]]}

    monkeypatch.setattr(lc, "run_engine", run_engine)
    monkeypatch.setenv(lc.RUN_CACHE_ENV, str(tmp_path / "runs"))
    return calls


def run(tmp_path, name, **kwargs):
    (tmp_path / name).mkdir()
    result, rows = lc._run({"model": "m", **kwargs.pop("args", {})}, {(1,): [1, 2]}, str(tmp_path / name), **kwargs)
    return result, torch.load(rows)["reference"][(1, 2)].item()


def test_a_finished_run_is_reused_for_the_same_inputs_only(fake_engine, tmp_path, monkeypatch):
    first = run(tmp_path, "a", spec={"method": "ddtree"})
    assert run(tmp_path, "b", spec={"method": "ddtree"}) == first and len(fake_engine) == 1
    run(tmp_path, "c", spec={"method": "dflash"})  # other inputs
    run(tmp_path, "d", spec={"method": "ddtree"}, fault="no_relayout")
    monkeypatch.setenv("VLLM_DDTREE_TEST_ATTENTION_BACKEND", "TRITON_ATTN")  # another engine environment
    run(tmp_path, "e", spec={"method": "ddtree"})
    assert len(fake_engine) == 4
    code = tmp_path / "code.py"
    code.write_text("x = 1")
    monkeypatch.setattr(lc, "RUN_CODE", [*lc.RUN_CODE, code])
    run(tmp_path, "f", spec={"method": "ddtree"})
    code.write_text("x = 2")  # the code under test changed
    run(tmp_path, "g", spec={"method": "ddtree"})
    assert len(fake_engine) == 6


def test_a_failed_run_is_not_cached(fake_engine, tmp_path):
    with pytest.raises(AssertionError):
        run(tmp_path, "a", args={"fail": True})
    assert not list((tmp_path / "runs").glob("*/result.json"))
