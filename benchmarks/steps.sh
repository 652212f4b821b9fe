#!/usr/bin/env bash
# The benchmark steps, by name, in the environment you run them from (a virtual environment
# with this project installed, on a GPU machine; benchmarks/README.md says what each answers):
#   bash benchmarks/steps.sh side_by_side e2e           # results in out/bench/
#   BENCH_RESULTS=benchmarks/results bash benchmarks/steps.sh side_by_side   # update the committed ones
# Steps: the suite's: tests tests_a tests_b demo linear logits ppo ppo_base linear_ffi one_device many_devices
#   many_devices_16k many_devices_grid tests_many_gpus side_by_side e2e tunix device_times timeline
#   profile memcheck fast_accuracy tokens tokens_realistic batch_invariant batch_invariant_ffi distill topk_distill
#   sampler head_gemms; the studies' (benchmarks/studies/): ffi backward backward_base kernels fused clocks
#   fast_mode fast_loss lean_chunks kept_set sampler_forward.
#   Each runs under a time limit; a failed step is reported and the others
#   still run; the exit status says whether all passed.
#   PYTHON=python3            the interpreter (default: python3 on the PATH)
#   TESTS=tests               what the tests step gives pytest -m gpu
#   TESTS_LIMIT=300           the tests step's time limit in seconds
#   AFTER_STEP="cmd"          run after each step (benchmarks/gpu/run.sh packs the results)
#   TOKENS_SIZES=d2048        the tokens step's --sizes (default: bench_tokens' full sweep)
#   HEAD_GEMMS_SIZES=4096x2048x131072   the head_gemms step's --sizes (default: its three)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export BENCH_RESULTS=${BENCH_RESULTS:-$PWD/out/bench} PYTHONUNBUFFERED=1
mkdir -p "$BENCH_RESULTS"
echo "== results go to $BENCH_RESULTS"

