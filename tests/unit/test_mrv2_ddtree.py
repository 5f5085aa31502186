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
        model_config=SimpleNamespace(uses_mrope=False, is_multimodal_model=False, is_hybrid=False),
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=SimpleNamespace(use_local_argmax_reduction=False, tree_budget=64, tree_budgets=None,
                                           tree_budget_is_default=False, num_speculative_tokens=64,
                                           num_speculative_tokens_per_batch_size=None, tree_depth=15,
                                           max_num_new_slots_for_drafting=14),
        scheduler_config=SimpleNamespace(scheduler_cls=None, max_num_seqs=8, max_num_batched_tokens=2048,
                                         max_num_scheduled_tokens=None),
    )
    for path, value in changes.items():
        obj, attr = path.split("__")
        setattr(getattr(config, obj), attr, value)
    return config


@pytest.fixture()
def on_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


def test_on_cuda_model_runner_v2_has_no_gaps(on_cuda):
    assert ddtree_config.mrv2_gaps(mrv2_vllm_config()) == []
    schedule = {"speculative_config__num_speculative_tokens_per_batch_size": [[1, 1, 64], [2, 8, 16]]}
    assert ddtree_config.mrv2_gaps(mrv2_vllm_config(**schedule)) == []  # the adaptive budget runs on it too


@pytest.mark.parametrize("cuda", [True, False])
def test_ddtree_schedules_asynchronously_by_default_on_cuda_only(monkeypatch, cuda):
    """On either runner on CUDA, as vLLM's DFlash chain, but for a budget schedule on V1 (never run there); the CPU
    engine cannot."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: cuda)

    def config(on_v2, schedule=None):
        spec = SimpleNamespace(num_speculative_tokens_per_batch_size=schedule)
        return SimpleNamespace(use_v2_model_runner=on_v2, speculative_config=spec)

    schedule = [[1, 1, 64], [2, 8, 16]]
    assert ddtree_config.schedules_async_by_default(config(True)) is cuda
    assert ddtree_config.schedules_async_by_default(config(False)) is cuda
    assert ddtree_config.schedules_async_by_default(config(True, schedule)) is cuda
    assert ddtree_config.schedules_async_by_default(config(False, schedule)) is False


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
def test_gaps_fall_back_to_v1_and_the_start_up_line_names_them(on_cuda, change, gap):
    config = mrv2_vllm_config(**change)
    gaps = ddtree_config.mrv2_gaps(config)
    assert len(gaps) == 1 and gap in gaps[0]
    assert gap in ddtree_config.describe_runner(config, on_mrv2=False)


class _SpecWithSchedule(SimpleNamespace):
    def uses_dynamic_speculative_decoding(self) -> bool:
        return self.num_speculative_tokens_per_batch_size is not None


@pytest.mark.parametrize("has_chains", [False, True], ids=["trees", "and-chains"])
@pytest.mark.parametrize("schedule", [None, [[1, 1, 64], [2, 8, 16], [9, 64, 4]]])
def test_drafter_graphs_have_one_query_length_under_a_budget_schedule(monkeypatch, schedule, has_chains):
    """MRV2's graph manager derives per-schedule query lengths as ``b + (query length - B)``: for DDTree's drafter
    (``1 + depth`` queries, B = 64) that is 16 - 48 = -32 at b = 16. The drafter's graphs must all be ``1 + depth``
    wide (the target's follow the schedule: vLLM's own derivation, right for a verify of ``1 + b`` rows). With the
    chain fallback (``batch_chains``) a second manager captures the chain-only drafts."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu import cudagraph_utils
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_speculator

    from vllm_ddtree.mrv2.speculator import DDTreeSpeculator

    monkeypatch.setattr(cudagraph_utils, "get_pp_group", lambda: SimpleNamespace(is_first_rank=True, is_last_rank=True))
    monkeypatch.setattr(type(cudagraph_utils.current_platform), "get_global_graph_pool", lambda self: None)
    budget, depth, max_seqs = 64, 15, 8
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                                           max_cudagraph_capture_size=512),
        parallel_config=SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1),
        speculative_config=_SpecWithSchedule(num_speculative_tokens_per_batch_size=schedule),
        num_speculative_tokens=budget,
    )
    drafter = object.__new__(DDTreeSpeculator)  # only what init_cudagraph_manager reads
    drafter.vllm_config, drafter.device, drafter.num_query_per_req = vllm_config, "cpu", 1 + depth
    drafter.attn_cg_support = SimpleNamespace(
        min_cg_support=dflash_speculator.AttentionCGSupport.UNIFORM_BATCH, min_cg_attn_backend="FLASH_ATTN")
    drafter.batch_chains = torch.zeros(max_seqs, depth, dtype=torch.int64) if has_chains else None
    drafter._chain_graphs, drafter._drafting_chain = None, False
    drafter.init_cudagraph_manager(CUDAGraphMode.FULL_AND_PIECEWISE)
    manager = drafter.query_cudagraph_manager
    managers = [manager] + ([drafter._chain_graphs] if has_chains else [])
    for each in managers:
        widths = {d.uniform_token_count for descs in each._capture_descs.values() for d in descs}
        assert widths == {1 + depth}
        assert each.vllm_config.speculative_config.num_speculative_tokens_per_batch_size is None
    assert drafter.vllm_config is vllm_config  # the view was the managers' only
    assert (drafter._chain_graphs is not None) == has_chains and drafter._chain_graphs is not manager
    captured = []
    monkeypatch.setattr(dflash_speculator.DFlashSpeculator, "capture",
                        lambda self: captured.append((self._drafting_chain, self.query_cudagraph_manager)))
    drafter.capture()
    assert captured == [(False, manager)] + ([(True, drafter._chain_graphs)] if has_chains else [])
    assert (drafter._drafting_chain, drafter.query_cudagraph_manager) == (False, manager)


