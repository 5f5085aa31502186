"""vLLM general-plugin entry point (``vllm.general_plugins``), loaded in every vLLM process.

It must cost nothing for users who do not ask for ddtree: vLLM loads general plugins before it parses any config,
so this only checks, cheaply, that the patches are in place and says so once if they are not. Everything ddtree
does is reached through the hook points the patches add, which import ``vllm_ddtree`` lazily when
``method: "ddtree"`` is configured.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_ddtree")


def register() -> None:
    from vllm.config.speculative import SpeculativeConfig

    _log_through_vllms_handlers()

    if "tree_depth" not in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
        logger.warning(
            "vllm-ddtree is installed but vLLM is not patched, so method 'ddtree' is unavailable; "
            "run `python tools/apply_patches.py apply` from the vllm-ddtree checkout."
        )


def _log_through_vllms_handlers() -> None:
    """vLLM configures only its own "vllm" logger (its handler and level, not propagated), so in a vLLM process
    ddtree's INFO lines (which runner and budget at start-up, the cost-aware budget's choices at shutdown) reached
    no handler and were never shown. Where the application has not configured logging (no root handler), the
    "vllm_ddtree" logger gets vLLM's handlers and level; otherwise its records go to the application's handlers."""
    ours, root = logging.getLogger("vllm_ddtree"), logging.getLogger()
    if ours.handlers or root.handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)