status=0
step() {  # step <seconds> <command...>: run it under a time limit
  local limit=$1; shift
  echo "== $* (limit ${limit}s)"
  timeout "$limit" "$@" || { echo "== FAILED ($?): $*"; status=1; }
  if [ -n "${AFTER_STEP:-}" ]; then bash -c "$AFTER_STEP"; fi
}
for s in "$@"; do
  case $s in
    tests) step "${TESTS_LIMIT:-300}" bash -c "$PY -m pytest -m gpu -q -rs ${TESTS:-tests} 2>&1 | tee \"$BENCH_RESULTS/gpu_tests.txt\"; exit \${PIPESTATUS[0]}" ;;
    # The whole GPU suite (416 tests) in two halves for 10-minute time limits: on an H100 each
    # half finished 96-97 % of its tests in 520-540 s (gpu_tests_ff435ac.txt). Verbose, so
    # that a run cut by its limit still lists each finished test's outcome. No per-process
    # memory cap: at 30 % of the GPU each, two real-size Pallas tests failed (out of memory, likely).
    tests_a|tests_b)
      if [ "$s" = tests_a ]; then half="tests/backends tests/ops"; else half="tests/engine tests/sharding tests/integrations"; fi
      step "${TESTS_LIMIT:-540}" bash -c "XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -m gpu -n 4 --dist worksteal -v -rfs --tb=short $half 2>&1 | tee \"$BENCH_RESULTS/gpu_$s.txt\"; exit \${PIPESTATUS[0]}" ;;
    # four workers share the GPU (no preallocation): the grid's time is mostly compiling
    fast_accuracy) step 420 bash -c "XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -n 4 -m gpu -q -rs tests/engine/test_fast_accuracy.py tests/ops/test_distill.py -k 'fast or accuracy' 2>&1 | tee \"$BENCH_RESULTS/gpu_tests_fast_accuracy.txt\"; exit \${PIPESTATUS[0]}" ;;
    demo)  step 150 "$PY" -m jaxrl_kernels.demo --out "$BENCH_RESULTS/demo" ;;
    linear|logits|ppo) step 200 "$PY" -m "benchmarks.bench_$s" ;;
    ffi) step 200 "$PY" -m benchmarks.studies.bench_ffi ;;
    ppo_base) step 150 "$PY" -m benchmarks.bench_ppo --sizes base ;;
    backward) step 420 "$PY" -m benchmarks.studies.linear_kernels --backward ;;
    backward_base) step 300 "$PY" -m benchmarks.studies.linear_kernels --backward --sizes backward_base ;;
    linear_ffi) step 300 "$PY" -m benchmarks.bench_linear --backends ffi,pallas,reference ;;
    one_device) step 300 bash -c "$PY -m benchmarks.bench_many_devices --layouts 1dev --sizes base &&
      $PY -m benchmarks.bench_many_devices --layouts 1dev" ;;
    many_devices) step 560 bash -c "$PY -m benchmarks.bench_many_devices --sizes base,large \
      --backends jnp_bf16,auto,fast --layouts 1dev,rows,vocab,both &&
      $PY -m benchmarks.bench_many_devices --explicit --sizes base --backends jnp_bf16,auto,fast \
      --layouts rows,vocab,both" ;;
    # every local GPU: rows, vocabulary and both split, GRPO only, each split layout profiled;
    # GRID_SIZES picks the sizes, GRID_AXES=--explicit the mesh axes
    many_devices_grid) step 580 "$PY" -m benchmarks.bench_many_devices \
      --sizes "${GRID_SIZES:-base,n4k_d4096,n16k_d2048,n16k_d4096}" --backends jnp_bf16,auto,fast \
      --layouts 1dev,rows,vocab,both --ops linear_grpo_loss --profile ${GRID_AXES:-} ;;
    # the tests over 2 and 4 GPUs and two processes of half the GPUs each
    tests_many_gpus) step 420 bash -c "XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -n 4 -m gpu -q -rs \
      tests/sharding/test_sharding.py tests/sharding/test_multiprocess.py 2>&1 | tee \"$BENCH_RESULTS/gpu_tests_many_gpus.txt\"; exit \${PIPESTATUS[0]}" ;;
    many_devices_16k) step 560 "$PY" -m benchmarks.bench_many_devices --sizes n16k_d2048,n16k_d4096 \
      --backends jnp_bf16,auto,fast --layouts 1dev,rows,vocab,both ;;
    side_by_side) step 545 "$PY" -m benchmarks.linear_side_by_side ;;
    fast_mode) step 240 "$PY" -m benchmarks.studies.bench_fast_mode ;;
    distill) step 540 "$PY" -m benchmarks.bench_distill --peak ;;
    topk_distill) step 420 "$PY" -m benchmarks.bench_topk_distill --runs 10 ;;
    sampler) step 540 "$PY" -m benchmarks.bench_sampler_logprobs --runs 10 ;;
    kept_set) step 240 "$PY" -m benchmarks.studies.bench_kept_set --runs 10 ;;
    sampler_forward) step 300 "$PY" -m benchmarks.studies.bench_sampler_forward --runs 10 ;;
    fast_loss) step 240 "$PY" -m benchmarks.studies.bench_fast_loss ;;
    tokens) step 590 "$PY" -m benchmarks.bench_tokens --torch --peers --runs 10 ${TOKENS_SIZES:+--sizes "$TOKENS_SIZES"} ;;
    # the realistic batch (benchmarks/realistic_batch.py), padded ~35 % and not at all
    # the PyTorch rows (TOKENS_TORCH=, TOKENS_PEERS= leave them out) time the same batch
    tokens_realistic) step 590 bash -c "$PY -m benchmarks.bench_tokens --batch realistic --padding 0.35 \
      ${TOKENS_TORCH---torch} ${TOKENS_PEERS---peers} --runs 10 --sizes ${TOKENS_SIZES:-realistic} --name bench_tokens_realistic_pad35 &&
      $PY -m benchmarks.bench_tokens --batch realistic --runs 10 --sizes ${TOKENS_SIZES:-realistic} \
      --name bench_tokens_realistic_pad0" ;;
    lean_chunks) step 420 "$PY" -m benchmarks.studies.bench_lean_chunks --runs 10 --rounds 2 ;;
    batch_invariant) step 590 "$PY" -m benchmarks.bench_batch_invariant --runs 10 --rounds 2 ;;
    batch_invariant_ffi) step 300 "$PY" -m benchmarks.bench_batch_invariant --backends ffi --sizes n1000_n4096 --runs 10 --rounds 2 --name bench_batch_invariant_ffi ;;
    e2e)   step 560 "$PY" -m benchmarks.e2e_grpo_step --budget "${E2E_BUDGET:-75}" ;;
    tunix) step 540 "$PY" -m benchmarks.bench_tunix ;;
    # the three head GEMMs alone (XLA) and inside lean / fast, per GEMM: TFLOP/s, share of the time
    head_gemms) step 240 "$PY" -m benchmarks.bench_head_gemms ${HEAD_GEMMS_SIZES:+--sizes "$HEAD_GEMMS_SIZES"} ;;
    device_times) step 420 "$PY" -m benchmarks.bench_linear --device-times ;;
    kernels) step 360 "$PY" -m benchmarks.studies.linear_kernels --kernels ;;
    fused) step 420 "$PY" -m benchmarks.studies.linear_kernels --fused --sizes "${FUSED_SIZES:-backward}" ;;
    timeline) step 300 bash -c "$PY -m benchmarks.bench_linear --timeline &&
      XLA_FLAGS=--xla_gpu_enable_command_buffer= $PY -m benchmarks.bench_linear --timeline" ;;
    clocks) step 540 bash -c "for kind in ${CLOCKS:-ops forward kernels chunks}; do
      $PY -m benchmarks.studies.linear_kernels --clocks \$kind || exit 1; done" ;;
    profile) step 240 "$PY" -m benchmarks.bench_linear --profile-backward vd,dv ;;
    # XLA's GEMM autotuning under the sanitizer is very slow, hence autotune level 0
    memcheck) step 300 bash -c "sanitizer=\$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS='--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0' \"\$sanitizer\" \
        --tool memcheck --kernel-name kns=jaxrl_sm90 --error-exitcode 1 $PY tests/support/ffi_memcheck.py \
        2>&1 | tee \"$BENCH_RESULTS/ffi_memcheck.txt\"; exit \${PIPESTATUS[0]}" ;;
    *) echo "== unknown step: $s"; status=1 ;;
  esac
done
exit $status