def test_off_cuda_is_a_gap(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
    assert ddtree_config.mrv2_gaps(mrv2_vllm_config()) == ["ddtree off CUDA GPUs"]


def test_start_up_line_says_which_runner_and_why(on_cuda, monkeypatch):
    assert "Model Runner V2" in ddtree_config.describe_runner(mrv2_vllm_config(), on_mrv2=True)
    hybrid = mrv2_vllm_config(model_config__is_hybrid=True)
    assert "hybrid" in ddtree_config.describe_runner(hybrid, on_mrv2=False)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in ddtree_config.describe_runner(mrv2_vllm_config(), on_mrv2=False)


@pytest.mark.parametrize("on_mrv2", [True, False])
def test_without_a_budget_model_runner_v2_gets_the_cost_aware_budget(on_mrv2):
    """No budget from the user: on Model Runner V2 the cost-aware budget over DEFAULT_TREE_BUDGETS, the chain fallback
    among them (every verify width in vLLM's schedule, ddtree's scheduler named); on the V1 runner the fixed
    default, no schedule (which would cost full graphs and async scheduling there)."""
    config = mrv2_vllm_config(speculative_config__tree_budget_is_default=True, speculative_config__tree_depth=15)
    config.use_v2_model_runner = on_mrv2
    ddtree_config.settle_budget_policy(config)
    spec = config.speculative_config
    assert spec.num_speculative_tokens == ddtree_config.DEFAULT_TREE_BUDGET == 64
    if on_mrv2:
        assert spec.tree_budgets == ["chain", 16, 32, 64]
        assert spec.num_speculative_tokens_per_batch_size == [[1, 1, 64], [2, 2, 32], [3, 3, 16], [4, 4, 15]]
        assert config.scheduler_config.scheduler_cls == "vllm_ddtree.scheduler.make_scheduler"
        line = ddtree_config.describe_runner(config, on_mrv2=True)
        assert ("cost-aware node budget among [16, 32, 64] or the DFlash chain (15 drafts) (ddtree's default; "
                "num_speculative_tokens fixes it)") in line
    else:
        assert spec.tree_budgets is None and spec.num_speculative_tokens_per_batch_size is None
        assert config.scheduler_config.scheduler_cls is None
        assert "node budget 64 (ddtree's default" in ddtree_config.describe_runner(config, on_mrv2=False)


def test_model_runner_v2_without_async_scheduling_keeps_one_budget():
    """Synchronously, Model Runner V2 schedules every request all B drafts of the step before: the default keeps
    B=64 there, and the user's tree_budgets is refused at start-up with the fix named."""
    config = mrv2_vllm_config(speculative_config__tree_budget_is_default=True, speculative_config__tree_depth=15,
                              scheduler_config__async_scheduling=False)
    config.use_v2_model_runner = True
    ddtree_config.settle_budget_policy(config)
    spec = config.speculative_config
    assert (spec.tree_budgets, spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size) == (
        None, 64, None)
    assert "node budget 64 (ddtree's default" in ddtree_config.describe_runner(config, on_mrv2=True)
    config = mrv2_vllm_config(speculative_config__tree_budgets=["chain", 16], scheduler_config__async_scheduling=False,
                              speculative_config__num_speculative_tokens_per_batch_size=[[1, 1, 16], [2, 2, 15]])
    config.use_v2_model_runner = True
    with pytest.raises(ddtree_config.DDTreeConfigError, match="--no-async-scheduling"):
        ddtree_config.settle_budget_policy(config)
    config.scheduler_config.async_scheduling = True
    ddtree_config.settle_budget_policy(config)
    assert config.scheduler_config.scheduler_cls == "vllm_ddtree.scheduler.make_scheduler"


def test_the_default_leaves_a_chain_steps_width_to_the_chain():
    """A drafter whose chain is 16 drafts deep (block size 17): a default tree budget of 16 would verify the same
    width as a chain step, which the user's tree_budgets refuses; the default drops that budget instead."""
    config = mrv2_vllm_config(speculative_config__tree_budget_is_default=True, speculative_config__tree_depth=16)
    config.use_v2_model_runner = True
    ddtree_config.settle_budget_policy(config)
    spec = config.speculative_config
    assert spec.tree_budgets == ["chain", 32, 64]
    assert spec.num_speculative_tokens_per_batch_size == [[1, 1, 64], [2, 2, 32], [3, 3, 16]]


def test_a_budget_or_scheduler_the_user_gave_is_kept_on_model_runner_v2():
    config = mrv2_vllm_config(speculative_config__tree_budget=16, speculative_config__num_speculative_tokens=16)
    config.use_v2_model_runner = True
    ddtree_config.settle_budget_policy(config)
    spec = config.speculative_config
    assert (spec.tree_budgets, spec.num_speculative_tokens, spec.num_speculative_tokens_per_batch_size) == (
        None, 16, None)
    assert config.scheduler_config.scheduler_cls is None
    assert ddtree_config.describe_runner(config, on_mrv2=True).endswith("; node budget 16")
    own = "my.Scheduler"  # the cost-aware default needs ddtree's scheduler: keep the user's and B=64
    config = mrv2_vllm_config(speculative_config__tree_budget_is_default=True, scheduler_config__scheduler_cls=own)
    config.use_v2_model_runner = True
    ddtree_config.settle_budget_policy(config)
    assert config.speculative_config.tree_budgets is None and config.scheduler_config.scheduler_cls == own


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
    for path in ("vllm/v1/worker/gpu/spec_decode/__init__.py", "vllm/v1/worker/gpu/model_runner.py",
                 "vllm/v1/worker/gpu/async_utils.py"):
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


# ----------------------------------------------------------------------------- a fake MRV2 verify step (§3)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_ddtree.kv_compact import kv_compact_torch  # noqa: E402
from vllm_ddtree.tree.build import build_chain, build_tree  # noqa: E402
from vllm_ddtree.tree.layout import TreeBatch  # noqa: E402
from vllm_ddtree.tree_handover import TreeHandover  # noqa: E402
from vllm_ddtree.verify_core import TreeVerifyCore  # noqa: E402
from vllm_ddtree.verify_rows import TREE_FIELDS  # noqa: E402

MAX_REQS, BUDGET, DEPTH, VOCAB = 8, 6, 3, 32
MAX_TOKENS, KV_BLOCK, MAX_BLOCKS = 64, 4, 16
PREFILL_LEN = 30
EPOCH = 5  # the latest draft step's

# Batch order (MRV2 sorts decodes first): (request slot, kind, scheduled drafts, num_computed s)
REQUESTS = [
    (5, "tree", BUDGET, 20),  # fresh tree, all B drafts
    (2, "tree", 3, 11),  # fresh tree, drafts truncated by the scheduler (a prefix of the node list)
    (0, "stale", BUDGET, 7),  # fed placeholder drafts (new/resumed request) while its slot holds an older tree
    (3, "nodraft", 0, 9),  # a decode without drafts
    (6, "prefill", 0, 0),  # a chunk of a longer prompt: samples nothing
]
PREFILL_CHUNK = 4
# A chain step (the chain fallback): the widest request is fed DEPTH drafts; the stale one too.
CHAIN_REQUESTS = [(5, "tree", DEPTH, 20), (2, "tree", 2, 11), (0, "stale", DEPTH, 7), (3, "nodraft", 0, 9),
                  (6, "prefill", 0, 0)]


def _tree_children(trees: TreeBatch, row: int, limit: int) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for i in range(1, limit + 1):
        children.setdefault(int(trees.parents[row, i]), []).append(i)
    return children


def _two_track_draft_logits(gen: torch.Generator) -> torch.Tensor:
    """Draft logits with two strong tokens per depth: the tree branches in two at every level (deep and bushy)."""
    logits = torch.randn(1, DEPTH, VOCAB, generator=gen)
    top = torch.randperm(VOCAB, generator=gen)[: 2 * DEPTH].view(DEPTH, 2)
    for d in range(DEPTH):
        logits[0, d, top[d, 0]] += 6.0
        logits[0, d, top[d, 1]] += 5.9
    return logits


def _subtree_height(children: dict[int, list[int]], node: int) -> int:
    return 1 + max((_subtree_height(children, c) for c in children.get(node, [])), default=0)


class StubSampler:
    """MRV2's Sampler as the tree sampler uses it (the real one needs pinned memory and a GPU): argmax per row."""

    compute_nans = False
    logprobs_mode = "raw_logprobs"

    def __init__(self, prefill_len: torch.Tensor, num_logprobs: int = -1):
        self.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=prefill_len))
        self.sampling_states = SimpleNamespace(max_num_logprobs=lambda idx_mapping_np: num_logprobs)
        self.positions_seen: list[torch.Tensor] = []

    def sample(self, logits, expanded_idx_mapping, idx_mapping_np, pos, input_ids, expanded_local_pos,
               return_logprobs=False):
        self.positions_seen.append(pos.clone())
        return logits.argmax(dim=-1), logits


