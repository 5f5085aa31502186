"""GatedDeltaNet (Qwen3.5/3.6, Qwen3-Next) support for tree verification: kernels, references, relayout, memory.

vLLM 0.26.0 verifies drafts on hybrid targets as a chain (token t continues token t-1's conv window and
recurrent state). ``tree_conv`` and ``tree_gdn`` are parent-aware versions of its two spec-decode kernels,
``relayout`` puts the accepted path back into vLLM's chain layout (or replays it), ``memory`` sizes the state.
Not wired into the runner yet (ddtree refuses hybrid targets at start-up); see the module docstrings for the exact
vLLM functions each one mirrors.

Where to test the wiring: vLLM's CPU engine runs GatedDeltaNet layers, speculative verify steps included, in torch
(``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``: ``_cpu_gdn_attention_spec_aware`` /
``_spec_forward`` are the CPU counterparts of the two kernels here). It needs bfloat16 weights and
``mamba_ssm_cache_dtype="float32"``; ``offline_models.tiny_target_dir("qwen3_next")`` is such a target, and
tests/engine runs the DFlash chain on it.
"""
