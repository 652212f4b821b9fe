#!/usr/bin/env bash
# What README's install costs: its first command's install part,
#   python3 -m venv .venv && .venv/bin/pip install -e ".[demo]"
# timed from a fresh clone of this checkout's HEAD, once as a user runs it
# (JAXRL_KERNELS_BUILD_CUDA=AUTO: the CUDA extension is built only where a Hopper GPU is
# visible) and once with JAXRL_KERNELS_BUILD_CUDA=ON (the extension built; needs nvcc). Wall
# and CPU time (user + sys of every process the install ran, nvcc included) go to
# out/bench/install_time.md, or benchmarks/results/install_time.md with --update-results (or
# the file given), with the machine's load, so a time taken on a busy machine says so.
# pip's download cache is left as it is: run it twice to time the build, not the downloads.
#   bash benchmarks/install_time.sh [--update-results | FILE]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-}" in
  --update-results) out="$repo/benchmarks/results/install_time.md" ;;
  "") mkdir -p "$repo/out/bench"; out="$repo/out/bench/install_time.md" ;;
  *) out="$1" ;;
esac
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

nvcc_version="$(command -v nvcc >/dev/null && nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p' || echo none)"
{
  echo "# README's install, from a fresh clone"
  echo
  echo "\`bash benchmarks/install_time.sh\`, $(date -u '+%Y-%m-%d %H:%M UTC'), commit \`$(git -C "$repo" rev-parse --short HEAD)\`,"
  echo "$(nproc) cores, $(python3 --version), nvcc ${nvcc_version}."
  echo
  echo "| JAXRL_KERNELS_BUILD_CUDA | extension built | wall | CPU (user + sys) | load average before → after |"
  echo "|---|---|---|---|---|"
} > "$out.tmp"

for mode in AUTO ON; do
  git clone -q "$repo" "$work/$mode"
  cd "$work/$mode"
  before="$(cut -d' ' -f1 /proc/loadavg)"
  JAXRL_KERNELS_BUILD_CUDA=$mode /usr/bin/time -f "%e %U %S" -o time.txt \
    bash -c 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[demo]"' > install.log 2>&1
  after="$(cut -d' ' -f1 /proc/loadavg)"
  read -r wall user sys < time.txt
  built=no
  compgen -G ".venv/lib/python*/site-packages/jaxrl_kernels/_sm90*.so" >/dev/null && built=yes
  printf '| %s | %s | %.0f s | %.0f s | %s → %s |\n' "$mode" "$built" "$wall" \
    "$(awk "BEGIN {print $user + $sys}")" "$before" "$after" >> "$out.tmp"
  cd "$repo"
done
mv "$out.tmp" "$out"
cat "$out"