class FakeStep:
    """Request state, filed trees and an InputBatch made by MRV2's own input kernels, as the runner makes them;
    ``speculator`` stands in for DDTreeSpeculator (its core and what the adapter methods read)."""

    def __init__(self, seed: int = 0, requests=REQUESTS, choices=None, runner_verifies_chains=False):
        from vllm.v1.worker.gpu.input_batch import (
            InputBuffers,
            combine_sampled_and_draft_tokens,
            expand_idx_mapping,
            prepare_pos_seq_lens,
        )

        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.requests = requests
        self.handover = TreeHandover(MAX_REQS, BUDGET, torch.device("cpu"), DEPTH)
        # Every slot's DFlash chain, filed beside its tree (own draws: the other data stay as they were).
        self.handover.chains.copy_(torch.randint(1, VOCAB, (MAX_REQS, DEPTH),
                                                 generator=torch.Generator().manual_seed(1000 + seed)))
        self.handover.epoch.fill_(EPOCH)
        self.req_trees = self.handover.trees
        self.core = TreeVerifyCore(self.handover, DEPTH, MAX_REQS, MAX_TOKENS, torch.device("cpu"), cuda_graphs=False,
                                   choices=choices, runner_verifies_chains=runner_verifies_chains)
        self.speculator = SimpleNamespace(core=self.core, block_tables=None, bind_kv_caches=None)
        self.last_sampled = torch.randint(1, VOCAB, (MAX_REQS,), generator=gen)
        self.num_computed = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.prefill_len = torch.zeros(MAX_REQS, dtype=torch.int32)
        self.draft_tokens = torch.zeros(MAX_REQS, BUDGET, dtype=torch.int64)
        for slot, kind, _, s in self.requests:
            self.num_computed[slot] = s
            self.prefill_len[slot] = PREFILL_LEN if kind == "prefill" else 1
            if kind in ("tree", "stale"):
                built = TreeBatch.allocate(1, BUDGET, "cpu")
                build_tree(_two_track_draft_logits(gen), BUDGET, built, self.last_sampled[slot : slot + 1])
                for name in (*TREE_FIELDS, "num_nodes"):
                    getattr(self.req_trees, name)[slot] = getattr(built, name)[0]
                self.handover.stamp[slot] = EPOCH if kind == "tree" else EPOCH - 2
                if kind == "tree":
                    self.draft_tokens[slot] = built.token_ids[0, 1:]

        num_reqs = len(self.requests)
        idx_mapping_np = np.array([r[0] for r in self.requests], dtype=np.int32)
        nd_np = np.array([r[2] for r in self.requests], dtype=np.int32)
        scheduled = np.array([PREFILL_CHUNK if r[1] == "prefill" else r[2] + 1 for r in self.requests],
                             dtype=np.int32)
        cu_np = np.concatenate([[0], np.cumsum(nd_np + 1)]).astype(np.int32)
        qsl_np = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
        num_tokens = int(qsl_np[-1])
        total_logits = int(cu_np[-1])
        idx_mapping = torch.from_numpy(idx_mapping_np)
        cu = torch.from_numpy(cu_np)
        buffers = InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))
        buffers.query_start_loc[: num_reqs + 1] = torch.from_numpy(qsl_np)
        buffers.query_start_loc[num_reqs + 1 :] = num_tokens
        expanded_idx_mapping, expanded_local_pos = expand_idx_mapping(idx_mapping, total_logits, cu, 1 + BUDGET)
        prepare_pos_seq_lens(idx_mapping, buffers.query_start_loc[: num_reqs + 1], self.num_computed,
                             buffers.positions, buffers.seq_lens)
        logits_indices = combine_sampled_and_draft_tokens(
            buffers.input_ids, idx_mapping, self.last_sampled, buffers.query_start_loc[: num_reqs + 1],
            buffers.seq_lens[:num_reqs], self.prefill_len, self.draft_tokens, cu, total_logits,
        )
        self.buffers = buffers
        self.batch = SimpleNamespace(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            idx_mapping=idx_mapping,
            idx_mapping_np=idx_mapping_np,
            expanded_idx_mapping=expanded_idx_mapping,
            expanded_local_pos=expanded_local_pos,
            num_draft_tokens=int(nd_np.sum()),
            num_draft_tokens_per_req=nd_np,
            num_scheduled_tokens=scheduled,
            query_start_loc=buffers.query_start_loc[: num_reqs + 1],
            query_start_loc_np=qsl_np,
            seq_lens=buffers.seq_lens[:num_reqs],
            input_ids=buffers.input_ids[:num_tokens],
            positions=buffers.positions[:num_tokens],
            logits_indices=logits_indices,
            cu_num_logits=cu,
            cu_num_logits_np=cu_np,
        )
        self.linear_positions = self.batch.positions.clone()
        self.filed = {name: getattr(self.req_trees, name).clone() for name in (*TREE_FIELDS, "num_nodes")}

    def prepare(self):
        from vllm_ddtree.mrv2.speculator import DDTreeSpeculator

        DDTreeSpeculator.prepare_verify(self.speculator, self.batch)  # the adapter, with a stand-in self
        return self.core.step

    def root_row(self, r: int) -> int:
        return int(self.batch.query_start_loc_np[r + 1]) - (self.requests[r][2] + 1)

    def target_logits(self) -> tuple[torch.Tensor, dict[int, list[int]], dict[int, int]]:
        """Logits whose argmax walks each fresh tree down its last-numbered children; returns (logits, accepted
        node ids per batch row, bonus per batch row)."""
        logits = torch.randn(int(self.batch.cu_num_logits_np[-1]), VOCAB, generator=self.gen) * 0.1
        paths, bonus = {}, {}
        for r, (slot, kind, nd, _) in enumerate(self.requests):
            start = int(self.batch.cu_num_logits_np[r])
            if kind != "tree":
                bonus[r] = int(logits[start].argmax())
                paths[r] = [0]
                continue
            children = _tree_children(self.req_trees, slot, nd)
            path, node = [0], 0
            while children.get(node):  # the deepest subtree, latest-numbered first: acc[k] != k
                child = max(children[node], key=lambda c: (_subtree_height(children, c), c))
                logits[start + node, int(self.req_trees.token_ids[slot, child])] = 10.0
                path.append(child)
                node = child
            taken = {int(self.req_trees.token_ids[slot, c]) for c in children.get(node, [])}
            token = next(t for t in range(VOCAB) if t not in taken)
            logits[start + node, token] = 10.0
            paths[r], bonus[r] = path, token
        return logits, paths, bonus


def test_prepare_verify_writes_depth_positions_for_fresh_trees_only():
    step = FakeStep()
    verify = step.prepare()
    batch, core = step.batch, step.core
    assert verify is not None and verify.num_reqs == batch.num_reqs and core.attention.step is verify
    assert core.tree_rows[: batch.num_reqs].tolist() == [0, 1, -1, -1, -1]
    assert core.verify_trees.num_nodes[: batch.num_reqs].tolist() == [BUDGET, 3, 0, 0, 0]
    for name in TREE_FIELDS:
        assert torch.equal(getattr(core.verify_trees, name)[: batch.num_reqs],
                           step.filed[name][batch.idx_mapping.long()])
    expected = step.linear_positions.clone()
    for r, (slot, kind, nd, s) in enumerate(REQUESTS):
        if kind == "tree":
            root = step.root_row(r)
            for i in range(nd + 1):
                expected[root + i] = s + int(step.req_trees.depths[slot, i])
    assert torch.equal(batch.positions, expected)
    assert not torch.equal(expected, step.linear_positions)  # the test batch has real trees
    # Each tree serves one verify step: the requests fed drafts consumed theirs.
    assert [int(step.handover.stamp[slot]) for slot, *_ in REQUESTS] == [-1, -1, -1, -1, -1]


def test_a_tree_is_verified_once_even_if_fed_its_tokens_again():
    """vLLM may skip a draft step and feed the same drafts again: the tree was consumed by its verify step."""
    step = FakeStep()
    step.prepare()
    step.batch.positions.copy_(step.linear_positions)
    step.prepare()
    assert step.core.tree_rows[:2].tolist() == [-1, -1]
    assert torch.equal(step.batch.positions, step.linear_positions)


def test_prepare_verify_guard_refuses_a_tree_whose_fed_tokens_differ():
    step = FakeStep()
    root = step.root_row(0)
    step.batch.input_ids[root + 2] = (step.batch.input_ids[root + 2] + 1) % VOCAB  # one draft not from the tree
    verify = step.prepare()
    assert step.core.tree_rows[:2].tolist() == [-1, 1]
    assert verify.prepared.refused_fresh.tolist() == [True, False, False, False, False]
    assert torch.equal(step.batch.positions[: step.root_row(1)], step.linear_positions[: step.root_row(1)])


def test_check_trees_raises_on_fed_drafts_that_are_not_the_fresh_tree(monkeypatch):
    step = FakeStep()
    step.core.check_trees = True
    step.batch.input_ids[step.root_row(1) + 1] += 1
    with pytest.raises(RuntimeError, match="fresh tree"):
        step.prepare()


