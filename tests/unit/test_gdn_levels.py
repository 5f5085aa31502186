"""benchmarks/gdn_levels.py, the by-level GDN tree recurrence (an experiment timed against the tree kernel), against
the float64 tree reference: a timing row is only worth reading if the kernel computes the tree's outputs and states."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_hybrid_gdn import ATOL, HV, SPEC, K, V, make_step

from vllm_ddtree.hybrid.reference import gdn_tree_reference

_spec = importlib.util.spec_from_file_location(
    "gdn_levels", Path(__file__).resolve().parents[2] / "benchmarks" / "gdn_levels.py")
gdn_levels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gdn_levels)


def test_level_order_lists_each_requests_nodes_by_depth():
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, -1, 0, 1, 0], dtype=torch.int32)  # two requests: 6 and 4 nodes
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    order, starts = gdn_levels.level_order(parents, cu, 5)
    assert order.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 3, 2]
    assert starts.tolist() == [[0, 1, 3, 5, 6, 6], [0, 1, 3, 4, 4, 4]]


@pytest.mark.parametrize("seed,width", [(0, 4), (1, 2)])
def test_by_level_equals_the_tree_reference(seed, width):
    s = make_step(seed, sizes=(7, 1, 13, 4))
    blocks = s["spec_idx"][:, 0]
    o, states = gdn_levels.tree_gdn_by_level(
        s["A_log"], s["a"], s["b"], s["dt_bias"], s["q"][None], s["k"][None], s["v"][None], s["flat_parents"],
        s["ssm_state"], s["qsl"], blocks, levels=SPEC + 1, width=width)
    assert states.shape == (len(s["flat_parents"]), HV, V, K)
    for n, ps in enumerate(s["parents"]):
        lo, hi = int(s["qsl"][n]), int(s["qsl"][n + 1])
        sl = slice(lo, hi)
        o_ref, s_ref = gdn_tree_reference(s["q"][sl], s["k"][sl], s["v"][sl], s["a"][sl], s["b"][sl], s["A_log"],
                                          s["dt_bias"], s["ssm_state"][int(blocks[n])], ps)
        torch.testing.assert_close(o[0, sl].double(), o_ref, rtol=0, atol=ATOL)
        torch.testing.assert_close(states[sl].double(), s_ref, rtol=0, atol=ATOL)
