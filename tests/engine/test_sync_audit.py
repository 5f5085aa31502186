"""sync_audit.py itself: it records a synchronising torch call made under vllm_ddtree code, with where it was made,
and leaves alone the same call made by test code or outside vllm_ddtree."""

from __future__ import annotations

import torch

from ddtree_testkit.sync_audit import SyncAudit
from vllm_ddtree.kv_compact import kv_compact_torch


def test_records_syncs_under_vllm_ddtree_only():
    caches = [torch.zeros(4, 4, 1, 2)]
    block_table = torch.tensor([[1, 2]])
    accepted = torch.tensor([[0, 2, -1]])  # node 2 moves to depth 1
    records: list[dict] = []
    with SyncAudit(records):
        kv_compact_torch(caches, block_table, torch.tensor([3]), accepted)  # nonzero under vllm_ddtree
        torch.arange(3).tolist()  # test code
        bool(torch.ones(()).any())  # test code
        torch.ones(2).add_(1)  # not a sync
    assert [(r["call"], r["in"].split(":")[0], r["in"].split()[-1]) for r in records] == [
        ("nonzero", "vllm_ddtree/kv_compact.py", "kv_compact_torch")]


def test_boolean_mask_indexing_and_value_reads_count():
    from ddtree_testkit.sync_audit import INDEXING, SYNC_CALLS, _bool_mask_index

    assert {"item", "tolist", "__bool__", "nonzero", "cpu"} <= SYNC_CALLS and "__getitem__" in INDEXING
    x = torch.arange(4)
    assert _bool_mask_index((x, x > 1)) and _bool_mask_index((x, (slice(None), x > 1)))
    assert not _bool_mask_index((x, torch.tensor([0, 2]))) and not _bool_mask_index((x, 1))
