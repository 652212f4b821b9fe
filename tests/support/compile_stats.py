"""A pytest plugin that measures how much of a test run is XLA compiling, per test file.

    python -m pytest -p tests.support.compile_stats [pytest's options and paths]

It times every call of jax's compile step (``jax._src.compiler.compile_or_get_cached``, a jax
internal: the plugin fails at start-up if it is gone) and sorts each compile into

* *short*, under :data:`SHORT_S`: in these tests mostly an op run outside ``jax.jit``, where
  jax compiles each primitive as a program of its own at each new shape and dtype (XLA:CPU
  takes tens of milliseconds even for one ``exp``);
* *long*: a jitted program (``jax.jit``, ``jax.grad`` of a jitted function, a
  ``custom_partitioning`` call's whole body).

At the end it prints, per test file, the count and seconds of each kind, and the totals. Under
pytest-xdist each worker counts its own tests and the controller adds them up (each worker's
``workeroutput``, refreshed after every test). Compiles outside a test (collection, fixtures at
module scope) count under ``(outside a test)``. A persistent compilation cache hit is timed as a
compile (its lookup).
"""

from __future__ import annotations

import collections
import os
import time

import pytest

SHORT_S = 0.1
_OUTSIDE = "(outside a test)"
_KEY = "compile_stats"


def _test_file() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.split("::", 1)[0] if current else _OUTSIDE


class _Stats:
    """``{file: [short count, short s, long count, long s]}``, filled by the wrapped compile."""

    def __init__(self):
        self.by_file = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])

    def add(self, path: str, seconds: float) -> None:
        row = self.by_file[path]
        at = 0 if seconds < SHORT_S else 2
        row[at] += 1
        row[at + 1] += seconds

    def merge(self, other: dict) -> None:
        for path, row in other.items():
            mine = self.by_file[path]
            for i, value in enumerate(row):
                mine[i] += value


def _wrap_compile(stats: _Stats) -> None:
    from jax._src import compiler

    original = compiler.compile_or_get_cached

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            stats.add(_test_file(), time.perf_counter() - start)

    compiler.compile_or_get_cached = timed


_STASH = pytest.StashKey[_Stats]()


def pytest_configure(config):
    stats = _Stats()
    config.stash[_STASH] = stats
    _wrap_compile(stats)


def pytest_runtest_teardown(item):
    workeroutput = getattr(item.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the counts so far, for the controller
        workeroutput[_KEY] = dict(item.config.stash[_STASH].by_file)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller's side under xdist: add a finished worker's counts."""
    counts = getattr(node, "workeroutput", {}).get(_KEY)
    if counts:
        node.config.stash[_STASH].merge(counts)


def pytest_terminal_summary(terminalreporter):
    by_file = terminalreporter.config.stash[_STASH].by_file
    if not by_file:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"XLA compiles per test file (short: under {SHORT_S} s)")
    write(f"{'short':>7} {'short s':>8} {'long':>6} {'long s':>8}  file")
    total = [0, 0.0, 0, 0.0]
    for path, row in sorted(by_file.items(), key=lambda item: -(item[1][1] + item[1][3])):
        write(f"{row[0]:7d} {row[1]:8.1f} {row[2]:6d} {row[3]:8.1f}  {path}")
        total = [t + r for t, r in zip(total, row)]
    write(f"{total[0]:7d} {total[1]:8.1f} {total[2]:6d} {total[3]:8.1f}  (all)")
