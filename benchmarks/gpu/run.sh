#!/usr/bin/env bash
# On a lent Hopper GPU machine (offline): install the project, run the GPU tests and the
# benchmarks; everything lands in $OUT (log.txt + results.tar.gz, at most 8 files come back).
#   BENCHES="logits ppo linear ffi"  which benchmarks/bench_<name>.py to run
#   TESTS="tests"                    what pytest -m gpu collects ("" skips the tests)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
export BENCH_RESULTS="$OUT/results" PYTHONUNBUFFERED=1
mkdir -p "$BENCH_RESULTS"
exec > >(tee -a "$OUT/log.txt") 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels the image lacks (e.g. nvidia-cutlass)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -2
echo "install took $(( $(date +%s) - start )) s"
python3 -c 'import jax, jaxrl_kernels as jk; print(jax.devices(), {op: jk.available_backends(op) for op in ("linear_logprobs", "token_logprobs", "ppo_loss")})'

status=0
if [ -n "${TESTS-tests}" ]; then
  python3 -m pytest -m gpu -q -rs ${TESTS-tests} 2>&1 | tee "$BENCH_RESULTS/gpu_tests.txt"
  status=${PIPESTATUS[0]}
fi
for bench in ${BENCHES-logits ppo linear ffi}; do
  echo "== benchmarks/bench_$bench.py"
  python3 -m "benchmarks.bench_$bench" || status=1
done
(cd "$OUT" && tar czf results.tar.gz results && rm -rf results)
exit $status