@pytest.mark.parametrize("seed, tamper", [(0, None), (1, None), (2, "draft"), (3, "short"), (4, "mrope")])
def test_prepare_rows_kernel_equals_its_torch_reference(seed, tamper):
    """The one-launch Triton prepare (TRITON_INTERPRET here) against the plain-PyTorch reference, on every output:
    the trees in batch order, num_nodes, tree_rows (rows past the batch too), depth positions (M-RoPE's three rows
    too), the stamps it consumed and the row layout."""
    from vllm_ddtree.verify_rows import RowBuffers, RowInputs, prepare_rows_torch, prepare_rows_triton

    steps = [FakeStep(seed), FakeStep(seed)]
    outputs, mropes = [], []
    for step, prepare in zip(steps, (prepare_rows_triton, prepare_rows_torch)):
        if tamper == "draft":  # the fresh truncated tree's last fed draft is not the tree's: the guard refuses it
            row = step.root_row(1) + REQUESTS[1][2]
            step.batch.input_ids[row] = (step.batch.input_ids[row] + 1) % VOCAB
        if tamper == "short":  # the first tree has fewer nodes than were fed: refused too
            step.req_trees.num_nodes[REQUESTS[0][0]] = REQUESTS[0][2] - 1
        mrope = step.batch.positions.repeat(3, 1) + torch.tensor([[0], [100], [200]]) if tamper == "mrope" else None
        mropes.append(mrope)
        core, batch = step.core, step.batch
        core.tree_rows.fill_(3)  # stale values from an earlier, larger batch
        rows = RowInputs(batch.idx_mapping, batch.cu_num_logits, batch.logits_indices, batch.input_ids,
                         batch.positions, mrope, batch.num_reqs, batch.num_tokens)
        outputs.append(prepare(rows, step.req_trees, step.handover.stamp, step.handover.epoch, core.verify_trees,
                               core.tree_rows, RowBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))))
    (kernel, reference), (kernel_step, reference_step) = outputs, steps
    expected = [tamper != "short", tamper != "draft", False, False, False]
    assert kernel.has_tree.tolist() == expected == reference.has_tree.tolist()
    assert kernel.refused_fresh.tolist() == reference.refused_fresh.tolist()
    for name in ("shift", "row_request", "row_node", "root_rows", "row_starts"):
        assert torch.equal(getattr(kernel, name), getattr(reference, name)), name
    assert torch.equal(kernel_step.batch.positions, reference_step.batch.positions)
    assert torch.equal(kernel_step.core.tree_rows, reference_step.core.tree_rows)
    assert torch.equal(kernel_step.handover.stamp, reference_step.handover.stamp)
    assert kernel_step.core.tree_rows[len(REQUESTS):].eq(-1).all()
    if tamper == "mrope":
        assert torch.equal(mropes[0], mropes[1])
        assert torch.equal(mropes[0] - torch.tensor([[0], [100], [200]]), kernel_step.batch.positions.repeat(3, 1))
    num_reqs = len(REQUESTS)
    for name in (*TREE_FIELDS, "num_nodes"):
        assert torch.equal(getattr(kernel_step.core.verify_trees, name)[:num_reqs],
                           getattr(reference_step.core.verify_trees, name)[:num_reqs]), name


@pytest.mark.parametrize("seed", [0, 1])
def test_chain_step_verifies_the_chains_on_causal_rows_in_kernel_and_reference(seed):
    """A chain step (the widest request fed ``depth`` drafts, the chain fallback on): the core says so, and the
    Triton prepare and its reference both swap each fresh request's fed drafts for its chain, lay the chain out as
    the verify tree (parent i - 1, depth i, ancestors 0..i), keep linear positions and leave every row causal."""
    from vllm_ddtree.verify_rows import RowBuffers, RowInputs, prepare_rows_torch, prepare_rows_triton

    assert FakeStep(seed).prepare().chain is False
    assert FakeStep(seed, CHAIN_REQUESTS).prepare().chain is True
    steps = [FakeStep(seed, CHAIN_REQUESTS), FakeStep(seed, CHAIN_REQUESTS)]
    fed_before = steps[0].batch.input_ids.clone()
    outputs = []
    for step, prepare in zip(steps, (prepare_rows_triton, prepare_rows_torch)):
        core, batch = step.core, step.batch
        core.tree_rows.fill_(3)
        rows = RowInputs(batch.idx_mapping, batch.cu_num_logits, batch.logits_indices, batch.input_ids,
                         batch.positions, None, batch.num_reqs, batch.num_tokens)
        outputs.append(prepare(rows, step.req_trees, step.handover.stamp, step.handover.epoch, core.verify_trees,
                               core.tree_rows, RowBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu")),
                               step.handover.chains, True))
    (kernel, reference), (kernel_step, reference_step) = outputs, steps
    assert kernel.has_tree.tolist() == reference.has_tree.tolist() == [True, True, False, False, False]
    for name in ("shift", "row_request", "row_node", "root_rows", "row_starts"):
        assert torch.equal(getattr(kernel, name), getattr(reference, name)), name
    assert not kernel.shift.any()
    num_reqs = len(CHAIN_REQUESTS)
    for name in (*TREE_FIELDS, "num_nodes"):
        assert torch.equal(getattr(kernel_step.core.verify_trees, name)[:num_reqs],
                           getattr(reference_step.core.verify_trees, name)[:num_reqs]), name
    for step in steps:
        assert step.core.tree_rows.eq(-1).all()
        assert torch.equal(step.batch.positions, step.linear_positions)
    assert torch.equal(kernel_step.batch.input_ids, reference_step.batch.input_ids)
    trees, chains, expected_ids = kernel_step.core.verify_trees, kernel_step.handover.chains, fed_before.clone()
    for r, (slot, kind, nd, _) in enumerate(CHAIN_REQUESTS):
        if kind != "tree":
            continue
        root = kernel_step.root_row(r)
        expected_ids[root + 1 : root + 1 + nd] = chains[slot, :nd].to(expected_ids.dtype)
        assert int(trees.num_nodes[r]) == nd
        assert trees.token_ids[r, : nd + 1].tolist() == [int(fed_before[root]), *chains[slot, :nd].tolist()]
        assert trees.parents[r].tolist() == [-1, *range(nd)] + [-1] * (BUDGET - nd)
        assert trees.depths[r].tolist() == [*range(nd + 1)] + [-1] * (BUDGET - nd)
        assert trees.ancestor_bits[r, :, 0].tolist() == [2 ** (i + 1) - 1 for i in range(nd + 1)] + [0] * (BUDGET - nd)
    assert torch.equal(kernel_step.batch.input_ids, expected_ids)  # the stale request's placeholders stay
    assert not torch.equal(expected_ids, fed_before)


def test_chain_ancestor_bits_fill_whole_words_in_kernel_and_reference():
    """Chains past 32 nodes: bit 31 (a negative int32) and full words, as ``ancestor_bits_from_parents`` has them."""
    from vllm_ddtree.tree.build import ancestor_bits_from_parents, fill_chains
    from vllm_ddtree.verify_rows import RowBuffers, RowInputs, prepare_rows_triton

    depth, budget, slot = 40, 48, 1
    handover = TreeHandover(2, budget, torch.device("cpu"), depth)
    handover.chains[slot] = torch.arange(1, depth + 1)
    handover.trees.num_nodes[slot] = budget
    handover.trees.token_ids[slot] = torch.arange(100, 101 + budget)  # the tree the runner fed
    handover.stamp[slot] = handover.epoch
    input_ids = torch.arange(100, 101 + depth, dtype=torch.int32)
    positions = torch.arange(7, 8 + depth)
    rows = RowInputs(torch.tensor([slot]), torch.tensor([0, depth + 1], dtype=torch.int32),
                     torch.arange(depth + 1, dtype=torch.int32), input_ids, positions, None, 1, depth + 1)
    verify = TreeBatch.allocate(2, budget, "cpu")
    prepare_rows_triton(rows, handover.trees, handover.stamp, handover.epoch, verify,
                        torch.zeros(2, dtype=torch.int32), RowBuffers(2, 64, torch.device("cpu")), handover.chains,
                        True)
    parents = torch.tensor([[-1, *range(depth)] + [-1] * (budget - depth)])
    want = ancestor_bits_from_parents(parents, depth)
    want[:, depth + 1 :] = 0
    assert torch.equal(verify.ancestor_bits[:1], want)  # batch row 0
    assert input_ids[1:].tolist() == list(range(1, depth + 1))
    reference = TreeBatch.allocate(1, budget, "cpu")
    fill_chains(handover.chains[slot : slot + 1], torch.tensor([depth]), reference)
    assert torch.equal(reference.ancestor_bits, want)


