"""The GDN replay layout's verify hooks and relayout compiled for the GPU and captured in CUDA graphs, as the engine
runs them (the verify forward in vLLM's graph, the relayout in its own), against the same step run eagerly and the
tree kernel's node states. tests/unit runs this step through the interpreter under the sync audit; only a GPU can
refuse a capture (2026-12-03: a boolean-mask index failed vLLM's verify-graph capture on an H200)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_hybrid_gdn as unit
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_replay_step_captured_in_cuda_graphs_equals_eager_and_the_tree_kernel():
    from vllm_ddtree.hybrid.tree_gdn import tree_fused_sigmoid_gating_delta_rule_update

    dev = torch.device("cuda")
    step = unit.make_step(9)
    spec_rows, rows = [0, 2, 3, 4], 6  # row 1 prefills, row 5 is graph padding
    masks = torch.zeros(rows - 1, dtype=torch.bool)
    masks[spec_rows] = True
    hooks, stash, layer = unit.make_hooks(step, torch.arange(rows, dtype=torch.int32), masks, spec_rows)
    on_device(dev, hooks, hooks.trees, stash)
    s = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in step.items()}
    layer.A_log, layer.dt_bias = s["A_log"], s["dt_bias"]
    stash.index = {layer.A_log.data_ptr(): 0}  # the stash knows its layers by their A_log
    n = len(s["parents"])
    blocks = s["spec_idx"][:, 0]
    one_block = unit.one_block_per_request(s)
    forward = [object()]
    metadata = SimpleNamespace(spec_sequence_masks=masks.to(dev), spec_query_start_loc=s["qsl"])
    hooks.metadata_source = lambda: (forward[0], metadata)
    acc, num = unit.random_accepted({"parents": s["parents"]}, torch.Generator().manual_seed(13))
    accepted = torch.zeros(8, unit.SPEC + 1, dtype=torch.int32, device=dev)
    num_accepted = torch.zeros(8, dtype=torch.int32, device=dev)
    accepted[spec_rows], num_accepted[spec_rows] = acc.to(dev), (num - 1).to(dev)
    table = torch.zeros(8, 1, dtype=torch.int32, device=dev)
    table[spec_rows, 0] = blocks
    table[5, 0] = blocks[1]  # padding row: a stale table naming a live block
    conv, ssm = s["conv_state"].clone(), s["ssm_state"].clone()
    layers = [(0, conv, ssm, unit.W, layer)]
    target = unit.step_target(unit.SPEC, table, layers, accepted, num_accepted, rows - 1, stash)
    target.device = dev
    target._num_live = torch.tensor(rows - 1, device=dev)

    def verify():
        forward[0] = object()  # a new forward: the hooks recompute the step's parents
        return unit.run_hooks(one_block, hooks, conv, ssm)[1]

    # Eagerly (which also compiles every kernel before the capture).
    o_eager = verify()
    target._relayout_rows(rows)
    conv_eager, ssm_eager = conv.clone(), ssm.clone()

    o_t, states_t = tree_fused_sigmoid_gating_delta_rule_update(
        s["A_log"], s["a"], s["b"], s["dt_bias"], s["q"][None], s["k"][None], s["v"][None], s["flat_parents"],
        initial_state=s["ssm_state"], cu_seqlens=s["qsl"], ssm_state_indices=blocks[:, None],
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o_eager, o_t, rtol=0, atol=0)
    for i in range(n):
        last = int(s["qsl"][i]) + int(acc[i, int(num[i]) - 1])
        torch.testing.assert_close(ssm_eager[int(blocks[i])], states_t[last], rtol=0, atol=0)
    untouched = [j for j in range(ssm.shape[0]) if j not in set(blocks.tolist())]
    torch.testing.assert_close(ssm_eager[untouched], s["ssm_state"][untouched], rtol=0, atol=0)

    # Captured: the verify forward's graph, then the relayout's, replayed from the step's starting state.
    verify_graph, relayout_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    conv.copy_(s["conv_state"])
    ssm.copy_(s["ssm_state"])
    torch.cuda.synchronize()
    with torch.cuda.graph(verify_graph):
        o_graph = verify()
    with torch.cuda.graph(relayout_graph):
        target._relayout_rows(rows)
    conv.copy_(s["conv_state"])  # capture ran nothing; start the replay from the same state anyway
    ssm.copy_(s["ssm_state"])
    verify_graph.replay()
    relayout_graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(o_graph, o_eager, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ssm_eager, rtol=0, atol=0)
    torch.testing.assert_close(conv, conv_eager, rtol=0, atol=0)
    assert bool((stash.row_start == -1).all())


def on_device(dev, *objects):
    """Move every tensor attribute of ``objects`` to ``dev`` (they were built on the CPU by the unit tests' helpers)."""
    for obj in objects:
        for name, value in vars(obj).items():
            if isinstance(value, torch.Tensor):
                setattr(obj, name, value.to(dev))
