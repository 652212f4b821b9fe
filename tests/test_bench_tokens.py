"""benchmarks/bench_tokens.py runs end to end at toy sizes (``--small``) on any device, and
benchmarks/plot_tokens.py draws its result."""

import json
import os
import pathlib
import subprocess
import sys
import xml.dom.minidom

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bench_tokens_small_and_its_plot(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = ""  # one host device
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_tokens", "--small",
                           "--runs", "2", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "bench_tokens.json").read_text())
    by = {(r["impl"], r["N"]): r for r in data["rows"]}
    for n in (8, 64):
        for impl in ("jnp bf16", "ours lean", "ours fast", "3 GEMMs"):
            row = by[(impl, n)]
            assert row["fwdbwd_ms"] > 0 and row["temp_mib"] >= 0, row
            assert abs(row["us_per_token"] - 1e3 * row["fwdbwd_ms"] / n) < 1e-9, row
        assert by[("ours lean", n)]["floor_ms"] == 4 / 3 * by[("3 GEMMs", n)]["fwdbwd_ms"]
        assert by[("jnp bf16", n)]["x_jnp"] == 1.0

    svg = tmp_path / "tokens.svg"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.plot_tokens",
                           str(tmp_path / "bench_tokens.json"), str(svg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = xml.dom.minidom.parse(str(svg))
    # one line per impl and the lean floor, in the one (D, V) panel of the toy sizes
    assert len(doc.getElementsByTagName("polyline")) == 5
    assert data["meta"]["commit"] in svg.read_text()
