#!/usr/bin/env bash
# On a machine with network: download the wheels that the offline GPU machine (image 'cuda':
# Python 3.12, Linux x86_64, CUDA 13, no network) lacks for benchmarks/gpu/run.sh, into .whl/
# (git-ignored). pip downloads with --no-deps: each set below names every dependency that the
# image does not already hold and that the imports we use need (checked in a scratch venv that
# mirrors the image's packages); the image's own packages (jax, flax, torch, triton, numpy,
# transformers, cuda-bindings, protobuf, ...) are never staged.
#   .whl/*.whl      nvidia-cutlass: the CUTLASS/CuTe C++ headers that the CUDA extension builds
#                   against (csrc/jaxrl_kernels_build.py pins 4.2.0.0; CMake finds them at
#                   cutlass_library/source/include without importing it, so none of its
#                   Python dependencies are needed)
#   .whl/tunix/     google-tunix (the version in benchmarks/results/bench_tunix.json) and what
#                   `import tunix`, tunix.rl.{grpo,ppo}, tunix.sft.peft_trainer and
#                   tunix.models.* import that the image lacks
#   .whl/peers/     the side_by_side peers: tokamax, Liger, Cut Cross-Entropy and tokamax's
#                   missing imports (xprof, a 22 MB wheel, is stubbed by
#                   benchmarks/side_by_side/jax_worker.py and not staged)
#   .whl/quack/     QuACK (quack-kernels) with the CuTe DSL for CUDA 13 (nvidia-cutlass-dsl and
#                   its libs-base, libs-core, libs-cu13; not libs-cu12, which its metadata names
#                   too but which a CUDA 13 machine does not load), apache-tvm-ffi,
#                   torch-c-dlpack-ext, and jax-tvm-ffi (quack's optional [jax] extra)
# Each call to the GPU machine carries at most 64 MiB, so the QuACK set (about 98 MiB, the cu13
# libs wheel alone 92 MB) is also cut into two parts of at most 57 MiB (tar | split), to carry
# in two calls to one warm machine: the first part alone (with the ~5 MiB checkout), the
# second (about 40 MiB) with .whl (about 14 MiB) in the call that runs the benchmark:
# .whl-quack/part-aa, part-ab when git ignores
# .whl-quack/, else .whl/quack-parts/ (an unignored folder would travel with every call and
# break them all); QUACK_PARTS=<dir> picks another. On the GPU machine, with the parts copied to
# /tmp/quack-parts:
#   mkdir -p /tmp/quack-wheels && cat /tmp/quack-parts/part-* | tar xf - -C /tmp/quack-wheels &&
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/quack \
#     /tmp/quack-wheels/quack/*.whl      # the tar holds quack/*.whl
#   export PYTHONPATH=/tmp/quack:/tmp/quack/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
# (the second entry does what nvidia-cutlass-dsl's .pth file does in a site-packages; with
# --target no .pth file is read, and `import cutlass` fails without it).
# Idempotent: wheels already there are kept, wheels of other versions are removed, and the parts
# are cut anew. Run from the repo root: bash benchmarks/gpu/stage_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)

TOP=(nvidia-cutlass==4.2.0.0)
TUNIX=(
  google-tunix==0.1.7
  google-metrax==0.2.4     # metrax: tunix.sft.metrics_logger
  clu==0.0.12              # metrax's metrics
  tensorboardx==2.6.5      # metrax's logging
  perfetto==0.59.1         # tunix.rl's tracing
  immutabledict==4.3.1     # tunix.models.naming (automodel, registry)
)
PEERS=(
  tokamax==0.0.17
  liger-kernel==0.8.5      # needs torch, triton: in the image
  cut-cross-entropy==25.1.1
  qwix==0.1.8              # tokamax
  einshape==1.0            # tokamax
  immutabledict==4.3.1     # tokamax
  pydantic==2.12.5         # tokamax (>=2.11); not in the image's package list. 2.12.5 asks
  pydantic-core==2.41.5    #   typing-extensions>=4.14.1 only; pydantic pins this core
  annotated-types==0.7.0
  typing-inspection==0.4.2
)
QUACK=(
  quack-kernels==0.6.5
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
  jax-tvm-ffi==0.1.3       # optional: quack's [jax] extra (quack.softmax_jax)
)
PART_SIZE=57m

