"""benchmarks/bench_packed.py runs end to end at toy sizes (``--small``) on any device: its rows
under both memory modes and the plain code's, the packed layout's padding below the padded
one's, the same real tokens in both, every row timed."""

import json

from tests.support.bench_run import run_benchmark

LAYOUTS = [
    "packed",
    "packed, no ids",
    "padded",
    "padded, every row",
    "padded, every row, none masked",
]


def test_bench_packed_small(tmp_path):
    run_benchmark(
        "benchmarks.bench_packed", "--small", "--runs", "2", "--out", str(tmp_path), timeout=300
    )
    records = json.loads((tmp_path / "bench_packed.json").read_text())["rows"]
    rows = {(r["memory"], r["impl"]): r for r in records}
    want = [(m, name) for m in ("lean", "fast") for name in LAYOUTS] + [("", "jnp bf16 padded")]
    assert list(rows) == want
    packed, padded = rows[("lean", "packed")], rows[("lean", "padded")]
    assert packed["padding"] < padded["padding"]
    real = lambda r: round(r["tokens"] * (1 - r["padding"]))  # noqa: E731
    assert real(packed) == real(padded)
    assert all(r["ms"] > 0 for r in records)
    assert all(r["vs_padded"] > 0 for r in records)