def test_prepare_verify_skips_steps_without_drafts():
    step = FakeStep()
    step.batch.num_draft_tokens = 0
    assert step.prepare() is None
    assert step.core.take_step() is None
    assert torch.equal(step.batch.positions, step.linear_positions)


def _kv_fixture(step: FakeStep):
    """One fake target cache with a distinct value per slot, a per-request-slot block table, and MRV2's
    batch-ordered gather of it."""
    cache = torch.arange(MAX_REQS * MAX_BLOCKS * KV_BLOCK * 2, dtype=torch.float32).view(-1, KV_BLOCK, 1, 2)
    by_slot = torch.randperm(MAX_REQS * MAX_BLOCKS, generator=step.gen).view(MAX_REQS, MAX_BLOCKS).to(torch.int32)
    batch_table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32)
    batch_table[: step.batch.num_reqs] = by_slot[step.batch.idx_mapping.long()]
    views = [cache]

    class Compaction:
        group = 0

        def __call__(self, block_table, ctx_lens, accepted):
            kv_compact_torch(views, block_table, ctx_lens, accepted)

    step.core.compaction = Compaction()
    step.speculator.block_tables = SimpleNamespace(input_block_tables=[batch_table])
    return cache, by_slot


def _run_sampler(step: FakeStep, num_logprobs: int = -1):
    from vllm_ddtree.mrv2.sampler import MRV2TreeSampler

    sampler = StubSampler(step.prefill_len, num_logprobs)
    tree_sampler = MRV2TreeSampler(step.speculator, sampler, fallback=None)
    logits, paths, bonus = step.target_logits()
    step.prepare()
    depth_positions = step.batch.positions.clone()
    out = tree_sampler(logits, step.batch)
    return out, paths, bonus, sampler, depth_positions, logits


def test_tree_sampler_output_contract_and_post_update():
    from vllm.v1.worker.gpu.input_batch import post_update

    step = FakeStep()
    cache, by_slot = _kv_fixture(step)
    before = cache.clone()
    out, paths, bonus, sampler, depth_positions, _ = _run_sampler(step)
    assert step.core.attention.step is None  # the forward is over: attention is causal again
    batch = step.batch
    # The runner's Sampler drew each node at its depth position (that keys the Gumbel noise).
    assert torch.equal(sampler.positions_seen[0], depth_positions[batch.logits_indices])
    assert out.sampled_token_ids.dtype == torch.int64 and out.sampled_token_ids.shape[0] == batch.num_reqs
    assert out.sampled_token_ids.shape[1] == 1 + DEPTH
    want_sampled, want_rejected = [], []
    for r, (slot, kind, nd, _s) in enumerate(REQUESTS):
        m = len(paths[r]) - 1
        tokens = [int(step.req_trees.token_ids[slot, node]) for node in paths[r][1:]] + [bonus[r]]
        if kind == "prefill":
            want_sampled.append(0)
            want_rejected.append(0)
            continue
        assert out.sampled_token_ids[r, : m + 1].tolist() == tokens
        want_sampled.append(m + 1)
        want_rejected.append(nd - m)
    assert out.num_sampled.tolist() == want_sampled
    assert out.num_rejected.tolist() == want_rejected
    assert max(len(p) for p in paths.values()) > 2, "the fixture should accept a path of depth >= 2"
    assert any(node != k for p in paths.values() for k, node in enumerate(p)), "and one that is not a prefix"
    assert out.sampled_token_ids.data_ptr() != step.core.walk_out.output_token_ids.data_ptr()

    # post_update (MRV2's device bookkeeping) then gives num_computed = s + 1 + m and last_sampled = the bonus.
    num_computed = step.num_computed.clone()
    last_sampled = step.last_sampled.clone()
    post_update(batch.idx_mapping, num_computed, last_sampled, None, out.sampled_token_ids, out.num_sampled,
                out.num_rejected, batch.query_start_loc, torch.zeros(MAX_REQS, 256, dtype=torch.int64),
                torch.zeros(MAX_REQS, dtype=torch.int32))
    for r, (slot, kind, _nd, s) in enumerate(REQUESTS):
        if kind == "prefill":
            assert int(num_computed[slot]) == s + PREFILL_CHUNK
            continue
        assert int(num_computed[slot]) == s + len(paths[r])
        assert int(last_sampled[slot]) == bonus[r]

    # KV compaction: the accepted nodes' K/V moved from s + node to s + depth, in each request's own blocks.
    expected = before.clone()
    for r, (slot, _kind, _nd, s) in enumerate(REQUESTS):
        for k, node in enumerate(paths[r]):
            src, dst = s + node, s + k
            sb, db = by_slot[slot, src // KV_BLOCK], by_slot[slot, dst // KV_BLOCK]
            expected[db, dst % KV_BLOCK] = before[sb, src % KV_BLOCK]
    assert torch.equal(cache, expected)
    assert not torch.equal(cache, before)


def test_tree_sampler_hands_each_budget_choices_acceptance_to_the_scheduler():
    """Under budget choices the walk fills what each would have accepted (acceptance_by_choice.py), batch order, the
    chains gathered by request slot; the sampler attaches a copy to its SamplerOutput (patch 0004 carries it on)."""
    from vllm_ddtree.mrv2.sampler import MRV2TreeSampler

    choices = [2, DEPTH, 5, BUDGET]  # DEPTH = 3: the chain
    step = FakeStep(choices=choices)
    _kv_fixture(step)
    logits, paths, bonus = step.target_logits()
    emitted = {r: [int(step.req_trees.token_ids[slot, n]) for n in paths[r][1:]] + [bonus[r]]
               for r, (slot, *_rest) in enumerate(REQUESTS)}
    step.handover.chains[5] = torch.tensor((emitted[0] + [0] * DEPTH)[:DEPTH])  # batch row 0 follows its chain
    step.handover.chains[2, 0] = (emitted[1][0] + 1) % VOCAB  # row 1's chain misses at once
    step.core.by_choice.out.fill_(99)
    step.prepare()
    out = MRV2TreeSampler(step.speculator, StubSampler(step.prefill_len), fallback=None)(logits, step.batch)
    got = out.ddtree_acceptance
    assert got.data_ptr() != step.core.by_choice.out.data_ptr()  # a copy: the next step's walk reuses the buffer
    want = []
    for r, (_slot, kind, nd, _s) in enumerate(REQUESTS):
        if kind != "tree":  # verified nothing
            want.append([-1] * len(choices))
            continue
        row = [sum(1 <= node <= b for node in paths[r][1:]) if b <= nd else -1 for b in sorted(choices)]
        row[sorted(choices).index(DEPTH)] = min(len(emitted[0]), DEPTH) if r == 0 else 0
        want.append(row)
    assert got.tolist() == want
    assert len(paths[0]) > 2 and want[0][0] < len(paths[0]) - 1, "budget 2 should accept less than the tree"
    assert step.core.by_choice.out[len(REQUESTS):].eq(99).all()

    plain = FakeStep()  # a fixed budget: nothing computed, nothing attached
    _kv_fixture(plain)
    assert plain.core.by_choice is None
    assert _run_sampler(plain)[0].ddtree_acceptance is None


def test_patched_async_output_carries_the_acceptance_to_model_runner_output(monkeypatch):
    """Patch 0004's AsyncOutput hook (MRV2's output path, synchronous or not), run from the patched text with CUDA's
    streams and events stubbed: the acceptance reaches ModelRunnerOutput, survives pickling (TP workers send outputs
    through vLLM's message queue), and outputs without it stay as they were."""
    import contextlib
    import pickle

    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.sample.output import SamplerOutput

    path = "vllm/v1/worker/gpu/async_utils.py"
    namespace = {"__name__": "patched_async_utils"}
    exec(compile(_patched_mrv2_sources()[path], path, "exec"), namespace)
    namespace["stream"] = lambda to_stream, from_stream: contextlib.nullcontext()

    class Event:
        def __init__(self, **kwargs):
            pass

        record = synchronize = lambda self, *args: None

    monkeypatch.setattr(torch.cuda, "Event", Event)
    copy_stream = SimpleNamespace(wait_stream=lambda other: None)

    def output(acceptance):
        sampler_output = SamplerOutput(sampled_token_ids=torch.tensor([[5, -1], [6, 7]]), logprobs_tensors=None,
                                       num_nans=None, num_sampled=torch.tensor([1, 2]))
        if acceptance is not None:
            sampler_output.ddtree_acceptance = acceptance
        runner_output = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                                          sampled_token_ids=None, prompt_logprobs_dict={})
        return namespace["AsyncOutput"](runner_output, sampler_output, torch.tensor([1, 2]), None,
                                        copy_stream).get_output()

    acceptance = torch.tensor([[0, 1, -1], [2, 2, 3]], dtype=torch.int32)
    got = pickle.loads(pickle.dumps(output(acceptance)))
    assert got.sampled_token_ids == [[5], [6, 7]]
    assert isinstance(got.ddtree_acceptance, np.ndarray) and got.ddtree_acceptance.tolist() == acceptance.tolist()
    assert not hasattr(output(None), "ddtree_acceptance")


