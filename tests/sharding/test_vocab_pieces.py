"""The head's backward in vocabulary pieces (``jk.head_grad_pieces``, docs/api.md "The head's
gradient in pieces"): under a rows split, values and gradients equal the one-piece call
(float32: 1e-6 of scale; bfloat16: the float64 oracle's bound), and the compiled program sums
d_weight with one collective per piece (all-reduce; reduce-scatter for an FSDP head) instead
of one. Pieces need not divide the vocabulary (V = 40 in 3 pieces); a head split on V over the
rows' axis has each device's block in pieces. Without a rows split nothing changes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels.sharding import vocab_pieces
from tests.conftest import assert_close
from tests.support import oracle
from tests.support.sharding_support import collective_sizes

B, T, D, V = 4, 8, 16, 40


def mesh_of(kind: str, n: int):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (conftest forces 8 host devices on CPU)")
    return jax.make_mesh(
        (n,), ("data",), axis_types=(getattr(AxisType, kind),), devices=jax.devices()[:n]
    )


def inputs(rng, dtype=jnp.float32, weight_layout="vd"):
    h = jnp.asarray(rng.standard_normal((B, T, D)), dtype)
    shape = (V, D) if weight_layout == "vd" else (D, V)
    w = jnp.asarray(rng.standard_normal(shape) / np.sqrt(D), dtype)
    b = jnp.asarray(rng.standard_normal(V) / 4, dtype)
    t = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32).at[0, :3].set(-100)
    g = [jnp.asarray(rng.standard_normal((B, T)), jnp.float32) for _ in range(2)]
    return h, w, b, t, g


def value_and_grads(logp_fn, g):
    """(outputs, d(Σ g·outputs)/d(h, w, b))."""

    def scalar(h, w, b, t):
        return sum(jnp.sum(o * gi) for o, gi in zip(logp_fn(h, w, b, t), g))

    return lambda h, w, b, t: (logp_fn(h, w, b, t), jax.grad(scalar, (0, 1, 2))(h, w, b, t))


def run(fn, args, pieces):
    """(results, compiled HLO text) of ``fn`` jitted, traced and compiled with ``pieces``
    (a new function each time: jax's trace cache does not know the scope)."""
    with jk.head_grad_pieces(pieces):
        compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    return compiled(*args), compiled.as_text()


def piece_sizes(n_vocab: int, pieces: int, blocks: int = 1) -> set[int]:
    bounds = vocab_pieces.piece_bounds(n_vocab // blocks, pieces)
    return {blocks * (b - a) for a, b in zip(bounds[:-1], bounds[1:])}


def collectives_carrying(hlo: str, name: str, sizes: set[int]) -> int:
    """How many ``name`` collectives of the program carry a result of one of ``sizes``."""
    count = 0
    for line in hlo.splitlines():
        if f" {name}(" in line or f" {name}-start(" in line:
            if set(collective_sizes(line, name)) & sizes:
                count += 1
    return count


def assert_same(got, want, rel=1e-6):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, f"leaf {i}: shape"
        np.testing.assert_allclose(a, b, rtol=0, atol=rel * max(np.abs(b).max(), 1e-3))


CASES = [("Auto", 2, 2), ("Explicit", 2, 3), ("Auto", 4, 3), ("Explicit", 4, 2)]


@pytest.mark.pallas_slow  # minutes per case in interpret mode
@pytest.mark.parametrize("kind,n,pieces", CASES)
def test_rows_split_in_pieces(rng, backend, kind, n, pieces):
    """Replicated head, rows over n devices: P all-reduces of d_weight pieces (chunked; the
    reference backend, which jax differentiates itself, is unchanged)."""
    mesh = mesh_of(kind, n)
    h, w, b, t, g = inputs(rng)
    kw = dict(return_entropy=True, ignore_index=-100, backend=backend, memory="lean")
    fn = value_and_grads(lambda h, w, b, t: jk.linear_logprobs(h, w, t, b, **kw), g)
    args = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip((h, w, b, t), (P("data"), P(), P(), P("data")))
    ]
    want, hlo_one = run(fn, args, 1)
    got, hlo = run(fn, args, pieces)
    assert_same(got, want)
    if backend == "reference":
        return
    assert collectives_carrying(hlo_one, "all-reduce", {V * D}) == 1
    sizes = {s * D for s in piece_sizes(V, pieces)}
    assert collectives_carrying(hlo, "all-reduce", sizes) == pieces
    assert V * D not in collective_sizes(hlo, "all-reduce")


@pytest.mark.parametrize(
    "kind,weight_layout", [("Explicit", "vd"), ("Explicit", "dv"), ("Auto", "vd")]
)
def test_fsdp_head_in_pieces(rng, kind, weight_layout):
    """A head split over the rows' axis (4 devices; on V for "vd", on D for "dv"): d_weight
    reduce-scattered piece by piece, each device's block whole and in order."""
    mesh = mesh_of(kind, 4)
    h, w, b, t, g = inputs(rng, weight_layout=weight_layout)
    kw = dict(weight_layout=weight_layout, ignore_index=-100, backend="chunked", memory="lean")
    fn = value_and_grads(lambda h, w, b, t: (jk.linear_logprobs(h, w, t, b, **kw),), g)
    specs = (P("data"), P("data", None), P(), P("data"))
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((h, w, b, t), specs)]
    want, _ = run(fn, args, 1)
    got, hlo = run(fn, args, 3)
    assert_same(got, want)
    assert got[1][1].sharding.spec == want[1][1].sharding.spec
    blocks = 4 if weight_layout == "vd" else 1
    sizes = {s * D // 4 for s in piece_sizes(V, 3, blocks)}
    assert collectives_carrying(hlo, "reduce-scatter", sizes) == 3


def test_fast_mode_and_ids_in_pieces(rng):
    """memory="fast" (the kept logits' columns in pieces) and K ids per row."""
    mesh = mesh_of("Auto", 2)
    h, w, b, t, g = inputs(rng)
    ids = jnp.stack([t, (t + 7) % V], axis=-1)
    place = lambda xs, ss: [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, ss)]
    specs = (P("data"), P(), P(), P("data"))
    fast = value_and_grads(
        lambda h, w, b, t: jk.linear_logprobs(
            h, w, t, b, return_entropy=True, ignore_index=-100, memory="fast"
        ),
        g,
    )
    args = place((h, w, b, t), specs)
    got, hlo = run(fast, args, 3)
    assert_same(got, run(fast, args, 1)[0])
    assert collectives_carrying(hlo, "all-reduce", {s * D for s in piece_sizes(V, 3)}) == 3
    g_ids = [jnp.asarray(rng.standard_normal((B, T, 2)), jnp.float32)]
    by_ids = value_and_grads(
        lambda h, w, b, i: (jk.linear_logprobs(h, w, i, b, backend="chunked", memory="lean"),),
        g_ids,
    )
    args = place((h, w, b, ids), specs)
    got, hlo = run(by_ids, args, 2)
    assert_same(got, run(by_ids, args, 1)[0])
    assert collectives_carrying(hlo, "all-reduce", {s * D for s in piece_sizes(V, 2)}) == 2


