"""vllm-ddtree: DDTree tree speculative decoding for vLLM 0.26.0 (DFlash drafter, best-first tree, tree verify)."""

__version__ = "0.1.0"

LOGGER_NAME = "vllm.ddtree"
"""ddtree logs as a child of vLLM's logger, so its lines take vLLM's handler, format and ``VLLM_LOGGING_LEVEL`` in
every vLLM process, as vLLM's own do. A separate "vllm_ddtree" logger, given vLLM's handler by the plugin, printed
nothing from a GPU engine core (H100, 2026-12-05: neither the start-up line nor the budget's choices), while it
did on the CPU engine."""