def test_patch_0002_hands_the_acceptance_over_on_the_synchronous_output_path():
    """Patch 0002's V1 hook sits in sample_tokens' synchronous branch, before it returns the output it sets."""
    import importlib.util
    import sys
    from pathlib import Path

    ap = sys.modules.get("apply_patches")
    if ap is None:
        tool = Path(__file__).resolve().parents[2] / "tools" / "apply_patches.py"
        spec = importlib.util.spec_from_file_location("apply_patches", tool)
        ap = importlib.util.module_from_spec(spec)
        sys.modules["apply_patches"] = ap
        spec.loader.exec_module(ap)
    from test_apply_patches import pristine_target

    ps = ap.load_patch_set()
    path = "vllm/v1/worker/gpu_model_runner.py"
    text = ap.patched_text(ps, path, pristine_target(ps, ap.find_vllm_root(None), path))
    sample = _function_source(text, "sample_tokens")
    branch = sample.index("if not self.use_async_scheduling:\n            # vllm-ddtree")
    hook = sample.index('getattr(sampler_output, "ddtree_acceptance", None)')
    assert sample.index("output = ModelRunnerOutput(") < branch < hook < sample.index("return output", branch)
    assert "output.ddtree_acceptance = ddtree_acceptance.cpu().numpy()" in sample[hook:]


def test_tree_sampler_falls_back_to_vllms_rejection_sampler_without_a_tree_step():
    from vllm_ddtree.mrv2.sampler import MRV2TreeSampler

    step = FakeStep()
    calls = []
    tree_sampler = MRV2TreeSampler(step.speculator, sampler=None,
                                   fallback=lambda *args: calls.append(args) or "chain")
    assert tree_sampler("logits", "batch", None) == "chain" and len(calls) == 1


def test_a_chain_step_goes_to_vllms_rejection_sampler_on_the_swapped_rows():
    """Model Runner V2's speculator has the runner verify chain steps (``runner_verifies_chains``): its rejection
    sampler reads each request's drafts from the fed rows, which ``prepare`` swapped for the chains, as vLLM's DFlash
    chain engine would feed them. No walk and no acceptance by choice run; the drafter takes the step as a chain
    (nothing to linearise). Tree steps still walk; without the flag (V1, synthetic acceptance) chain steps walk."""
    from vllm_ddtree.mrv2.sampler import MRV2TreeSampler

    choices = [DEPTH, BUDGET]
    step = FakeStep(0, CHAIN_REQUESTS, choices=choices, runner_verifies_chains=True)
    step.core.by_choice.out.fill_(99)
    verify = step.prepare()
    assert verify.chain
    seen = []
    wide = torch.arange(len(CHAIN_REQUESTS) * (BUDGET + 1)).view(len(CHAIN_REQUESTS), BUDGET + 1)

    def fallback(logits, batch, draft_logits):
        seen.append(batch.input_ids[batch.logits_indices].clone())
        return SimpleNamespace(sampled_token_ids=wide, num_sampled="vllm's")  # vLLM's: B + 1 columns

    tree_sampler = MRV2TreeSampler(step.speculator, StubSampler(step.prefill_len), fallback=fallback)
    out = tree_sampler(torch.zeros(1, VOCAB), step.batch, None)
    assert out.num_sampled == "vllm's" and len(seen) == 1
    # Cut to a tree step's depth + 1 columns, contiguous: MRV2's post-update kernel runs one compiled variant.
    assert torch.equal(out.sampled_token_ids, wide[:, : DEPTH + 1]) and out.sampled_token_ids.is_contiguous()
    drafts = seen[0]
    for r, (slot, kind, nd, _) in enumerate(CHAIN_REQUESTS):
        if kind == "tree":  # the fed rows after the root: the chain, which vLLM's sampler then verifies
            start = int(step.batch.cu_num_logits_np[r])
            assert drafts[start + 1 : start + 1 + nd].tolist() == step.handover.chains[slot, :nd].tolist()
    assert step.core.attention.step is None and not verify.walked
    assert step.core.by_choice.out.eq(99).all()  # no acceptance by choice: the scheduler takes the chain's counts
    assert step.core.take_step() is verify and step.core.linearise(verify) is None

    walked = FakeStep(0, CHAIN_REQUESTS)  # V1 / synthetic acceptance: the walk verifies the chain
    _kv_fixture(walked)
    walked.prepare()
    out = MRV2TreeSampler(walked.speculator, StubSampler(walked.prefill_len), fallback=None)(
        walked.target_logits()[0], walked.batch)
    assert walked.core.take_step().walked and out.num_sampled.shape[0] == len(CHAIN_REQUESTS)


def test_the_first_tree_step_also_compiles_vllms_rejection_sampler():
    """vLLM's warm-up decode step is a tree step (B drafts per request): where chain steps go to vLLM's rejection
    sampler, the first tree step also runs it once, after the walk (it edits the logits in place), and keeps the
    walk's output; later tree steps do not. Without chain steps on vLLM's sampler it never runs."""
    from vllm_ddtree.mrv2.sampler import MRV2TreeSampler

    calls = []
    step = FakeStep(runner_verifies_chains=True)
    _kv_fixture(step)

    def fallback(logits, batch, draft):
        calls.append(step.core.attention.step is None)  # the walk has run (it resets the step in flight)
        logits.fill_(float("nan"))  # as vLLM's sampler edits them in place

    tree_sampler = MRV2TreeSampler(step.speculator, StubSampler(step.prefill_len), fallback=fallback)
    logits, paths, bonus = step.target_logits()
    step.prepare()
    out = tree_sampler(logits, step.batch)
    assert calls == [True] and step.core.take_step().walked
    slot = REQUESTS[0][0]  # batch row 0: a fresh tree; the walk's tokens, drawn before vLLM's sampler ran
    tokens = [int(step.req_trees.token_ids[slot, node]) for node in paths[0][1:]] + [bonus[0]]
    assert out.sampled_token_ids[0, : len(tokens)].tolist() == tokens
    step.prepare()
    tree_sampler(step.target_logits()[0], step.batch)
    assert calls == [True]  # once


