#!/usr/bin/env bash
# The offline GPU machine's run: stage what the machine lacks (no network there), install the
# project with its CUDA extension, then run benchmark steps (benchmarks/steps.sh) and pack
# everything into $OUT as log.txt + results.tar.gz (re-packed after every step, so a run cut
# short still returns what it finished). On your own GPU machine with network you need none of
# this: see benchmarks/README.md.
#   STEPS="tests linear logits ppo demo"       what to run, in order: any step of
#                                              benchmarks/steps.sh (the studies' too), and
#                                              stage_jax / tests_new_jax (a newer jax,
#                                              split_jax_wheels.sh)
#   TESTS="tests"                              what the tests step gives pytest -m gpu
#   JAXRL_KERNELS_COMMIT=<sha>                 the commit to stamp results with (no .git there)
# Staged beside the checkout: .whl/*.whl (nvidia-cutlass, the extension's headers),
# .whl/tunix/*.whl (tunix and the few of its dependencies the image lacks), .whl/peers/*.whl
# (tokamax, Liger, Cut Cross-Entropy for the side_by_side step), .whl-quack/part-* (QuACK,
# in two parts: carry one per call), .whl-jax/part-* (stage_jax). benchmarks/gpu/stage_wheels.sh
# downloads them all. .prebuilt/ (benchmarks/gpu/prebuild.sh): the extension, built elsewhere
# from the same sources, in place of this machine's build.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
export BENCH_RESULTS="$OUT/results" PYTHONUNBUFFERED=1
mkdir -p "$BENCH_RESULTS"
exec > >(tee -a "$OUT/log.txt") 2>&1

# -- staging -----------------------------------------------------------------------------------
stage() {  # stage <dir> <glob>: install the wheels there into <dir>, put it on PYTHONPATH
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$1" $2 && export PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}"
}
if compgen -G ".whl/*.whl" >/dev/null; then stage /tmp/site ".whl/*.whl"; fi
if compgen -G ".whl/tunix/*.whl" >/dev/null; then
  stage /tmp/site-tunix ".whl/tunix/*.whl"
  python3 -c 'import tunix, flax, jax; print("tunix", tunix.__version__, "flax", flax.__version__, "jax", jax.__version__)'
fi
if compgen -G ".whl/peers/*.whl" >/dev/null; then stage /tmp/peers ".whl/peers/*.whl"; fi
# QuACK comes in parts (.whl-quack/part-*, stage_wheels.sh), a part per call to one warm
# machine; once the parts add up to the checksum it is installed under a path holding
# /site-packages/ (its kernel cache needs one), and every later call puts it on PYTHONPATH.
if compgen -G ".whl-quack/part-*" >/dev/null; then
  mkdir -p /tmp/quack-parts && cp .whl-quack/part-* .whl-quack/SHA256SUMS /tmp/quack-parts/
fi
if [ ! -d /tmp/quack/site-packages ] && [ -f /tmp/quack-parts/SHA256SUMS ]; then
  if [ "$(cat /tmp/quack-parts/part-* | sha256sum | cut -d' ' -f1)" = "$(cut -d' ' -f1 /tmp/quack-parts/SHA256SUMS)" ]; then
    mkdir -p /tmp/quack-wheels && cat /tmp/quack-parts/part-* | tar xf - -C /tmp/quack-wheels &&
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/quack/site-packages /tmp/quack-wheels/quack/*.whl
  else
    echo "quack: $(ls /tmp/quack-parts | grep -c part-) part(s) so far, not all of them"
  fi
fi
if [ -d /tmp/quack/site-packages ]; then
  export PYTHONPATH="/tmp/quack/site-packages:/tmp/quack/site-packages/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c 'import quack, cutlass; print("quack", quack.__version__)' || echo "quack: import failed"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
start=$(date +%s)
# A prebuilt extension (.prebuilt/, benchmarks/gpu/prebuild.sh) is used only where it was built
# from these very sources; the tree then runs from the checkout (PYTHONPATH), uninstalled.
if [ -f .prebuilt/SOURCES.sha256 ] && [ "$(cat .prebuilt/SOURCES.sha256)" = "$(bash benchmarks/gpu/sources_hash.sh)" ]; then
  # An earlier call's editable install on this machine would import its own build instead.
  python3 -m pip uninstall -q -y jaxrl_kernels >/dev/null 2>&1
  cp .prebuilt/_sm90*.so jaxrl_kernels/ && export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "jaxrl_kernels: the prebuilt extension ($(cat .prebuilt/BUILD.txt)), no build"
else
  if [ -d .prebuilt ]; then echo "jaxrl_kernels: .prebuilt/ was built from other sources: building"; fi
  rm -f jaxrl_kernels/_sm90*.so  # an earlier call's prebuilt copy would shadow this build
  # ON, not AUTO: a failed build is an error here, never a silent pure-Python install. With the
  # measurement-only handlers (csrc/ffi_variants.cc): the GPU tests and variant benchmarks call them.
  JAXRL_KERNELS_BUILD_CUDA=ON JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | grep -E "jaxrl_kernels: |Successfully installed|ERROR|error:" | tail -5
fi
echo "install took $(( $(date +%s) - start )) s"
python3 -c 'import jax, jaxrl_kernels as jk; print(jax.devices(), {op: jk.available_backends(op) for op in ("linear_logprobs", "token_logprobs", "ppo_loss")})'

# -- the steps ---------------------------------------------------------------------------------
pack='cd "$OUT" && tar czf results.tar.gz results'
export OUT AFTER_STEP=$pack
status=0
for s in ${STEPS-tests linear logits ppo demo}; do
  case $s in
    # a newer jax than the image's, copied in as parts (split_jax_wheels.sh); installed over
    # the image's jax, so it is the run's last step
    stage_jax) mkdir -p /tmp/jax-parts && cp .whl-jax/part-* /tmp/jax-parts/ && ls -l /tmp/jax-parts || status=1 ;;
    tests_new_jax) timeout 420 bash -c 'rm -rf /tmp/jax-wheels && mkdir -p /tmp/jax-wheels &&
      cat /tmp/jax-parts/part-* | tar xf - -C /tmp/jax-wheels &&
      python3 -m pip install -q --no-index --no-deps --force-reinstall /tmp/jax-wheels/wheels/*.whl &&
      python3 -c "import jax; print(\"jax\", jax.__version__, jax.devices())" | tee "$BENCH_RESULTS/gpu_tests_new_jax.txt" &&
      python3 -m pytest -m gpu -q -rs ${TESTS:-tests} 2>&1 | tee -a "$BENCH_RESULTS/gpu_tests_new_jax.txt"; exit ${PIPESTATUS[0]}' || status=1
      bash -c "$pack" ;;
    *) bash benchmarks/steps.sh "$s" || status=1 ;;
  esac
done
exit $status
