"""Timing, memory and reporting helpers shared by the benchmark scripts.

Timing: compile and warm up first, then time many runs with ``block_until_ready``
and report the median. Memory comes from the compiled executable
(``memory_analysis``) and the device allocator.

Where results go (:func:`results_dir`): a scratch directory, ``out/bench`` under the
working directory, unless told otherwise: ``--out DIR`` or ``BENCH_RESULTS=DIR``;
``--update-results`` writes the committed ``benchmarks/results/`` (see
benchmarks/README.md).
"""

from __future__ import annotations

import datetime
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks.output import RESULTS, SCRATCH, output_arguments, results_dir  # noqa: F401


def median_ms(fn: Callable[..., Any], *args: Any, warmup: int = 3, runs: int = 25) -> float:
    """Median wall time of ``fn(*args)`` in ms, synchronised with ``block_until_ready``."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def warm_up(fn: Callable[..., Any], *args: Any, seconds: float = 1.0) -> None:
    """Run ``fn(*args)`` back to back for ``seconds``: an idle GPU's clocks take a moment to
    rise, and the first variant timed would pay for it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        jax.block_until_ready(fn(*args))


def traced(fn, args, calls=1):
    """Run ``calls`` synchronised calls of ``fn(*args)`` under a jax profiler trace (CUPTI):
    (device kernels, host events, the trace's metadata events), each event a perfetto dict
    with ts/dur in µs. Each call is wrapped in a host annotation named ``call<i>``."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for i in range(calls):
                with jax.profiler.TraceAnnotation(f"call{i}"):
                    jax.block_until_ready(fn(*args))
        [path] = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name" and
                "GPU" in str(e.get("args", {}).get("name", ""))}
    # kernels are on the "Stream" threads; the "XLA Ops" threads repeat them as HLO ops
    streams = {(e["pid"], e.get("tid")) for e in meta if e.get("pid") in gpu_pids and
               e.get("name") == "thread_name" and
               "stream" in str(e.get("args", {}).get("name", "")).lower()}
    timed_events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in timed_events if (e.get("pid"), e.get("tid")) in streams),
                     key=lambda e: e["ts"])
    host = sorted((e for e in timed_events if e.get("pid") not in gpu_pids),
                  key=lambda e: e["ts"])
    return kernels, host, meta


def call_spans(fn, args, calls, match=None):
    """Per synchronised call of ``fn(*args)`` in one profiler trace: (lead, span, busy, tail,
    matched) in ms: host start of the call → its first kernel, first kernel start → last
    kernel end, the kernels' summed durations, last kernel end → the host's return, and the
    summed durations of the kernels whose name contains ``match`` (None without it)."""
    kernels, host, _ = traced(fn, args, calls)
    out = []
    for m in (e for e in host if re.fullmatch(r"call\d+", e["name"])):
        end = m["ts"] + m["dur"]
        mine = [k for k in kernels if m["ts"] <= k["ts"] < end]
        if mine:
            first, last = mine[0]["ts"], max(k["ts"] + k["dur"] for k in mine)
            matched = None if match is None else sum(
                k["dur"] for k in mine if match in k["name"]) / 1e3
            out.append(((first - m["ts"]) / 1e3, (last - first) / 1e3,
                        sum(k["dur"] for k in mine) / 1e3, (end - last) / 1e3, matched))
    return out, kernels, host


def pipelined_ms(fn, args, reps=8, trials=7):
    """Per-call ms of ``reps`` back-to-back calls and one synchronisation (the host enqueues
    the next call while the device runs this one, as a training loop does): median of trials."""
    per_call = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append(1e3 * (time.perf_counter() - start) / reps)
    return statistics.median(per_call)


def temp_mib(jitted: Callable[..., Any], *args: Any) -> float:
    """XLA's temp buffer size of the compiled function, in MiB."""
    analysis = jitted.lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def peak_mib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


def copy_bandwidth_gbps(nbytes: int = 2**31) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    x = jax.numpy.ones((nbytes // 4,), jax.numpy.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    ms = median_ms(copy, x, runs=20)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def metadata() -> dict[str, Any]:
    commit = os.environ.get("JAXRL_KERNELS_COMMIT")  # the GPU machine's copy has no history
    try:
        if commit:
            raise OSError("commit given")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = commit or "unknown"
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "commit": commit,
    }


def write_results(name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Write ``<name>.json`` and ``<name>.md`` (a table of ``columns``); return the table."""
    meta = metadata()
    path = results_dir()
    (path / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1))
    lines = [f"{name}: {meta['device']}, {meta['date']}, jax {meta['jax']}, commit {meta['commit']}",
             "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for col in columns:
            val = row.get(col, "")
            if isinstance(val, float):  # small values (errors) keep 3 significant digits
                cells.append(f"{val:.3g}" if 0 < abs(val) < 0.01 else f"{val:.3f}")
            else:
                cells.append(str(val))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (path / f"{name}.md").write_text(table)
    print(f"wrote {path / name}.json and .md")
    return table


def rotated_ms(steps: Sequence[tuple[dict[str, Any], Callable[..., Any]]], args: Sequence[Any],
               *, runs: int, rounds: int, warm_seconds: float) -> None:
    """Time each ``(row, step)`` on ``args`` into ``row["fwdbwd_ms"]``: the median over
    ``rounds`` rounds, each in an order rotated by one, of :func:`median_ms` of ``runs`` calls
    after :func:`warm_up` (so that no step always runs first or after the same one)."""
    import statistics

    times: dict[int, list[float]] = {id(row): [] for row, _ in steps}
    for r in range(rounds):
        shift = r % max(len(steps), 1)
        for row, step in list(steps[shift:]) + list(steps[:shift]):
            warm_up(step, *args, seconds=warm_seconds)
            times[id(row)].append(median_ms(step, *args, runs=runs))
    for row, _ in steps:
        row["fwdbwd_ms"] = statistics.median(times[id(row)])


def sized_main(argv, *, description: str, sizes: dict[str, list], name: str, columns,
               measure: Callable[..., list], rounds: int) -> list[dict[str, Any]]:
    """A benchmark's command line: ``--sizes`` (a key of ``sizes``; ``--small`` for
    "small"), ``--runs``, ``--rounds``, ``--name`` and the output options; ``measure(size,
    runs, rounds, small)`` gives each size's rows, written as ``name``."""
    import argparse

    from benchmarks import output

    parser = argparse.ArgumentParser(description=description)
    output.output_arguments(parser)
    parser.add_argument("--sizes", default="full", choices=sorted(sizes))
    parser.add_argument("--small", action="store_true", help="toy sizes, any device")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=rounds,
                        help="timing rounds, each in a rotated order (the median is kept)")
    parser.add_argument("--name", default=name, help="the results' file name")
    args = parser.parse_args(argv)
    small = args.small or args.sizes == "small"
    rows: list[dict[str, Any]] = []
    for size in sizes["small" if small else args.sizes]:
        rows += measure(size, args.runs, args.rounds, small)
    print(write_results(args.name, rows, columns))
    return rows
