"""benchmarks/bench_tokens.py runs end to end at toy sizes (``--small``) on any device, its
peers (``--peers``: QuACK, Liger) included, which leave rows with an error where they cannot
run; benchmarks/plot_tokens.py draws its result with matplotlib, a line per impl with times,
to SVG or PNG by the output's extension."""

import json
import xml.dom.minidom

import pytest

from tests.support.bench_run import run_benchmark


def drawn(fig):
    """The labels of the lines of each panel of a plot_tokens figure."""
    return [[line.get_label() for line in ax.get_lines()] for ax in fig.axes]


def test_bench_tokens_small_and_its_plot(tmp_path):
    proc = run_benchmark(
        "benchmarks.bench_tokens", "--small", "--runs", "2", "--peers", "--out", str(tmp_path)
    )
    data = json.loads((tmp_path / "bench_tokens.json").read_text())
    by = {(r["impl"], r.get("N")): r for r in data["rows"]}
    for n in (8, 64):
        for impl in ("jnp bf16", "ours lean", "ours fast", "3 GEMMs"):
            row = by[(impl, n)]
            assert row["fwdbwd_ms"] > 0 and row["temp_mib"] >= 0, row
            assert abs(row["us_per_token"] - 1e3 * row["fwdbwd_ms"] / n) < 1e-9, row
        assert by[("ours lean", n)]["floor_ms"] == 4 / 3 * by[("3 GEMMs", n)]["fwdbwd_ms"]
        assert by[("jnp bf16", n)]["x_jnp"] == 1.0
    # Peers: on a machine without them (or without a CUDA GPU) one error row each, printed
    # once; where they run, a row per size (timed, or with the error of that size).
    for impl in ("QuACK chunked", "Liger"):
        peer = [r for r in data["rows"] if r["impl"] == impl]
        if len(peer) == 1 and "N" not in peer[0]:
            assert "fwdbwd_ms" not in peer[0] and proc.stdout.count(f"{impl}: ") == 1, peer
        else:
            assert sorted(r["N"] for r in peer) == [8, 64], peer
        for r in peer:
            assert ("error" in r) != ("fwdbwd_ms" in r), r
            if "error" in r:
                assert r["error"] in proc.stdout, r
            else:
                assert r["us_per_token"] == 1e3 * r["fwdbwd_ms"] / r["N"], r
                assert r["x_jnp"] == r["fwdbwd_ms"] / by[("jnp bf16", r["N"])]["fwdbwd_ms"]
                assert r["version"] and "cross-entropy" in r["note"], r
    md = (tmp_path / "bench_tokens.md").read_text()
    assert "QuACK chunked" in md and "Liger" in md

    for name in ("tokens.svg", "tokens.png"):
        out = tmp_path / name
        run_benchmark(
            "benchmarks.plot_tokens", str(tmp_path / "bench_tokens.json"), str(out), timeout=120
        )
    svg = (tmp_path / "tokens.svg").read_text()
    xml.dom.minidom.parseString(svg)
    assert data["meta"]["commit"] in svg  # the footer, kept as text
    assert (tmp_path / "tokens.png").read_bytes().startswith(b"\x89PNG")
    # one line per impl with times and the lean floor, in the one (D, V) panel of the toy sizes
    from benchmarks import plot_tokens

    timed = {r["impl"] for r in data["rows"] if r.get("us_per_token")}
    assert {"jnp bf16", "ours lean", "ours fast", "3 GEMMs"} <= timed
    [labels] = drawn(plot_tokens.figure(data))
    assert sorted(labels) == sorted(timed | {plot_tokens.LEAN_FLOOR})


def test_peer_rows_from_injected_records(capsys, monkeypatch):
    """The peers' records become rows against the jnp row of the same size; an import failure
    is reported once and never stops the sweep; a failed worker gives one row per peer; the
    plot draws the timed peers as lines of their own."""
    import subprocess as sp

    from benchmarks import bench_tokens, plot_tokens

    rows = [
        {"impl": impl, "N": n, "D": 32, "V": 1000, "fwdbwd_ms": ms, "us_per_token": 1e3 * ms / n}
        for n in (8, 64)
        for impl, ms in (("jnp bf16", 2.0), ("3 GEMMs", 1.0))
    ]
    records = [
        {
            "impl": "QuACK chunked",
            "error": "import failed: ModuleNotFoundError: No module named 'quack'",
        },
        {
            "impl": "Liger",
            "N": 8,
            "D": 32,
            "V": 1000,
            "fwdbwd_ms": 3.0,
            "version": "liger-kernel 0.6.1, torch 2.8.0",
            "note": "... cross-entropy",
        },
        {
            "impl": "Liger",
            "N": 64,
            "D": 32,
            "V": 1000,
            "error": "OutOfMemoryError: CUDA out of memory",
            "version": "liger-kernel 0.6.1, torch 2.8.0",
            "note": "... cross-entropy",
        },
    ]
    peers = bench_tokens.peer_rows(records, rows)
    out = capsys.readouterr().out
    assert out.count("QuACK chunked: import failed") == 1
    assert "Liger N=64 D=32 V=1000: OutOfMemoryError" in out
    assert peers[0] == {"impl": "QuACK chunked", "error": records[0]["error"]}
    assert peers[1] == {
        "impl": "Liger",
        "N": 8,
        "D": 32,
        "V": 1000,
        "fwdbwd_ms": 3.0,
        "us_per_token": 375.0,
        "x_jnp": 1.5,
        "version": "liger-kernel 0.6.1, torch 2.8.0",
        "note": "... cross-entropy",
    }
    assert "fwdbwd_ms" not in peers[2] and peers[2]["error"].startswith("OutOfMemoryError")

    fig = plot_tokens.figure(
        {"meta": {"device": "cpu", "date": "d", "jax": "j", "commit": "c"}, "rows": rows + peers}
    )
    [labels] = drawn(fig)
    assert labels == ["jnp bf16", "3 GEMMs", "Liger", plot_tokens.LEAN_FLOOR]
    [liger] = [line for line in fig.axes[0].get_lines() if line.get_label() == "Liger"]
    assert liger.get_color() == plot_tokens.STYLE["Liger"][0]
    ns, floor = fig.axes[0].get_lines()[-1].get_data()
    assert list(ns) == [8, 64] and list(floor) == pytest.approx([4 / 3 * 125.0, 4 / 3 * 1e3 / 64])

    def failed(*args, **kwargs):
        return sp.CompletedProcess(args, 1, "", "Traceback ...\nRuntimeError: boom\n")

    monkeypatch.setattr(bench_tokens.subprocess, "run", failed)
    got = bench_tokens.peer_results([(8, 32, 1000)], 2)
    assert [r["impl"] for r in got] == ["QuACK chunked", "Liger"]
    assert all(r["error"].endswith("code 1: RuntimeError: boom") for r in got)
