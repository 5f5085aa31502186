"""vllm-ddtree: DDTree tree speculative decoding for vLLM 0.26.0 (DFlash drafter, best-first tree, tree verify)."""

__version__ = "0.1.0"
