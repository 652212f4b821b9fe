#!/usr/bin/env bash
# Build the CUDA extension on this machine (nvcc 13, network; no GPU needed) for the offline GPU
# machine, so that benchmarks/gpu/run.sh there skips its nvcc build (about 70 s of every call on
# 16 cores). Writes .prebuilt/ (git-ignored; copy it in beside .whl):
#   _sm90.*.so       built with JAXRL_KERNELS_BUILD_CUDA=ON and the measurement handlers, as
#                    run.sh builds it, against the XLA FFI headers of the GPU image's jaxlib
#   SOURCES.sha256   the hash of the sources it was built from (benchmarks/gpu/sources_hash.sh);
#                    run.sh uses the extension only where its tree hashes the same
#   BUILD.txt        what built it: jaxlib, nvcc, date
#   JAXLIB=0.11.2    the jaxlib whose headers to build against (the GPU image's)
set -euo pipefail
cd "$(dirname "$0")/../.."
JAXLIB=${JAXLIB:-0.11.2}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# An isolated build whose jaxlib (headers only) is the image's: pip applies the constraint to
# the build environment too.
echo "jaxlib==$JAXLIB" >"$tmp/constraints.txt"
start=$(date +%s)
PIP_CONSTRAINT="$tmp/constraints.txt" JAXRL_KERNELS_BUILD_CUDA=ON \
  JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  python3 -m pip wheel -q --no-deps -w "$tmp/dist" --config-settings=build-dir="$tmp/build" .
rm -rf .prebuilt && mkdir -p .prebuilt
python3 -m zipfile -e "$tmp"/dist/jaxrl_kernels-*.whl "$tmp/wheel"
cp "$tmp"/wheel/jaxrl_kernels/_sm90*.so .prebuilt/
bash benchmarks/gpu/sources_hash.sh >.prebuilt/SOURCES.sha256
echo "jaxlib $JAXLIB headers; $(nvcc --version | tail -1); $(date -u +'%F %H:%M UTC')" >.prebuilt/BUILD.txt
echo "built in $(($(date +%s) - start)) s: $(ls .prebuilt/_sm90*.so); $(cat .prebuilt/BUILD.txt)"