def test_linearise_gives_dflash_the_accepted_path_as_a_chain():
    """After the walk, MRV2's DFlash input kernel must see what it would see for a chain that accepted the path:
    context positions s.., hidden rows of the path nodes first, queries at s+m+1.., draft seq_len s+m+2+depth."""
    from vllm.v1.worker.gpu.input_batch import InputBuffers
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    step = FakeStep()
    _kv_fixture(step)
    out, paths, bonus, _, _, _ = _run_sampler(step)
    batch = step.batch
    hidden = torch.arange(batch.num_tokens, dtype=torch.float32)[:, None].repeat(1, 3)
    order = step.core.linearise(step.core.take_step())
    linear_hidden = hidden.index_select(0, order)
    assert torch.equal(batch.positions, step.linear_positions)

    draft = InputBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))
    n = MAX_TOKENS
    context_positions = torch.zeros(n, dtype=torch.int64)
    sample_indices = torch.zeros(MAX_REQS * DEPTH, dtype=torch.int64)
    block_table = torch.arange(MAX_REQS * MAX_BLOCKS, dtype=torch.int32).view(MAX_REQS, MAX_BLOCKS)
    last_sampled = step.last_sampled.clone()
    for r, (slot, kind, _nd, _s) in enumerate(REQUESTS):
        if kind != "prefill":
            last_sampled[slot] = bonus[r]
    prepare_dflash_inputs(
        draft, torch.zeros(n, dtype=torch.int64), context_positions, torch.zeros(n, dtype=torch.int64),
        sample_indices, torch.zeros_like(sample_indices), torch.zeros(MAX_REQS * DEPTH, dtype=torch.int32),
        batch, out.num_sampled, out.num_rejected, last_sampled, torch.zeros(MAX_REQS, dtype=torch.int64),
        block_table, KV_BLOCK, 0, 1 + DEPTH, DEPTH, MAX_REQS, MAX_TOKENS, 4096,
    )
    for r, (_slot, kind, _nd, s) in enumerate(REQUESTS):
        if kind == "prefill":
            continue
        root, m = step.root_row(r), len(paths[r]) - 1
        for k, node in enumerate(paths[r]):
            assert torch.equal(linear_hidden[root + k], hidden[root + node])  # path node k's hidden at row k
            assert int(context_positions[root + k]) == s + k
        query = draft.positions[r * (1 + DEPTH) : (r + 1) * (1 + DEPTH)].tolist()
        assert query == list(range(s + m + 1, s + m + 2 + DEPTH))
        assert int(draft.seq_lens[r]) == s + m + 2 + DEPTH
        assert int(draft.input_ids[r * (1 + DEPTH)]) == bonus[r]


@pytest.mark.parametrize("walked", [True, False])
def test_linearise_rows_kernel_equals_its_torch_reference(walked):
    """The one-launch Triton linearise (TRITON_INTERPRET here) against the plain-PyTorch reference: the positions
    go back to linear, and after a walk the row order is ``chain_order``'s (not before: None)."""
    from vllm_ddtree.verify_rows import linearise_rows_torch, linearise_rows_triton

    orders = []
    for linearise in (linearise_rows_triton, linearise_rows_torch):
        step = FakeStep(4)
        _kv_fixture(step)
        if walked:
            _run_sampler(step)  # prepare, walk, compaction: accepted paths with acc[k] != k
        else:
            step.prepare()
        verify = step.core.take_step()
        assert not torch.equal(step.batch.positions, step.linear_positions)
        accepted = step.core.walk_out.accepted_node_ids[: step.batch.num_reqs] if walked else None
        orders.append(linearise(verify.rows, verify.prepared, accepted, torch.arange(MAX_TOKENS)))
        assert torch.equal(step.batch.positions, step.linear_positions)
    kernel, reference = orders
    if walked:
        assert torch.equal(kernel, reference) and not torch.equal(kernel, torch.arange(len(kernel)))
    else:
        assert kernel is None and reference is None


def test_tree_sampler_logprobs_follow_the_accepted_path():
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    step = FakeStep()
    _kv_fixture(step)
    out, paths, bonus, _, _, logits = _run_sampler(step, num_logprobs=2)
    cu = step.batch.cu_num_logits_np
    order = torch.arange(logits.shape[0])
    flat = torch.zeros(logits.shape[0], dtype=torch.int64)
    for r in range(step.batch.num_reqs):
        for j, node in enumerate(paths[r]):
            order[cu[r] + j] = cu[r] + node
        for j in range(len(paths[r])):
            flat[cu[r] + j] = out.sampled_token_ids[r, j]
    want = compute_topk_scores(logits[order], 2, flat, cu.tolist())
    got = out.logprobs_tensors
    assert torch.equal(got.logprob_token_ids, want.logprob_token_ids)
    assert torch.allclose(got.logprobs, want.logprobs)


def _drafting_fake(drafting_chain: bool):
    """What ``DDTreeSpeculator._generate_draft`` reads, around a linear draft head; and the logits it computes."""
    num_reqs, hidden_size, per_req = 3, 8, 1 + DEPTH
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(hidden_size, VOCAB, generator=gen)
    hidden = torch.randn(num_reqs * per_req, hidden_size, generator=gen)
    anchors = torch.arange(MAX_REQS, dtype=torch.int64) * per_req
    input_ids = torch.randint(0, VOCAB, (MAX_TOKENS,), dtype=torch.int32, generator=gen)
    sample_indices = torch.tensor([r * per_req + 1 + d for r in range(num_reqs) for d in range(DEPTH)])
    fake = SimpleNamespace(
        _run_model=lambda *args: hidden,
        model=SimpleNamespace(compute_logits=lambda h: h @ weights),
        sample_indices=sample_indices,
        input_buffers=SimpleNamespace(input_ids=input_ids),
        _anchor_idx=anchors,
        batch_trees=TreeBatch.allocate(MAX_REQS, BUDGET, "cpu"),
        batch_chains=torch.zeros(MAX_REQS, DEPTH, dtype=torch.int64),  # the chain fallback on
        draft_tokens=torch.zeros(MAX_REQS, BUDGET, dtype=torch.int64),
        tree_budget=BUDGET,
        tree_depth=DEPTH,
        synthetic=None,
        _drafting_chain=drafting_chain,
    )
    return fake, (hidden[sample_indices] @ weights).view(num_reqs, DEPTH, VOCAB), input_ids[anchors[:num_reqs]].long()


def test_generate_draft_builds_trees_rooted_at_the_anchors():
    from vllm_ddtree.mrv2.speculator import DDTreeSpeculator

    fake, logits, roots = _drafting_fake(drafting_chain=False)
    num_reqs = logits.shape[0]
    input_ids, anchors = fake.input_buffers.input_ids, fake._anchor_idx
    DDTreeSpeculator._generate_draft(fake, num_reqs, num_reqs * (1 + DEPTH), None, None, None)
    want = TreeBatch.allocate(num_reqs, BUDGET, "cpu")
    build_tree(logits, BUDGET, want, roots)
    assert torch.equal(fake.batch_trees.token_ids[:num_reqs], want.token_ids)
    assert torch.equal(fake.batch_trees.parents[:num_reqs], want.parents)
    assert fake.batch_trees.token_ids[:num_reqs, 0].tolist() == input_ids[anchors[:num_reqs]].tolist()
    assert torch.equal(fake.draft_tokens[:num_reqs], want.token_ids[:, 1:])
    assert torch.equal(fake.batch_chains[:num_reqs], logits.argmax(-1))  # the DFlash chain, filed beside the tree


def test_generate_draft_files_only_the_chain_when_the_next_step_verifies_it(monkeypatch):
    from vllm_ddtree.mrv2 import speculator as mrv2_speculator

    fake, logits, roots = _drafting_fake(drafting_chain=True)
    num_reqs = logits.shape[0]
    monkeypatch.setattr(mrv2_speculator, "build_tree", lambda *args, **kwargs: pytest.fail("built a tree"))
    mrv2_speculator.DDTreeSpeculator._generate_draft(fake, num_reqs, num_reqs * (1 + DEPTH), None, None, None)
    want, chains = TreeBatch.allocate(num_reqs, BUDGET, "cpu"), torch.zeros(num_reqs, DEPTH, dtype=torch.int64)
    build_chain(logits, want, roots, chains)
    for name in (*TREE_FIELDS, "num_nodes"):
        assert torch.equal(getattr(fake.batch_trees, name)[:num_reqs], getattr(want, name)), name
    assert torch.equal(fake.batch_chains[:num_reqs], logits.argmax(-1))
    assert torch.equal(fake.draft_tokens[:num_reqs, :DEPTH], fake.batch_chains[:num_reqs])  # the drafts fed next


