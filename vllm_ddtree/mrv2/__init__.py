"""DDTree on vLLM's Model Runner V2, ddtree's runner for dense CUDA targets (docs/model-runner-v2.md).

``speculator.DDTreeSpeculator`` (built by patch 0004's ``init_speculator`` hook) drafts trees with DFlash;
``sampler.MRV2TreeSampler`` walks each verify step's trees in the rejection sampler's place, through the runner-
agnostic ``verify_core.TreeVerifyCore``. Everything kept between steps lives on the device, indexed by MRV2's
persistent request slot, so neither needs a host sync and both work under async scheduling.
"""