def test_linear_loss_in_pieces(rng):
    """A fused loss's backward (``head_backward``), lean and fast, rows over 2 devices."""
    mesh = mesh_of("Explicit", 2)
    h, w, b, t, _ = inputs(rng)
    old = jnp.asarray(rng.standard_normal((B, T)) - 3.0, jnp.float32)
    adv = jnp.asarray(rng.standard_normal((B, T)), jnp.float32)
    mask = t >= 0
    t = jnp.where(mask, t, 0)
    specs = (P("data"), P(), P(), P("data"), P("data"), P("data"), P("data"))
    args = [
        jax.device_put(x, NamedSharding(mesh, s))
        for x, s in zip((h, w, b, t, old, adv, mask), specs)
    ]
    for memory in ("lean", "fast"):

        def loss(h, w, b, t, old, adv, mask, memory=memory):
            kw = dict(backend="chunked") if memory == "lean" else {}
            out = jk.linear_ppo_loss(h, w, t, old, adv, mask, bias=b, memory=memory, **kw)
            return out[0] if isinstance(out, tuple) else out

        fn = jax.value_and_grad(loss, (0, 1, 2))
        got, hlo = run(fn, args, 3)
        assert_same(got, run(fn, args, 1)[0])
        sizes = {s * D for s in piece_sizes(V, 3)}
        assert collectives_carrying(hlo, "all-reduce", sizes) == 3, memory


def test_in_shard_map(rng):
    """Inside a user's shard_map (rows over ``data``, the head replicated): one psum per
    piece. (A head the body gathers is summed by jax's transpose of the gather, outside the
    op: one reduce-scatter, not in pieces.)"""
    mesh = mesh_of("Explicit", 2)
    h, w, b, t, g = inputs(rng)
    kw = dict(ignore_index=-100, backend="chunked", memory="lean")
    rows = P("data")
    specs = (rows, P(), P(), rows)
    mapped = jax.shard_map(
        lambda h, w, b, t: jk.linear_logprobs(h, w, t, b, **kw),
        mesh=mesh,
        in_specs=specs,
        out_specs=rows,
    )
    fn = value_and_grads(lambda h, w, b, t: (mapped(h, w, b, t),), g)
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((h, w, b, t), specs)]
    got, hlo = run(fn, args, 3)
    assert_same(got, run(fn, args, 1)[0])
    sizes = {s * D for s in piece_sizes(V, 3)}
    assert collectives_carrying(hlo, "all-reduce", sizes) == 3


