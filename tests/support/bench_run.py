"""Run a benchmark module the way its smoke tests do: in a process of its own, from the repo
root, on host CPU devices (one unless asked: ``XLA_FLAGS`` set, the suite's forced device
count left out)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_benchmark(
    module: str, *args: str, timeout: int = 600, xla_flags: str = ""
) -> subprocess.CompletedProcess:
    """``python -m module *args`` on CPU (``xla_flags``: its ``XLA_FLAGS``, e.g. a host device
    count); fails the test unless it exits 0 (its output's tail in the message). Returns the
    finished process (``stdout`` for the tests that read it)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc
