#!/usr/bin/env bash
# On a machine with network: download the four wheels of a newer jax for the offline GPU
# machine's image (Python 3.12, CUDA 13) and cut them into parts of 56 MiB, for transfers that
# limit file sizes:
#   bash benchmarks/gpu/split_jax_wheels.sh 0.12.0.1      -> .whl-jax/part-aa, part-ab, ...
# Then, with the parts in .whl-jax/ on the GPU machine:
#   STEPS="stage_jax tests_new_jax" bash benchmarks/gpu/run.sh
# (reassembles the parts, installs that jax over the image's, runs the GPU tests again).
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
