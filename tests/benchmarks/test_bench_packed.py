"""benchmarks/bench_packed.py runs end to end at toy sizes (``--small``) on any device: its four
rows, the packed layout's padding below the padded one's, the same real tokens in both."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_packed_small(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = ""  # one host device
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_packed",
            "--small",
            "--runs",
            "2",
            "--out",
            str(tmp_path),
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "bench_packed.json").read_text())["rows"]}
    assert list(rows) == ["packed", "packed, no ids", "padded", "jnp bf16 padded"]
    packed, padded = rows["packed"], rows["padded"]
    assert packed["padding"] < padded["padding"]
    real = lambda r: round(r["tokens"] * (1 - r["padding"]))  # noqa: E731
    assert real(packed) == real(padded)
    assert all(r["ms"] > 0 for r in rows.values())
