"""Installs the test oracle drafter (engine_run.install_oracle) in every Python process of an engine run.

engine_run.run_engine puts this folder on PYTHONPATH and the oracle's JSON in VLLM_DDTREE_TEST_ORACLE, so vLLM's
worker processes (tensor parallel) draft from the oracle too, not only the process that started the engine.
"""

import json
import os

_spec = os.environ.get("VLLM_DDTREE_TEST_ORACLE")
if _spec:
    from ddtree_testkit.engine_run import install_oracle

    with open(_spec) as f:
        _o = json.load(f)
    install_oracle(
        {tuple(p): c for p, c in zip(_o["prompt_token_ids"], _o["continuations"])},
        _o.get("p_first", 0.6),
        _o.get("p_second", 0.25),
        _o.get("seed", 0),
    )
