"""benchmarks/bench_packed.py runs end to end at toy sizes (``--small``) on any device: its five
rows, the packed layout's padding below the padded one's, the same real tokens in both."""

import json

from tests.support.bench_run import run_benchmark


def test_bench_packed_small(tmp_path):
    run_benchmark(
        "benchmarks.bench_packed", "--small", "--runs", "2", "--out", str(tmp_path), timeout=300
    )
    rows = {r["impl"]: r for r in json.loads((tmp_path / "bench_packed.json").read_text())["rows"]}
    assert list(rows) == [
        "packed",
        "packed, no ids",
        "padded",
        "padded, every row",
        "jnp bf16 padded",
    ]
    packed, padded = rows["packed"], rows["padded"]
    assert packed["padding"] < padded["padding"]
    real = lambda r: round(r["tokens"] * (1 - r["padding"]))  # noqa: E731
    assert real(packed) == real(padded)
    assert all(r["ms"] > 0 for r in rows.values())
