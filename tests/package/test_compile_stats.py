"""tests/support/compile_stats.py, the plugin tests/DURATIONS.md measures compiling with: it
counts an op run outside jax.jit (short compiles, one per primitive) and a jitted program,
under the file of the test that compiled them, with and without pytest-xdist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import jax
import jax.numpy as jnp


def test_eager():
    (jnp.exp(jnp.ones(3)) * 2 + 1).block_until_ready()


def test_jitted():
    jax.jit(lambda x: jnp.cumsum(jnp.sin(x) ** 2))(jnp.ones(5)).block_until_ready()
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one_process", "xdist"])
def test_counts_per_file(tmp_path, workers):
    path = tmp_path / "test_tiny.py"
    path.write_text(TESTS)
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a cache hit from another run would still count
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "tests.support.compile_stats", *workers, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {
        m.group(5): [int(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(4))]
        for m in re.finditer(
            r"^ *(\d+) +([\d.]+) +(\d+) +([\d.]+)  (.+)$", run.stdout, re.MULTILINE
        )
    }
    mine = [row for name, row in rows.items() if name.endswith("test_tiny.py")]
    assert len(mine) == 1, run.stdout
    short, _, long, _ = mine[0]
    # the eager line compiles exp, mul and add on their own; the jitted test one program
    assert short + long >= 4, run.stdout
    assert rows["(all)"][0] >= short and rows["(all)"][2] >= long, run.stdout
