"""The vllm.general_plugins entry point is installed and quiet on a patched vLLM."""

from __future__ import annotations

import importlib.metadata
import logging

from vllm_ddtree import LOGGER_NAME, plugin


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "ddtree" and ep.value == "vllm_ddtree.plugin:register" for ep in eps)


def test_register_is_silent_when_patched(ddtree_log):
    with ddtree_log.at_level(logging.WARNING, logger=LOGGER_NAME):
        plugin.register()
    assert not ddtree_log.records


def test_register_warns_when_vllm_is_not_patched(ddtree_log, monkeypatch):
    from vllm.config.speculative import SpeculativeConfig

    fields = {k: v for k, v in SpeculativeConfig.__dataclass_fields__.items() if k != "tree_depth"}
    monkeypatch.setattr(SpeculativeConfig, "__dataclass_fields__", fields)
    with ddtree_log.at_level(logging.WARNING, logger=LOGGER_NAME):
        plugin.register()
    assert "apply_patches.py apply" in ddtree_log.text


def test_ddtree_logs_where_vllm_logs():
    """ddtree's INFO lines (the runner and budget at start-up, the cost-aware budget's choices at shutdown) reach
    vLLM's handler in every vLLM process, as vLLM's own lines do: on an H100 a GPU engine core printed none of them
    while they had a logger of their own (2026-12-05)."""
    from vllm_ddtree import scheduler  # the budget's choices
    from vllm_ddtree.v1 import proposer  # the start-up line

    vllms = logging.getLogger("vllm")
    assert scheduler.logger.parent is vllms and proposer.logger is scheduler.logger
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Seen()
    vllms.addHandler(handler)
    try:
        scheduler.logger.info("ddtree cost-aware budget, verify steps: %s", "no verify steps")
    finally:
        vllms.removeHandler(handler)
    assert seen == ["ddtree cost-aware budget, verify steps: no verify steps"]
