"""Timing, memory and reporting helpers shared by the benchmark scripts.

Timing follows the device tool's METHOD.md: compile and warm up first, then
time many runs with ``block_until_ready`` and report the median. Memory comes
from the compiled executable (``memory_analysis``) and the device allocator.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


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


def results_dir() -> pathlib.Path:
    """BENCH_RESULTS, else the device tool's $OUT, else benchmarks/results."""
    out = os.environ.get("BENCH_RESULTS") or os.environ.get("OUT")
    path = pathlib.Path(out) if out else pathlib.Path(__file__).parent / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


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
    return table