def test_bfloat16_pieces_against_float64(rng):
    """bfloat16 head and hidden states in 3 pieces over 4 devices: values within the float64
    oracle's bounds, gradients as far from float64 as one piece's (d_hidden summed over the
    pieces in float32; d_weight's all-reduce in bfloat16 is the rows split's, pieces or not)."""
    mesh = mesh_of("Explicit", 4)
    h, w, b, t, g = inputs(rng, jnp.bfloat16)
    kw = dict(return_entropy=True, ignore_index=-100, backend="chunked", memory="lean")
    fn = value_and_grads(lambda h, w, b, t: jk.linear_logprobs(h, w, t, b, **kw), g)
    specs = (P("data"), P(), P(), P("data"))
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((h, w, b, t), specs)]
    (outs, grads), (_, grads_one) = run(fn, args, 3)[0], run(fn, args, 1)[0]
    tt = np.asarray(t)
    want = oracle.linear_logprobs(h, w, tt, b, ignore_index=-100)
    want32 = oracle.linear_logprobs(h, w, tt, b, ignore_index=-100, dt=np.float32)
    for got, w64, w32, name in zip(outs, want, want32, ("logp", "entropy")):
        assert_close(got, w64, in_dtype=jnp.bfloat16, want32=w32, name=name)
    exact = oracle.linear_logprobs_vjp(
        h, w, tt, np.asarray(g[0]), np.asarray(g[1]), b, ignore_index=-100
    )
    rel = lambda x, e: float(np.linalg.norm(np.asarray(x, np.float64) - e) / np.linalg.norm(e))
    for got, one, e, name in zip(grads, grads_one, exact, ("hidden", "weight", "bias")):
        assert rel(got, e) <= 1.1 * rel(one, e) and rel(one, e) < 4e-3, name


def test_no_rows_split_runs_once(rng):
    """Vocabulary split only (no cross-device sum of d_weight): one piece, same program."""
    mesh = mesh_of("Explicit", 2)
    h, w, b, t, g = inputs(rng)
    kw = dict(ignore_index=-100, backend="chunked")
    fn = value_and_grads(lambda h, w, b, t: (jk.linear_logprobs(h, w, t, b, **kw),), g)
    specs = (P(), P("data", None), P("data"), P())
    args = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((h, w, b, t), specs)]
    (got, hlo), (want, hlo_one) = run(fn, args, 3), run(fn, args, 1)
    assert_same(got, want, rel=0)
    strip = lambda text: [  # the computations, not the source locations XLA records
        re.sub(r", metadata=\{[^}]*\}", "", line)
        for line in text.splitlines()
        if line.strip().startswith(("%", "ROOT", "ENTRY", "}"))
    ]
    assert len(strip(hlo)) > 10 and strip(hlo) == strip(hlo_one)


def test_option_checked(monkeypatch):
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="pieces"):
            with jk.head_grad_pieces(bad):
                pass
    monkeypatch.setenv(vocab_pieces.ENV_VAR, "4")
    assert vocab_pieces.requested() == 4
    with jk.head_grad_pieces(2):
        assert vocab_pieces.requested() == 2
        with jk.head_grad_pieces(None):
            assert vocab_pieces.requested() == 4
    monkeypatch.setenv(vocab_pieces.ENV_VAR, "zero")
    with pytest.raises(ValueError, match=vocab_pieces.ENV_VAR):
        vocab_pieces.requested()
    monkeypatch.delenv(vocab_pieces.ENV_VAR)
    assert vocab_pieces.requested() == 1


def test_explain_reports_the_pieces(monkeypatch):
    """``explain`` names the pieces and where they were asked for; with one piece it says
    nothing of them. Shapes where the engine's backends run (not ``reference``)."""
    args = [
        jax.ShapeDtypeStruct((4096, 64), jnp.float32),
        jax.ShapeDtypeStruct((32000, 64), jnp.float32),
        jax.ShapeDtypeStruct((4096,), jnp.int32),
    ]
    with jk.head_grad_pieces(4):
        text = jk.explain("linear_logprobs", *args)
    assert "pieces: the head's gradient in 4 vocabulary pieces" in text, text
    assert "(jk.head_grad_pieces)" in text, text
    monkeypatch.setenv(vocab_pieces.ENV_VAR, "3")
    assert (
        f"in 3 vocabulary pieces where rows are split across devices ({vocab_pieces.ENV_VAR})"
        in (jk.explain("linear_logprobs", *args))
    )
    monkeypatch.delenv(vocab_pieces.ENV_VAR)
    assert "pieces:" not in jk.explain("linear_logprobs", *args)
