"""Installs teacher forcing (../teacher_forcing.py) in an engine process, then the oracle drafter as oracle_site does.

test_hybrid_engine.py puts this folder on PYTHONPATH with ``$VLLM_DDTREE_TEST_TEACHER`` (and, for DDTree runs,
``$VLLM_DDTREE_TEST_ORACLE``) instead of passing ``oracle=`` to engine_run.run_engine, whose oracle_site would come
first on the path and hide this file.
"""

import os
import runpy
import sys

_engine_tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("VLLM_DDTREE_TEST_TEACHER"):
    sys.path.insert(0, _engine_tests)
    from teacher_forcing import install_from_file

    install_from_file(os.environ["VLLM_DDTREE_TEST_TEACHER"])
import ddtree_testkit  # noqa: E402

runpy.run_path(os.path.join(os.path.dirname(ddtree_testkit.__file__), "oracle_site", "sitecustomize.py"))
