#!/usr/bin/env bash
# The project's test command (README, .ci/run). Two pytest processes, because kernel tests run Triton through its
# interpreter with a placeholder backend (tests/unit/conftest.py) that must never reach a vLLM engine process.
# Usage: bash tools/run_tests.sh [extra pytest args]
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=$ROOT/.venv/bin/python
[[ -x $PY ]] || { echo "run_tests: no .venv; run: bash tools/setup_env.sh" >&2; exit 2; }
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PY" -m ruff check --quiet vllm_ddtree testkit tools tests benchmarks; lint=$?
TRITON_INTERPRET=1 "$PY" -m pytest tests/unit -q -p no:cacheprovider "$@"; unit=$?
env -u TRITON_INTERPRET "$PY" -m pytest tests/engine -q -p no:cacheprovider "$@"; engine=$?
echo "run_tests: lint exit $lint, unit exit $unit, engine exit $engine"
# pytest exits 5 when a directory holds no tests: that is a failure here, a suite that ran nothing proves nothing.
[[ $lint -eq 0 && $unit -eq 0 && $engine -eq 0 ]]
