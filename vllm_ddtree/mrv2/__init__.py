"""DDTree on vLLM's Model Runner V2 (experimental, ``VLLM_DDTREE_MRV2=1``; docs/model-runner-v2.md).

``speculator.DDTreeSpeculator`` (built by patch 0004's ``init_speculator`` hook) drafts trees with DFlash;
``verifier`` lays each verify step's trees out among the target's rows and walks them in the rejection sampler's
place. Everything kept between steps lives on the device, indexed by MRV2's persistent request slot, so neither
needs a host sync and both work under async scheduling.
"""
