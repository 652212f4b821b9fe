"""Timing, memory and reporting helpers shared by the benchmark scripts.

Timing: every script times through :func:`time_calls`, the one wall-clock timer: warm-up
calls first, then many synchronised calls (``block_until_ready``), their median and spread
(:class:`Timing`). :func:`median_ms`, :func:`pipelined_ms`, :func:`warm_up` and
:func:`rotated_ms` are that timer with the settings their names say. Device time comes from
a profiler trace (:func:`traced`, :func:`call_spans`). Memory comes from the compiled
executable (``memory_analysis``) and the device allocator. The PyTorch workers, which never
import JAX, time through the equivalent in ``benchmarks.torch_clock``.

Where results go (:func:`results_dir`): a scratch directory, ``out/bench`` under the
working directory, unless told otherwise: ``--out DIR`` or ``BENCH_RESULTS=DIR``;
``--update-results`` writes the committed ``benchmarks/results/`` (see
benchmarks/README.md).
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from benchmarks.output import RESULTS, SCRATCH, output_arguments, results_dir  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Timing:
    """What :func:`time_calls` measured: the milliseconds per call of each timed sample."""

    samples: tuple[float, ...]
    calls: int = 1
    """Calls per sample, back to back before one synchronisation."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Largest less smallest sample."""
        return max(self.samples) - min(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)


def time_calls(
    fn: Callable[..., Any],
    *args: Any,
    warmup: int = 3,
    runs: int = 25,
    calls: int = 1,
    arg_sets: Sequence[Sequence[Any]] | None = None,
    budget_ms: float | None = None,
    seconds: float | None = None,
    sync: Callable[[Any], Any] = jax.block_until_ready,
) -> Timing:
    """The benchmarks' one wall-clock timer: ``warmup`` calls of ``fn(*args)``, each
    synchronised (compilation, caches, clocks), then ``runs`` samples by the host clock, each
    ``calls`` calls back to back and one ``sync`` of the last result, in ms per call.

    ``calls`` > 1 lets the host enqueue the next call while the device runs this one, as a
    training loop does. ``arg_sets``: argument tuples taken in turn instead of ``args``
    (inputs that never sit in L2 between calls). ``budget_ms``: fewer runs for a slow ``fn``
    (at least 5, at most ``runs``), from the first warm-up call's time. ``seconds``: samples
    go on until this much time has passed (at least ``runs`` of them)."""
    sets = list(arg_sets) if arg_sets is not None else [args]
    count = 0

    def call():
        nonlocal count
        out = fn(*sets[count % len(sets)])
        count += 1
        return out

    first_ms = None
    for _ in range(warmup):
        start = time.perf_counter()
        sync(call())
        if first_ms is None:
            first_ms = 1e3 * (time.perf_counter() - start)
    if budget_ms is not None and first_ms is not None:
        runs = int(max(5, min(runs, budget_ms / max(first_ms, 1e-3))))
    end = None if seconds is None else time.perf_counter() + seconds
    samples = []
    while len(samples) < runs or (end is not None and time.perf_counter() < end):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        sync(out)
        samples.append(1e3 * (time.perf_counter() - start) / calls)
    return Timing(tuple(samples), calls)


def median_ms(fn: Callable[..., Any], *args: Any, warmup: int = 3, runs: int = 25) -> float:
    """Median wall time of ``fn(*args)`` in ms, synchronised: :func:`time_calls`."""
    return time_calls(fn, *args, warmup=warmup, runs=runs).median


def warm_up(fn: Callable[..., Any], *args: Any, seconds: float = 1.0) -> None:
    """Run ``fn(*args)`` back to back for ``seconds``: an idle GPU's clocks take a moment to
    rise, and the first variant timed would pay for it."""
    time_calls(fn, *args, warmup=0, runs=0, seconds=seconds)


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
    gpu_pids = {
        e["pid"]
        for e in meta
        if e.get("name") == "process_name" and "GPU" in str(e.get("args", {}).get("name", ""))
    }
    # kernels are on the "Stream" threads; the "XLA Ops" threads repeat them as HLO ops
    streams = {
        (e["pid"], e.get("tid"))
        for e in meta
        if e.get("pid") in gpu_pids
        and e.get("name") == "thread_name"
        and "stream" in str(e.get("args", {}).get("name", "")).lower()
    }
    timed_events = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted(
        (e for e in timed_events if (e.get("pid"), e.get("tid")) in streams), key=lambda e: e["ts"]
    )
    host = sorted((e for e in timed_events if e.get("pid") not in gpu_pids), key=lambda e: e["ts"])
    return kernels, host, meta


def kernels_by_call(kernels, host):
    """The kernels of a :func:`traced` run by call: per ``call<i>`` host annotation, in
    order, (that annotation, the kernels that started inside it)."""
    out = []
    for m in (e for e in host if re.fullmatch(r"call\d+", e["name"])):
        end = m["ts"] + m["dur"]
        out.append((m, [k for k in kernels if m["ts"] <= k["ts"] < end]))
    return out


