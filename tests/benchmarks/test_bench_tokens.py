"""benchmarks/bench_tokens.py runs end to end at toy sizes (``--small``) on any device, its
PyTorch rows (``--torch``, ``--peers``: QuACK, Liger, Cut Cross-Entropy) included, which leave
rows with an error where they cannot run; they time the batch the JAX rows time (saved, then
loaded by both); benchmarks/plot_tokens.py draws its result with matplotlib, a line per impl
with times, to SVG or PNG by the output's extension."""

import json
import xml.dom.minidom

import pytest

from tests.support.bench_run import run_benchmark


def drawn(fig):
    """The labels of the lines of each panel of a plot_tokens figure."""
    return [[line.get_label() for line in ax.get_lines()] for ax in fig.axes]


def test_bench_tokens_small_and_its_plot(tmp_path):
    proc = run_benchmark(
        "benchmarks.bench_tokens",
        *("--small", "--runs", "2", "--torch", "--peers", "--out", str(tmp_path)),
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
    from benchmarks.token_peers import PEERS, TORCH

    assert "saved the random batch N=64 D=32 V=1000" in proc.stdout
    for impl in (TORCH, *PEERS):
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
                assert r["version"] and ("cross-entropy" in r["note"] or impl == TORCH), r
    md = (tmp_path / "bench_tokens.md").read_text()
    assert all(f"| {impl} |" in md for impl in (TORCH, *PEERS))

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
    assert [r["impl"] for r in got] == list(bench_tokens.PEERS)
    assert all(r["error"].endswith("code 1: RuntimeError: boom") for r in got)


def test_a_dying_worker_keeps_its_records(monkeypatch):
    """The PyTorch worker appends each record to its records file as it goes: one that dies
    keeps them, each size it did not reach gets a record that says why, an impl it never
    reported one record; an impl's record without a size stands for every size."""
    import subprocess as sp

    from benchmarks import bench_tokens

    sizes = [(8, 32, 1000), (64, 32, 1000)]
    written = [
        {"impl": "torch bf16", "N": 8, "D": 32, "V": 1000, "fwdbwd_ms": 1.0},
        {"impl": "torch bf16", "N": 64, "D": 32, "V": 1000, "fwdbwd_ms": 2.0},
        {"impl": "Liger", "error": "import failed: ModuleNotFoundError: liger_kernel"},
        {"impl": "CCE", "N": 8, "D": 32, "V": 1000, "fwdbwd_ms": 3.0},
    ]

    def dies(cmd, **kwargs):
        assert cmd[cmd.index("--batch") + 1] == "/saved"
        assert json.loads(cmd[cmd.index("--impls") + 1]) == impls
        path = cmd[cmd.index("--records") + 1]
        with open(path, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in written) + '{"impl": "CC')
        return sp.CompletedProcess(cmd, -11, "", "Fatal Python error: Segmentation fault\n")

    monkeypatch.setattr(bench_tokens.subprocess, "run", dies)
    impls = ["torch bf16", "Liger", "CCE", "QuACK chunked"]
    got = bench_tokens.peer_results(sizes, 2, impls, "/saved")
    why = "the PyTorch worker exited with code -11: Fatal Python error: Segmentation fault"
    assert got == written + [
        {"impl": "CCE", "N": 64, "D": 32, "V": 1000, "error": why},
        {"impl": "QuACK chunked", "error": why},
    ]


@pytest.mark.parametrize("batch", ["random", "realistic"])
def test_saved_batch_is_the_batch(tmp_path, batch):
    """What the PyTorch process loads and the JAX rows time after saving is what
    ``inputs`` draws; one head file per (D, V), which every N of the two generators shares."""
    import numpy as np

    from benchmarks import bench_tokens, token_peers

    sizes = [(8, 32, 1000), (64, 32, 1000)]
    bench_tokens.save_batches(sizes, tmp_path, batch, padding=0.35)
    assert len(list(tmp_path.glob("weight_*.npy"))) == 1
    for n, d, v in sizes:
        want = bench_tokens.inputs(n, d, v, batch=batch, padding=0.35)
        got = bench_tokens.saved_inputs(tmp_path, n, d, v, batch)
        for a, b in zip(want, got, strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
        numpy = token_peers.load_batch(tmp_path, n, d, v)
        assert numpy["hidden"].dtype == np.uint16 and numpy["hidden"].shape == (2, n // 2, d)
        assert numpy["weight"].shape == (v, d) and numpy["actions"].dtype == np.int32


def test_one_size_per_panel_draws_bars():
    """A file with one N per (D, V) (the realistic batch's two sizes) draws a panel per size and
    a bar per timed implementation, as long as its × jnp."""
    import json
    import pathlib

    from benchmarks import plot_tokens

    path = "benchmarks/results/bench_tokens_realistic_pad35_peers_45b9994.json"
    data = json.loads((pathlib.Path(__file__).parents[2] / path).read_text())
    fig = plot_tokens.figure(data)
    axes = [ax for ax in fig.axes if ax.patches]
    assert len(axes) == 2
    for ax in axes:
        n = int(ax.get_title().split("N=")[1].split(",")[0])
        want = {r["impl"]: r["x_jnp"] for r in data["rows"] if r.get("N") == n and r.get("x_jnp")}
        got = {t.get_text(): p.get_width() for t, p in zip(ax.get_yticklabels(), ax.patches)}
        assert got == want
