"""vllm-ddtree's test, benchmark and tool machinery: offline models, fixture builders, benchmark shapes.

Not part of the product: ``pip install vllm-ddtree`` installs ``vllm_ddtree`` only. The development environment
(tools/setup_env.sh) installs this package beside it, so tests, benchmarks and tools import it by name.
"""