def call_spans(fn, args, calls, match=None):
    """Per synchronised call of ``fn(*args)`` in one profiler trace: (lead, span, busy, tail,
    matched) in ms: host start of the call → its first kernel, first kernel start → last
    kernel end, the kernels' summed durations, last kernel end → the host's return, and the
    summed durations of the kernels whose name contains ``match`` (None without it)."""
    kernels, host, _ = traced(fn, args, calls)
    out = []
    for m, mine in kernels_by_call(kernels, host):
        end = m["ts"] + m["dur"]
        if mine:
            first, last = mine[0]["ts"], max(k["ts"] + k["dur"] for k in mine)
            matched = (
                None if match is None else sum(k["dur"] for k in mine if match in k["name"]) / 1e3
            )
            out.append(
                (
                    (first - m["ts"]) / 1e3,
                    (last - first) / 1e3,
                    sum(k["dur"] for k in mine) / 1e3,
                    (end - last) / 1e3,
                    matched,
                )
            )
    return out, kernels, host


KERNELS = ("fwd", "grad", "copy_ms", "absmax", "gemm_dh", "gemm_dh_splitk", "gemm_dw", "other")
"""The kinds :func:`kernel_kind` sorts the linear head's ffi kernels into."""


def kernel_kind(name: str) -> str:
    """The kind of one of the linear head's device kernels, by its name: ``fwd`` (the forward
    kernel), ``grad`` (the backward's grad kernel), ``copy_ms`` (the weight copy's own kernel),
    ``absmax`` (the first chunk's max |W|), ``gemm_dh`` / ``gemm_dh_splitk`` (d_hidden's
    CUTLASS GEMM, unsplit / split-K), ``gemm_dw`` (d_weight's), else ``other``."""
    if "linear_grad_kernel" in name:
        return "grad"
    if "weight_copy_kernel" in name:
        return "copy_ms"
    if "weight_absmax" in name:
        return "absmax"
    if "linear_lse_kernel" in name or "linear_stats" in name:
        return "fwd"
    if "GemmUniversal" in name:
        if "StreamK" in name:
            return "gemm_dh_splitk"
        return "gemm_dw" if ("bfloat16" in name or "half_tEvE" in name) else "gemm_dh"
    return "other"


def kernel_ms(fn, args, kinds, calls=3, kind_of=kernel_kind):
    """Mean device ms per call of ``fn(*args)`` by ``kind_of`` (a kernel's name -> its kind),
    over one profiler trace of ``calls`` calls: ``{kind: ms}`` for each of ``kinds`` (the kinds
    not among them count as ``"other"``, which ``kinds`` then holds)."""
    import collections

    _, kernels, _ = call_spans(fn, args, calls=calls)
    per = collections.Counter()
    for k in kernels:
        kind = kind_of(k["name"])
        per[kind if kind in kinds else "other"] += k["dur"] / 1e3 / calls
    return {kind: per.get(kind, 0.0) for kind in kinds}


def pipelined_ms(fn, args, reps=8, trials=7):
    """Per-call ms of ``reps`` back-to-back calls and one synchronisation (the host enqueues
    the next call while the device runs this one, as a training loop does): median of trials."""
    return time_calls(fn, *args, warmup=0, runs=trials, calls=reps).median


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
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = commit or "unknown"
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "commit": commit,
    }


def write_results(name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Write ``<name>.json`` and ``<name>.md`` (a table of ``columns``); return the table."""
    meta = metadata()
    path = results_dir()
    (path / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=1))
    lines = [
        f"{name}: {meta['device']}, {meta['date']}, jax {meta['jax']}, commit {meta['commit']}",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
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


def in_rotation(keys, rounds):
    """``keys`` in turn, ``rounds`` times, each round starting one further along (so that
    drift and order hit all alike)."""
    keys = list(keys)
    for r in range(rounds if keys else 0):
        yield from keys[r % len(keys) :] + keys[: r % len(keys)]


def rotated_ms(
    steps: Sequence[tuple[dict[str, Any], Callable[..., Any]]],
    args: Sequence[Any],
    *,
    runs: int,
    rounds: int,
    warm_seconds: float,
    warmup: int = 3,
    key: str = "fwdbwd_ms",
) -> dict[int, Timing]:
    """Time each ``(row, step)`` on ``args`` into ``row[key]``: the median over ``rounds``
    rounds, each in an order rotated by one (:func:`in_rotation`, so that no step always runs
    first or after the same one), of :func:`time_calls` of ``runs`` calls after
    :func:`warm_up`. Returns ``{id(row): Timing of its rounds' medians}`` (their spread)."""
    times: dict[int, list[float]] = {id(row): [] for row, _ in steps}
    for row, step in in_rotation(steps, rounds):
        warm_up(step, *args, seconds=warm_seconds)
        times[id(row)].append(time_calls(step, *args, warmup=warmup, runs=runs).median)
    out = {}
    for row, _ in steps:
        out[id(row)] = Timing(tuple(times[id(row)]))
        row[key] = out[id(row)].median
    return out


def sized_main(
    argv,
    *,
    description: str,
    sizes: dict[str, list],
    name: str,
    columns,
    measure: Callable[..., list],
    rounds: int,
) -> list[dict[str, Any]]:
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
    parser.add_argument(
        "--rounds",
        type=int,
        default=rounds,
        help="timing rounds, each in a rotated order (the median is kept)",
    )
    parser.add_argument("--name", default=name, help="the results' file name")
    args = parser.parse_args(argv)
    small = args.small or args.sizes == "small"
    rows: list[dict[str, Any]] = []
    for size in sizes["small" if small else args.sizes]:
        rows += measure(size, args.runs, args.rounds, small)
    print(write_results(args.name, rows, columns))
    return rows
