"""The vllm.general_plugins entry point is installed and quiet on a patched vLLM."""

from __future__ import annotations

import importlib.metadata
import logging

from vllm_ddtree import plugin


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "ddtree" and ep.value == "vllm_ddtree.plugin:register" for ep in eps)


def test_register_is_silent_when_patched(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_ddtree"):
        plugin.register()
    assert not caplog.records


def test_register_warns_when_vllm_is_not_patched(caplog, monkeypatch):
    from vllm.config.speculative import SpeculativeConfig

    fields = {k: v for k, v in SpeculativeConfig.__dataclass_fields__.items() if k != "tree_depth"}
    monkeypatch.setattr(SpeculativeConfig, "__dataclass_fields__", fields)
    with caplog.at_level(logging.WARNING, logger="vllm_ddtree"):
        plugin.register()
    assert "apply_patches.py apply" in caplog.text


def test_ddtree_logs_through_vllms_handler_where_nothing_else_is_configured(monkeypatch):
    """In `vllm serve` nothing configures the root logger: ddtree's INFO lines must reach vLLM's handler (they reached
    none before 2026-12-04); an application's own root handlers are left to receive them."""
    ours, vllms = logging.getLogger("vllm_ddtree"), logging.getLogger("vllm")
    assert vllms.handlers  # vLLM's default logging configuration
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [object()])  # an application configured logging
    plugin.register()
    assert ours.handlers == []
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    plugin.register()
    assert ours.handlers == vllms.handlers and ours.level == vllms.level
    assert logging.getLogger("vllm_ddtree.scheduler").getEffectiveLevel() == vllms.level
    plugin.register()
    assert ours.handlers == vllms.handlers  # once
