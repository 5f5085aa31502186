"""vLLM engine arguments the tests and benchmarks share."""

from __future__ import annotations

# limit_mm_per_prompt for text prompts on a multimodal target (Qwen3.5/3.6): vLLM then builds no vision encoder and
# skips its start-up profiling.
TEXT_ONLY_MM_LIMITS = {"image": 0, "video": 0}


def hybrid_engine_args() -> dict:
    """vLLM engine arguments for a GatedDeltaNet target in our tests and benchmarks: the recurrent state in float32
    (what Qwen3.5/3.6 ship; vLLM's CPU GDN needs it), no prefix caching of recurrent state (ddtree keeps one state
    per tree node in the spec slots), and vLLM's Triton GDN prefill where FlashInfer is not installed (vLLM picks
    FlashInfer's on Hopper and fails at the first prefill without it: the GPU bundle of these machines has none)."""
    import importlib.util

    args = {"mamba_ssm_cache_dtype": "float32", "enable_prefix_caching": False}
    if importlib.util.find_spec("flashinfer") is None:
        args["gdn_prefill_backend"] = "triton"
    return args
