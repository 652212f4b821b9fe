#!/usr/bin/env bash
# The whole many-device grid (tests/sharding/test_sharding_grid.py, marker grid_full) on the CPU,
# split over processes: shard i of n runs every n-th case (JAXRL_TEST_GRID_SHARD=i/n), shards
# FIRST..LAST-1 at once. Each shard's pytest -v log goes to $GRID_LOGS/shard-<i>.log as it runs,
# so a run cut short still shows every case it finished; the summary counts them.
#   bash tests/support/run_full_grid.sh [FIRST LAST N]      default 0 N N, N = the number of cores
# With GRID_IDS=<file of pytest node ids>, shard i runs lines i, i+n, ... of that file instead
# (to finish a run that was cut short).
# Needs no GPU (JAX_PLATFORMS=cpu); pallas runs in interpret mode.
set -uo pipefail
cd "$(dirname "$0")/../.."
cores=$(nproc)
n=${3:-$cores}
first=${1:-0}
last=${2:-$n}
logs=${GRID_LOGS:-${OUT:-/tmp}/grid}
mkdir -p "$logs"
python=${PYTHON:-python3}
export JAX_PLATFORMS=cpu JAXRL_TEST_GRID=full JAXRL_TEST_PALLAS=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# one process per core: XLA's CPU runtime single-threaded in each
export XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 ${XLA_FLAGS:-}"
echo "grid: shards $first..$((last - 1)) of $n on $cores cores, logs in $logs"
start=$(date +%s)
for ((i = first; i < last; i++)); do
  if [ -n "${GRID_IDS:-}" ]; then
    mapfile -t ids < <(awk -v i="$i" -v n="$n" 'NF && (NR - 1) % n == i' "$GRID_IDS")
    "$python" -m pytest -m grid_full -v -p no:cacheprovider "${ids[@]}" > "$logs/shard-$i.log" 2>&1 &
  else
    JAXRL_TEST_GRID_SHARD="$i/$n" "$python" -m pytest -m grid_full -v -p no:cacheprovider \
      tests/sharding/test_sharding_grid.py > "$logs/shard-$i.log" 2>&1 &
  fi
done
wait
echo "grid: took $(( $(date +%s) - start )) s"
these=$(for ((i = first; i < last; i++)); do echo "$logs/shard-$i.log"; done)
passed=$(cat $these | grep -c " PASSED")
failed=$(cat $these | grep -c " FAILED\| ERROR")
echo "grid: $passed passed, $failed failed or errored"
grep -h " FAILED\| ERROR" $these | head -50
for ((i = first; i < last; i++)); do tail -1 "$logs/shard-$i.log"; done
[ "$failed" -eq 0 ]
