"""DDTree on Model Runner V2 (docs/model-runner-v2.md), on the CPU: config, patch 0004, and the glue around
vLLM's MRV2 kernels (run through TRITON_INTERPRET=1, tests/unit/conftest.py) with fake input batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_ddtree import config as ddtree_config

# ----------------------------------------------------------------------------- config (design §2.9, §2.10)


def drafter_spec(budget: int, depth: int | None, block_size: int = 16) -> SimpleNamespace:
    hf_config = SimpleNamespace(architectures=["DFlashDraftModel"], block_size=block_size)
    return SimpleNamespace(
        tree_budget=budget,
        tree_depth=depth,
        num_speculative_tokens=budget,
        model="drafter",
        draft_model_config=SimpleNamespace(hf_config=hf_config, architectures=["DFlashDraftModel"]),
        target_model_config=None,
    )


@pytest.mark.parametrize(
    "budget, depth, want_depth",
    [(64, None, 15), (8, None, 8), (1, None, 1), (64, 4, 4), (4, 4, 4)],
)
def test_depth_is_capped_by_the_budget_and_speculative_tokens_are_the_budget(budget, depth, want_depth):
    spec = drafter_spec(budget, depth)
    ddtree_config.validate_ddtree_drafter(spec)
    assert (spec.tree_depth, spec.num_speculative_tokens) == (want_depth, budget)
    ddtree_config.check_async_scheduling(spec)  # the invariant the async scheduler's placeholders need


@pytest.mark.parametrize(
    "budget, depth, message",
    [(4, 5, "exceeds the node budget"), (64, 16, "exceeds what one pass of this drafter predicts")],
)
def test_depth_beyond_budget_or_block_is_refused(budget, depth, message):
    with pytest.raises(ddtree_config.DDTreeConfigError, match=message):
        ddtree_config.validate_ddtree_drafter(drafter_spec(budget, depth))


class _NoRunnerQuestion:
    @property
    def use_v2_model_runner(self):  # mrv2_gaps runs inside this property: reading it would recurse
        raise AssertionError("use_v2_model_runner read")


def mrv2_vllm_config(**changes) -> SimpleNamespace:
    config = SimpleNamespace(
        model_config=SimpleNamespace(uses_mrope=False, is_multimodal_model=False),
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=SimpleNamespace(use_local_argmax_reduction=False, tree_budget=64),
    )
    for path, value in changes.items():
        obj, attr = path.split("__")
        setattr(getattr(config, obj), attr, value)
    return config


@pytest.fixture()
def on_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)


def test_without_opt_in_ddtree_stays_a_v1_only_method(monkeypatch):
    monkeypatch.delenv(ddtree_config.MRV2_ENV, raising=False)
    assert ddtree_config.mrv2_gaps(_NoRunnerQuestion()) == ["ddtree speculative decoding"]
    assert ddtree_config.runs_on_mrv2(_NoRunnerQuestion()) is False
    monkeypatch.setenv(ddtree_config.MRV2_ENV, "0")
    assert ddtree_config.mrv2_gaps(_NoRunnerQuestion()) == ["ddtree speculative decoding"]


def test_opt_in_on_cuda_has_no_gaps(monkeypatch, on_cuda):
    monkeypatch.setenv(ddtree_config.MRV2_ENV, "1")
    assert ddtree_config.mrv2_gaps(mrv2_vllm_config()) == []
    assert ddtree_config.runs_on_mrv2(SimpleNamespace(use_v2_model_runner=True)) is True
    assert ddtree_config.runs_on_mrv2(SimpleNamespace(use_v2_model_runner=False)) is False


@pytest.mark.parametrize(
    "change, gap",
    [
        ({"model_config__uses_mrope": True}, "M-RoPE"),
        ({"model_config__is_multimodal_model": True}, "multimodal"),
        ({"parallel_config__data_parallel_size": 2}, "data parallelism"),
        ({"parallel_config__pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"speculative_config__use_local_argmax_reduction": True}, "use_local_argmax_reduction"),
    ],
)
def test_opt_in_gaps_fall_back_to_v1(monkeypatch, on_cuda, change, gap):
    monkeypatch.setenv(ddtree_config.MRV2_ENV, "1")
    gaps = ddtree_config.mrv2_gaps(mrv2_vllm_config(**change))
    assert len(gaps) == 1 and gap in gaps[0]


def test_opt_in_off_cuda_is_a_gap(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setenv(ddtree_config.MRV2_ENV, "1")
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
    assert ddtree_config.mrv2_gaps(mrv2_vllm_config()) == ["ddtree off CUDA GPUs"]


# ----------------------------------------------------------------------------- patch 0004 (design §2 table)


def _patched_mrv2_sources() -> dict[str, str]:
    """Patch 0004's targets, patched in memory from pristine text (the installed vLLM, or VLLM_DDTREE_PRISTINE_VLLM
    when the installed one carries another patch set)."""
    import importlib.util
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "apply_patches.py"
    spec = importlib.util.spec_from_file_location("apply_patches", tool)
    ap = sys.modules.get("apply_patches")
    if ap is None:
        ap = importlib.util.module_from_spec(spec)
        sys.modules["apply_patches"] = ap
        spec.loader.exec_module(ap)
    from test_apply_patches import pristine_target

    ps = ap.load_patch_set()
    installed = ap.find_vllm_root(None)
    out = {}
    for path in ("vllm/v1/worker/gpu/spec_decode/__init__.py", "vllm/v1/worker/gpu/model_runner.py"):
        out[path] = ap.patched_text(ps, path, pristine_target(ps, installed, path))
    return out


def _function_source(module_text: str, name: str) -> str:
    import ast

    tree = ast.parse(module_text)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(module_text, node)
    raise AssertionError(f"no function {name}")


def test_patch_0004_hooks_sit_where_the_design_needs_them():
    sources = _patched_mrv2_sources()
    init = _function_source(sources["vllm/v1/worker/gpu/spec_decode/__init__.py"], "init_speculator")
    assert init.index("tree_budget is not None") < init.index("DDTreeSpeculator(") < init.index('== "dflash"')
    runner = sources["vllm/v1/worker/gpu/model_runner.py"]
    load = _function_source(runner, "load_model")
    assert load.index("RejectionSampler(") < load.index('"make_rejection_sampler"')
    execute = _function_source(runner, "execute_model")
    # After the slot mapping (prepare_attn) and before the attention metadata and the forward read positions.
    hook = execute.index('"prepare_verify"')
    assert execute.index("self.prepare_attn(input_batch)") < hook < execute.index("self.model_state.prepare_attn(")
    assert hook < execute.index("self.model_state.prepare_inputs(")