failed=()
norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }

# stage <dir> <name==version>...: download each wheel into <dir>; remove any other wheel there
stage() {
  local dir=$1; shift
  mkdir -p "$dir"
  local keep=() spec out
  for spec in "$@"; do
    keep+=("$(norm "${spec%%==*}")-${spec#*==}")
    if out=$("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
             --implementation cp "${PLATFORMS[@]}" -d "$dir" "$spec" 2>&1); then
      echo "  ok      $spec"
    else
      echo "  FAILED  $spec"
      failed+=("$spec: $(grep -E '^ERROR' <<<"$out" | tr '\n' ' ')")
    fi
  done
  local f base k found
  for f in "$dir"/*.whl; do
    [ -e "$f" ] || continue
    base=$(basename "$f"); found=0
    for k in "${keep[@]}"; do
      # wheel file names: <dist with _>-<version>-...
      if [ "$(norm "${base%%-*}")-$(cut -d- -f2 <<<"$base")" = "$k" ]; then found=1; fi
    done
    if [ $found = 0 ]; then echo "  removed $base (not in this set)"; rm -f "$f"; fi
  done
}

echo "== .whl (nvidia-cutlass headers)"; stage .whl "${TOP[@]}"
echo "== .whl/tunix";                    stage .whl/tunix "${TUNIX[@]}"
echo "== .whl/peers";                    stage .whl/peers "${PEERS[@]}"
echo "== .whl/quack";                    stage .whl/quack "${QUACK[@]}"

# -- the QuACK parts -----------------------------------------------------------------------------
parts=${QUACK_PARTS:-}
if [ -z "$parts" ]; then
  parts=.whl-quack
  if ! git check-ignore -q .whl-quack/part-aa 2>/dev/null; then parts=.whl/quack-parts; fi
fi
case "${parts%/}" in
  ""|/|.|..|.whl|.whl/quack|.whl/tunix|.whl/peers|.git|.git/*) echo "QUACK_PARTS=$parts: no" >&2; exit 2 ;;
esac
quack_bytes=$(cat .whl/quack/*.whl 2>/dev/null | wc -c || true)
rm -rf "$parts"
if [ "$parts" != .whl/quack-parts ]; then rm -rf .whl/quack-parts; fi  # an earlier fallback's
if [ "$quack_bytes" -gt $((57 * 1024 * 1024)) ]; then
  if [ "$parts" = .whl/quack-parts ] && [ -z "${QUACK_PARTS:-}" ]; then
    echo "note: git does not ignore .whl-quack/ (an unignored folder travels with every call)," \
         "so the parts go to .whl/quack-parts; add /.whl-quack/ to .gitignore for .whl-quack/"
  fi
  mkdir -p "$parts"
  # sorted, with fixed owners and times: the same wheels give the same parts
  tar cf - -C .whl --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 quack \
    | split -b "$PART_SIZE" - "$parts/part-"
  (cd "$parts" && cat part-* | sha256sum | sed 's/-$/parts joined (tar)/' > SHA256SUMS)
  echo "== $parts (the QuACK set cut into parts of at most $PART_SIZE)"
  ls -l "$parts"
fi

echo "== sizes"
for d in .whl .whl/tunix .whl/peers .whl/quack; do
  echo "-- $d"; { ls -l "$d"/*.whl 2>/dev/null || true; } | awk '{printf "  %10d  %s\n", $5, $NF}'
done
du -sh .whl/tunix .whl/peers .whl/quack $([ -d "$parts" ] && echo "$parts")
echo "what run.sh stages (.whl/*.whl + .whl/tunix + .whl/peers): $({ cat .whl/*.whl .whl/tunix/*.whl .whl/peers/*.whl 2>/dev/null || true; } | wc -c | awk '{printf "%.1f MiB", $1 / 1048576}')"
echo "QuACK set: $(awk -v b="$quack_bytes" 'BEGIN {printf "%.1f MiB", b / 1048576}')"

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED downloads"; printf '  %s\n' "${failed[@]}"; exit 1
fi
