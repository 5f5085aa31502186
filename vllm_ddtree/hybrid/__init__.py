"""GatedDeltaNet (Qwen3.5/3.6, Qwen3-Next) targets: tree verification of their recurrent layers.

vLLM 0.26.0 verifies drafts on hybrid targets as a chain (token t continues token t-1's conv window and
recurrent state). Patch 0005 routes the GDN layers' speculative step through hook attributes; ``target`` points
them at the tree versions and lays each accepted path out afterwards.

- ``tree_conv``, ``tree_gdn``: parent-aware Triton versions of vLLM's two GPU spec-decode kernels;
  ``gdn_hooks`` calls them with vLLM's arguments, ``spec_parents`` gives each spec token its parent.
- ``cpu_tree``: the CPU engine's counterpart, exact to vLLM's own CPU chain op along every path.
- ``relayout``: the accepted path into vLLM's chain layout (or replayed); ``memory``: state sizes per budget.
- ``reference``: float64 references of all of it.

vLLM's CPU engine runs GDN layers in bfloat16 with ``mamba_ssm_cache_dtype="float32"``;
``ddtree_testkit.qwen3_5_models.tiny_qwen3_5_dir()`` (Qwen3_5ForConditionalGeneration, as vLLM serves Qwen3.5/3.6)
and ``ddtree_testkit.tiny_targets.tiny_target_dir("qwen3_next")`` are random tiny targets for it (tests/engine).
State layouts (wired: 1 + B spec slots per request; replay: written, not wired) are in docs/hybrid-state-layout.md.
"""