def test_a_step_before_a_chain_step_drafts_through_the_chain_only_graphs(monkeypatch):
    """The draft count vLLM's scheduler fixed for the next step reaches the speculator through patch 0004's hook;
    when it is the chain's, DFlash's ``propose`` runs on the chain-only graphs with ``_generate_draft`` filing
    chains. Any other count, a dummy run, or a drafter without the chain fallback (no chains) drafts trees."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.mrv2.speculator import DDTreeSpeculator

    seen = []
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *a, **kw: seen.append(
        (self._drafting_chain, self.query_cudagraph_manager)) or "drafts")
    fake = DDTreeSpeculator.__new__(DDTreeSpeculator)
    cores = {chain_depth: TreeVerifyCore(TreeHandover(MAX_REQS, BUDGET, torch.device("cpu"), chain_depth), DEPTH,
                                         MAX_REQS, MAX_TOKENS, torch.device("cpu"), cuda_graphs=False)
             for chain_depth in (DEPTH, 0)}  # with the chain fallback, and without (no chains)
    fake.batch_trees = TreeBatch.allocate(MAX_REQS, BUDGET, "cpu")
    fake._drafting_chain, fake.query_cudagraph_manager, fake._chain_graphs = False, "tree graphs", "chain graphs"
    batch = SimpleNamespace(num_tokens=2, idx_mapping=torch.tensor([4, 1], dtype=torch.int32), num_reqs=2,
                            num_draft_tokens=0)
    rest = tuple(f"arg{i}" for i in range(6))
    for chain_depth, next_drafts, dummy_run, want in [
        (DEPTH, DEPTH, False, (True, "chain graphs")),
        (DEPTH, BUDGET, False, (False, "tree graphs")),
        (DEPTH, DEPTH, True, (False, "tree graphs")),
        (0, DEPTH, False, (False, "tree graphs")),
    ]:
        fake.core = cores[chain_depth]
        fake.batch_chains = torch.zeros(MAX_REQS, DEPTH, dtype=torch.int64) if chain_depth else None
        fake.prepare_verify(batch, SimpleNamespace(num_spec_tokens_to_schedule=next_drafts))
        assert fake.propose(batch, "meta", "slot_maps", torch.zeros(2, 1), None, *rest, dummy_run=dummy_run) == "drafts"
        assert seen.pop() == want
        assert (fake._drafting_chain, fake.query_cudagraph_manager) == (False, "tree graphs")  # restored


def test_propose_passes_the_runners_arguments_to_dflash_by_position_or_by_name(monkeypatch):
    """MRV2 calls ``propose`` positionally for a decode step and by name for a dummy run (model_runner.py): both reach
    DFlash's ``propose`` whole; the hidden rows DFlash gets are the linearised ones; only a real step files trees."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

    from vllm_ddtree.mrv2.speculator import DDTreeSpeculator

    seen, filed = [], []
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *a, **kw: seen.append((a, kw)) or "drafts")
    order = torch.tensor([1, 0])
    core = SimpleNamespace(take_step=lambda: "step", linearise=lambda step: order,
                           timer=SimpleNamespace(mark=lambda name: None),
                           handover=SimpleNamespace(file=lambda *a: filed.append(a)))
    fake = DDTreeSpeculator.__new__(DDTreeSpeculator)
    fake.core, fake.batch_trees, fake.batch_chains, fake._next_num_drafts = core, "trees", "chains", None
    batch = SimpleNamespace(num_tokens=2, idx_mapping="slots", num_reqs=2)
    hidden = torch.tensor([[10.0], [20.0]])
    rest = tuple(f"arg{i}" for i in range(6))  # num_sampled .. seeds
    assert fake.propose(batch, "meta", "slot_maps", hidden, [], *rest, mm_inputs="mm") == "drafts"
    args, kwargs = seen.pop()
    assert args[:3] == (batch, "meta", "slot_maps") and args[5:] == rest and args[4] == []
    assert args[3].flatten().tolist() == [20.0, 10.0]  # the accepted path first
    assert kwargs == {"dummy_run": False, "mm_inputs": "mm"} and filed == [("slots", "trees", 2, "chains")]
    named = dict(zip(("num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds"),
                     rest))
    fake.propose(input_batch=batch, attn_metadata="meta", slot_mappings="slot_maps", last_hidden_states=hidden,
                 aux_hidden_states=None, **named, dummy_run=True, skip_attn_for_dummy_run=True, is_profile=False)
    args, kwargs = seen.pop()
    assert args == (batch, "meta", "slot_maps", hidden, None) and len(filed) == 1  # a dummy run files nothing
    assert kwargs == {**named, "dummy_run": True, "skip_attn_for_dummy_run": True, "is_profile": False}
    # DFlash's auxiliary layers: one gathered concatenation (DFlash concatenates them), rows of the first num_tokens.
    aux = [torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]), torch.tensor([[5.0], [6.0], [9.0]])]
    fake.propose(batch, "meta", "slot_maps", hidden, aux, *rest)
    args, _ = seen.pop()
    assert len(args[4]) == 1 and torch.equal(torch.cat(args[4], dim=-1),
                                             torch.cat(aux, dim=-1)[:2].index_select(0, order))


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("chains", [True, False])
@pytest.mark.parametrize("budget", [BUDGET, 40])
def test_handover_files_each_batch_row_under_its_request_slot_with_a_new_epoch(impl, chains, budget):
    """The Triton filing (CUDA's) and its torch reference (the CPU engine's), with and without the chain fallback,
    trees of one and of two ancestor words."""
    from vllm_ddtree.tree_handover import file_trees_torch
    from vllm_ddtree.tree_handover_triton import file_trees_triton

    gen = torch.Generator().manual_seed(4)
    batch_trees = TreeBatch.allocate(MAX_REQS, budget, "cpu")
    build_tree(torch.randn(3, DEPTH, VOCAB, generator=gen), budget, batch_trees, torch.tensor([1, 2, 3]))
    batch_chains = torch.randint(0, VOCAB, (MAX_REQS, DEPTH), generator=gen) if chains else None
    handover = TreeHandover(MAX_REQS, budget, torch.device("cpu"), DEPTH if chains else 0)
    handover._file = {"triton": file_trees_triton, "torch": file_trees_torch}[impl]
    idx_mapping = torch.tensor([6, 0, 3], dtype=torch.int32)
    handover.file(idx_mapping, batch_trees, 3, batch_chains)
    handover.file(idx_mapping[:1], batch_trees, 1, batch_chains)  # a later draft step with one request
    assert int(batch_trees.num_nodes[:3].min()) == budget
    for row, slot in enumerate(idx_mapping.tolist()):
        for name in (*TREE_FIELDS, "num_nodes"):
            assert torch.equal(getattr(handover.trees, name)[slot], getattr(batch_trees, name)[row])
        if chains:
            assert torch.equal(handover.chains[slot], batch_chains[row])
    empty = TreeBatch.allocate(1, budget, "cpu")
    for name in (*TREE_FIELDS, "num_nodes"):  # untouched slots stay empty
        assert torch.equal(getattr(handover.trees, name)[1], getattr(empty, name)[0]), name
    assert handover.stamp[[6, 0, 3, 1]].tolist() == [2, 1, 1, -1] and int(handover.epoch) == 2
    if chains:
        assert not handover.chains[1].any()  # the untouched slot's chain too
    else:
        assert handover.chains is None


def test_request_slots_are_stable_and_reused_once_a_request_is_gone():
    from vllm_ddtree.tree_handover import RequestSlots

    slots = RequestSlots(2)
    a, b = slots.lookup(["a", "b"], {"a", "b"})
    assert slots.lookup(["b", "a"], {"a", "b"}) == [b, a]
    assert slots.lookup(["c"], {"b", "c"}) == [a]  # "a" finished: its slot is reused
    with pytest.raises(RuntimeError, match="more live requests"):
        slots.lookup(["d"], {"b", "c", "d"})


def test_step_timing_marks_the_verify_phases_in_order(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_DDTREE_STEP_TIMING", str(tmp_path))
    step = FakeStep()
    _kv_fixture(step)
    _run_sampler(step)
    assert [name for name, _, _ in step.core.timer.marks] == ["prepare", "prepared", "sample", "walked",
                                                               "compacted"]
