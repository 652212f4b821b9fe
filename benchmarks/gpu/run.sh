#!/usr/bin/env bash
# On an offline Hopper GPU machine: install the project, run the GPU tests, the
# benchmarks and a demo run; everything lands in $OUT as log.txt + results.tar.gz (re-packed
# after every step, so a run cut short still returns what it finished).
#   STEPS="tests ffi linear logits ppo demo"   what to run, in order (also: backward,
#                                              backward_base, profile, timeline, device_times,
#                                              gemm_schedules, clocks, kernels, fused,
#                                              linear_ffi, one_device, memcheck,
#                                              many_devices,
#                                              side_by_side, e2e)
#                                              tunix: needs the wheels of .whl/tunix;
#                                              stage_jax, tests_new_jax: GPU tests on a newer
#                                              jax, see split_jax_wheels.sh)
#   TESTS="tests"                              what the tests step gives pytest -m gpu
#   JAXRL_KERNELS_COMMIT=<sha>                 the commit to stamp results with (no .git there)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
export BENCH_RESULTS="$OUT/results" PYTHONUNBUFFERED=1
mkdir -p "$BENCH_RESULTS"
exec > >(tee -a "$OUT/log.txt") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then  # wheels the image lacks (nvidia-cutlass), copied in beside the checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# tunix and the few of its dependencies that the image lacks (google-tunix, google-metrax, clu,
# tensorboardX, perfetto: ~1.1 MB), for the tunix step and tests/test_tunix.py.
if compgen -G ".whl/tunix/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-tunix .whl/tunix/*.whl && export PYTHONPATH=/tmp/site-tunix${PYTHONPATH:+:$PYTHONPATH}
  python3 -c 'import tunix, flax, jax; print("tunix", tunix.__version__, "flax", flax.__version__, "jax", jax.__version__)'
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
start=$(date +%s)
# ON, not AUTO: a failed build is an error here, never a silent pure-Python install.
JAXRL_KERNELS_BUILD_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | grep -E "jaxrl_kernels: |Successfully installed|ERROR|error:" | tail -5
echo "install took $(( $(date +%s) - start )) s"
python3 -c 'import jax, jaxrl_kernels as jk; print(jax.devices(), {op: jk.available_backends(op) for op in ("linear_logprobs", "token_logprobs", "ppo_loss")})'

status=0
step() {  # step <seconds> <command...>: run it under a time limit, then re-pack the results
  local limit=$1; shift
  echo "== $* (limit ${limit}s)"
  timeout "$limit" "$@" || { echo "== FAILED ($?): $*"; status=1; }
  (cd "$OUT" && tar czf results.tar.gz results)
}
for s in ${STEPS-tests ffi linear logits ppo demo}; do
  case $s in
    tests) step 300 bash -c 'python3 -m pytest -m gpu -q -rs ${TESTS:-tests} 2>&1 | tee "$BENCH_RESULTS/gpu_tests.txt"; exit ${PIPESTATUS[0]}' ;;
    demo)  step 150 python3 -m jaxrl_kernels.demo --out "$BENCH_RESULTS/demo" ;;
    ppo_base) step 150 python3 -m benchmarks.bench_ppo --sizes base ;;
    backward) step 420 python3 -m benchmarks.bench_linear --backward ;;
    backward_base) step 300 python3 -m benchmarks.bench_linear --backward --sizes backward_base ;;
    linear_ffi) step 300 python3 -m benchmarks.bench_linear --backends ffi,pallas,reference ;;
    one_device) step 300 bash -c 'python3 -m benchmarks.bench_many_devices --layouts 1dev --sizes base &&
      python3 -m benchmarks.bench_many_devices --layouts 1dev' ;;
    # memcheck: XLA's GEMM autotuning under the sanitizer is very slow (a 330 s run finished
    # two cases), hence autotune level 0
    memcheck) step 300 bash -c 'sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" "$sanitizer" \
        --tool memcheck --kernel-name kns=jaxrl_sm90 --error-exitcode 1 python3 tests/ffi_memcheck.py \
        2>&1 | tee "$BENCH_RESULTS/ffi_memcheck.txt"; exit ${PIPESTATUS[0]}' ;;
    fused) step 420 python3 -m benchmarks.bench_linear --fused --sizes ${FUSED_SIZES:-backward} ;;
    kernels) step 360 python3 -m benchmarks.bench_linear --kernels ;;
    timeline) step 300 bash -c 'python3 -m benchmarks.bench_linear --timeline &&
      XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 -m benchmarks.bench_linear --timeline' ;;
    gemm_schedules) step 420 python3 -m benchmarks.bench_linear --gemm-schedules --sizes ${FUSED_SIZES:-backward} ;;
    clocks) step 540 bash -c 'for kind in ${CLOCKS:-ops forward kernels chunks}; do
      python3 -m benchmarks.bench_linear --clocks $kind || exit 1; done' ;;
    device_times) step 420 python3 -m benchmarks.bench_linear --device-times ;;
    profile) step 240 python3 -m benchmarks.bench_linear --profile-backward vd,dv ;;
    many_devices) step 480 bash -c 'python3 -m benchmarks.bench_many_devices &&
      python3 -m benchmarks.bench_many_devices --explicit --backends auto' ;;
    side_by_side) step 480 bash -c 'if compgen -G ".whl/peers/*.whl" >/dev/null; then  # tokamax, Liger, CCE
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target /tmp/peers .whl/peers/*.whl && export PYTHONPATH=/tmp/peers${PYTHONPATH:+:$PYTHONPATH}
      fi; python3 -m benchmarks.linear_side_by_side' ;;
    e2e)   step 420 python3 -m benchmarks.e2e_grpo_step ;;
    tunix) step 540 python3 -m benchmarks.bench_tunix ;;
    # a newer jax than the image's, copied in as parts (split_jax_wheels.sh);
    # installed over the image's jax, so it is the run's last step
    stage_jax) step 60 bash -c 'mkdir -p /tmp/jax-parts && cp .whl-jax/part-* /tmp/jax-parts/ && ls -l /tmp/jax-parts' ;;
    tests_new_jax) step 420 bash -c 'rm -rf /tmp/jax-wheels && mkdir -p /tmp/jax-wheels &&
      cat /tmp/jax-parts/part-* | tar xf - -C /tmp/jax-wheels &&
      python3 -m pip install -q --no-index --no-deps --force-reinstall /tmp/jax-wheels/wheels/*.whl &&
      python3 -c "import jax; print(\"jax\", jax.__version__, jax.devices())" | tee "$BENCH_RESULTS/gpu_tests_new_jax.txt" &&
      python3 -m pytest -m gpu -q -rs ${TESTS:-tests} 2>&1 | tee -a "$BENCH_RESULTS/gpu_tests_new_jax.txt"; exit ${PIPESTATUS[0]}' ;;
    *)     step 200 python3 -m "benchmarks.bench_$s" ;;
  esac
done
exit $status
