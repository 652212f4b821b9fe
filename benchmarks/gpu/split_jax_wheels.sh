#!/usr/bin/env bash
# Here (with network): download the four wheels of a newer jax for the GPU image (Python 3.12,
# CUDA 13) and cut them into parts that one device call can carry (under 60 MiB each):
#   bash benchmarks/gpu/split_jax_wheels.sh 0.12.0.1      -> .whl-jax/part-aa, part-ab, ...
# Then, on the device, one call per part, back to back while the machine stays warm:
#   run(command="STEPS=stage_jax bash benchmarks/gpu/run.sh", carry=[".whl-jax/part-aa"])  ...
# and last STEPS="... tests_new_jax" (reassembles the parts, installs that jax over the
# image's, runs the GPU tests again).
set -euo pipefail
cd "$(dirname "$0")/../.."
version=${1:?jax version, e.g. 0.12.0.1}
rm -rf .whl-jax && mkdir -p .whl-jax/wheels
python3 -m pip download -q --no-deps --python-version 3.12 --platform manylinux_2_27_x86_64 \
  --only-binary=:all: -d .whl-jax/wheels "jax==$version" "jaxlib==$version" \
  "jax-cuda13-plugin==$version" "jax-cuda13-pjrt==$version"
tar cf - -C .whl-jax wheels | split -b 56m - .whl-jax/part-
rm -rf .whl-jax/wheels
ls -l .whl-jax
