"""vLLM general-plugin entry point (``vllm.general_plugins``), loaded in every vLLM process.

It must cost nothing for users who do not ask for ddtree: vLLM loads general plugins before it parses any config,
so this only checks, cheaply, that the patches are in place and says so once if they are not. Everything ddtree
does is reached through the hook points the patches add, which import ``vllm_ddtree`` lazily when
``method: "ddtree"`` is configured.
"""

from __future__ import annotations

import logging

from vllm_ddtree import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


def register() -> None:
    from vllm.config.speculative import SpeculativeConfig

    if "tree_depth" not in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
        logger.warning(
            "vllm-ddtree is installed but vLLM is not patched, so method 'ddtree' is unavailable; "
            "run `python tools/apply_patches.py apply` from the vllm-ddtree checkout."
        )
