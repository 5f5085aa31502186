"""GatedDeltaNet (Qwen3.5/3.6, Qwen3-Next) support for tree verification: kernels, references, relayout, memory.

vLLM 0.26.0 verifies drafts on hybrid targets as a chain (token t continues token t-1's conv window and
recurrent state). ``tree_conv`` and ``tree_gdn`` are parent-aware versions of its two spec-decode kernels,
``relayout`` puts the accepted path back into vLLM's chain layout (or replays it), ``memory`` sizes the state.
Not wired into the runner yet; see the module docstrings for the exact vLLM functions each one mirrors.
"""
