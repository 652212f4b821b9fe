"""Sampler-matched log-probs (``top_k``, ``top_p``, ``min_p``) against the float64 sort-based
oracle: every backend and the fast mode, logits and a linear head, both layouts, bias,
temperature, float32 / bfloat16 / float16; ties at top-k's threshold, a nucleus of one token
and of more than 1000, min-p on a flat row, targets outside the kept set, ignored rows, one
row; sharded meshes (Auto and Explicit axes, a user's shard_map with ``vocab_axis``); the
errors docs/api.md promises; GPU runs of the kernel backends."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_kernels as jk
from jaxrl_kernels.head import kept_set
from tests.conftest import (
    assert_close,
    assert_f32,
    assert_zero,
    cotangent,
    pallas_sample,
    pallas_slow,
    rand,
)
from tests.support import oracle
from tests.support.sharding_support import on_two_devices

TRUNCATIONS = [
    dict(top_k=5),
    dict(top_p=0.9),
    dict(min_p=0.05),
    dict(top_k=50, top_p=0.95),
    dict(top_k=20, top_p=0.5, min_p=0.01),
]
# (leading shape, V, D, temperature, with bias, dtype, layout)
CASES = [
    ((7,), 300, 16, 1.0, False, jnp.float32, "vd"),
    ((2, 5), 257, 8, 0.7, True, jnp.float32, "dv"),
    ((3, 4), 401, 12, 1.3, True, jnp.bfloat16, "vd"),
    ((2, 3), 129, 8, 1.0, False, jnp.float16, "dv"),
]
# pallas (interpret mode, ~4 s a case): the first case with top_k only (the cheapest, by a
# little); pallas_sample compares flattened cases (a case's 7 values and the truncation)
PALLAS_VALUES = {CASES[0] + (0,)}
# chunked: the first case with every truncation, each other case with all three (its head,
# dtype and layout; every case × truncation with JAXRL_TEST_SLOW=1; the reference backend runs
# them all)
CHUNKED_VALUES = {CASES[0] + (t,) for t in range(len(TRUNCATIONS))} | {
    CASES[i] + (len(TRUNCATIONS) - 1,) for i in range(1, len(CASES))
}


def values_sample():
    """pallas_sample's cases (flattened: a case's 7 values and the truncation), those not in
    CHUNKED_VALUES slow on chunked."""
    return [
        pytest.param(
            *p.values,
            id=p.id,
            marks=list(p.marks)
            + [pytest.mark.slow_on("chunked")] * (tuple(p.values) not in CHUNKED_VALUES),
        )
        for p in pallas_sample(PALLAS_VALUES, CASES, range(len(TRUNCATIONS)))
    ]


def head_inputs(rng, lead, vocab, d, dtype, layout, with_bias, scale=3.0):
    hidden, h64 = rand(rng, lead + (d,), dtype)
    wshape = (vocab, d) if layout == "vd" else (d, vocab)
    weight, w64 = rand(rng, wshape, dtype, scale=scale / np.sqrt(d))
    bias, b64 = rand(rng, (vocab,), dtype, scale=0.5) if with_bias else (None, None)
    return hidden, h64, weight, w64, bias, b64


def check_linear(
    rng,
    h,
    h64,
    w,
    w64,
    b,
    b64,
    targets,
    trunc,
    *,
    layout,
    temperature,
    ignore_index=None,
    backend=None,
    memory=None,
):
    """Values, kept flags and the VJP of ``linear_logprobs`` against the oracle."""
    dtype = h.dtype
    primals = (h, w) if b is None else (h, w, b)
    kw = dict(weight_layout=layout, temperature=temperature, ignore_index=ignore_index, **trunc)

    def fn(h, w, b=None):
        return jk.linear_logprobs(
            h,
            w,
            jnp.asarray(targets),
            b,
            return_entropy=True,
            return_kept=True,
            backend=backend,
            memory=memory,
            **kw,
        )

    logp, ent, kept = fn(*primals)
    _, vjp = jax.vjp(lambda *p: fn(*p)[:2], *primals)
    assert_f32(logp, ent)
    assert kept.dtype == jnp.bool_ and kept.shape == targets.shape
    want = oracle.sampler_logprobs(h64, w64, targets, b64, **kw)
    want32 = oracle.sampler_logprobs(h64, w64, targets, b64, dt=np.float32, **kw)
    zscale = np.max(np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout)))
    zscale /= temperature
    assert_close(logp, want[0], in_dtype=dtype, want32=want32[0], scale=zscale, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=want32[1], scale=zscale, name="entropy")
    np.testing.assert_array_equal(np.asarray(kept), want[2])

    g_lp, g_ent = cotangent(rng, targets.shape), cotangent(rng, targets.shape)
    grads = vjp((g_lp, g_ent))
    args = (h64, w64, targets, np.asarray(g_lp), np.asarray(g_ent), b64)
    gw = oracle.sampler_logprobs_vjp(*args, **kw)
    gw32 = oracle.sampler_logprobs_vjp(*args, dt=np.float32, **kw)
    for name, got, p, w_, w32 in zip(("d_hidden", "d_weight", "d_bias"), grads, primals, gw, gw32):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w_, in_dtype=dtype, want32=w32, name=name)
    return logp, ent, kept, grads


@pytest.mark.parametrize(
    "lead,vocab,d,temperature,with_bias,dtype,layout,trunc",
    values_sample(),
)
def test_linear_values_and_vjp(
    backend, rng, lead, vocab, d, temperature, with_bias, dtype, layout, trunc
):
    h, h64, w, w64, b, b64 = head_inputs(rng, lead, vocab, d, dtype, layout, with_bias)
    targets = rng.integers(0, vocab, lead).astype(np.int32)
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        TRUNCATIONS[trunc],
        layout=layout,
        temperature=temperature,
        backend=backend,
    )


# the dv layout on all three truncations together only (vd runs each truncation; the layout
# changes the head's matmul, not the kept set's search); the rest slow
@pytest.mark.parametrize("layout,trunc", [
    pytest.param(layout, t, marks=[pytest.mark.slow] * (layout == "dv" and t != 4))
    for layout in ("vd", "dv") for t in range(len(TRUNCATIONS))
])  # fmt: skip
def test_linear_fast_mode(rng, trunc, layout):
    """memory="fast": the kept set found over the kept logits (float32 heads)."""
    h, h64, w, w64, b, b64 = head_inputs(rng, (3, 7), 211, 8, jnp.float32, layout, True)
    targets = rng.integers(0, 211, (3, 7)).astype(np.int32)
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        TRUNCATIONS[trunc],
        layout=layout,
        temperature=0.9,
        memory="fast",
    )


# chunked: top_k alone, top_p alone (the pivot search without candidates) and all three (min_p
# alone and top_k with top_p slow_on chunked); pallas: top_p alone and all three (the rest
# pallas_slow, ~4 s each in interpret mode); the reference runs every truncation
LOGITS_MARKS = {0: [pytest.mark.pallas_slow], 2: [pytest.mark.pallas_slow,
                pytest.mark.slow_on("chunked")], 3: [pytest.mark.pallas_slow,
                pytest.mark.slow_on("chunked")]}  # fmt: skip


@pytest.mark.parametrize(
    "trunc", [pytest.param(t, marks=LOGITS_MARKS.get(t, ())) for t in range(len(TRUNCATIONS))]
)
def test_logits_values_and_vjp(backend, rng, trunc):
    """token_logprobs on given logits (bfloat16 and float32)."""
    for dtype in (jnp.float32, jnp.bfloat16):
        logits, z64 = rand(rng, (4, 6, 333), dtype, scale=2.5)
        targets = rng.integers(0, 333, (4, 6)).astype(np.int32)
        kw = dict(temperature=0.8, **TRUNCATIONS[trunc])
        fn = lambda x: jk.token_logprobs(
            x, jnp.asarray(targets), return_entropy=True, backend=backend, **kw
        )
        (logp, ent), vjp = jax.vjp(fn, logits)
        kept = jk.token_logprobs(
            logits, jnp.asarray(targets), return_kept=True, backend=backend, **kw
        )[1]
        want = oracle.sampler_logprobs(None, None, targets, logits=z64, **kw)
        want32 = oracle.sampler_logprobs(None, None, targets, logits=z64, dt=np.float32, **kw)
        scale = np.max(np.abs(z64)) / 0.8
        assert_close(logp, want[0], in_dtype=dtype, want32=want32[0], scale=scale, name="logp")
        assert_close(ent, want[1], in_dtype=dtype, want32=want32[1], scale=scale, name="entropy")
        np.testing.assert_array_equal(np.asarray(kept), want[2])
        g_lp, g_ent = cotangent(rng, targets.shape), cotangent(rng, targets.shape)
        (dx,) = vjp((g_lp, g_ent))
        args = (None, None, targets, np.asarray(g_lp), np.asarray(g_ent))
        want_dx = oracle.sampler_logprobs_vjp(*args, logits=z64, **kw)
        want_dx32 = oracle.sampler_logprobs_vjp(*args, logits=z64, dt=np.float32, **kw)
        assert_close(dx, want_dx, in_dtype=dtype, want32=want_dx32, name="d_logits")


def integer_head(rng, rows, vocab, d, layout):
    """A head whose logits are small integers (exact in float32 whatever the summation
    order): one-hot hidden rows and integer weights."""
    hidden = np.zeros((rows, d), np.float32)
    hidden[np.arange(rows), rng.integers(0, d, rows)] = 1.0
    weight = rng.integers(-6, 7, (vocab, d)).astype(np.float32)
    weight = weight if layout == "vd" else weight.T.copy()
    return (
        jnp.asarray(hidden),
        hidden.astype(np.float64),
        jnp.asarray(weight),
        weight.astype(np.float64),
    )


# pallas: the vd layout only (dv pallas_slow: the same ties through the other matmul, ~6 s)
@pytest.mark.parametrize("layout", ["vd", pallas_slow("dv")])
def test_ties_at_top_k_are_kept(backend, rng, layout):
    """Integer logits with many equal values: every value equal to the k-th largest is kept
    (vLLM's rule), so a row keeps more than k tokens."""
    h, h64, w, w64 = integer_head(rng, 6, 97, 5, layout)
    targets = rng.integers(0, 97, 6).astype(np.int32)
    logp, _, kept, _ = check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        None,
        None,
        targets,
        dict(top_k=10),
        layout=layout,
        temperature=1.0,
        backend=backend,
    )
    z = oracle.linear_logits(h64, w64, weight_layout=layout)
    sizes = oracle.kept_set(z, top_k=10).sum(-1)
    assert np.all(sizes >= 10) and np.any(sizes > 10), sizes
    # top-p over tied values keeps them all as well
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        None,
        None,
        targets,
        dict(top_p=0.6),
        layout=layout,
        temperature=1.0,
        backend=backend,
    )


def test_nucleus_of_one_token(backend, rng):
    """A dominant token and top_p below its probability: it alone is kept (logp 0, entropy 0,
    no gradient through a target equal to it); other targets are outside."""
    h, h64, w, w64, _, _ = head_inputs(rng, (5,), 64, 8, jnp.float32, "vd", False, scale=1.0)
    z = oracle.linear_logits(h64, w64)
    top = np.argmax(z, axis=-1)
    w64 = w64.copy()
    for n in range(5):  # make row n's top token dominate (p > 0.9)
        w64[top[n]] += 8.0 * h64[n] / np.dot(h64[n], h64[n])
    w = jnp.asarray(w64.astype(np.float32))
    w64 = np.asarray(w).astype(np.float64)
    top = np.argmax(oracle.linear_logits(h64, w64), axis=-1)
    targets = np.where(np.arange(5) % 2 == 0, top, (top + 1) % 64).astype(np.int32)
    logp, ent, kept, grads = check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        None,
        None,
        targets,
        dict(top_p=0.5),
        layout="vd",
        temperature=1.0,
        backend=backend,
    )
    np.testing.assert_array_equal(np.asarray(kept), np.arange(5) % 2 == 0)
    if backend in ("reference", "chunked"):  # statistics and kept set from the same logits
        assert_zero(np.asarray(logp)[::2], "logp of the only kept token")
    else:  # the target's logit from the kernel, the kept set's sum from recomputed logits
        z_top = np.abs(oracle.linear_logits(h64, w64)[np.arange(5), top])[::2]
        bound = 4 * np.finfo(np.float32).eps * z_top  # docs/api.md: a few ulps of z[target]
        assert np.all(np.abs(np.asarray(logp)[::2]) <= bound), (np.asarray(logp)[::2], bound)
    assert_zero(np.asarray(ent), "entropy of a one-token nucleus")


def test_nucleus_of_thousands(backend, rng):
    """A flat distribution (high temperature): the nucleus spans more than 1000 tokens."""
    h, h64, w, w64, b, b64 = head_inputs(rng, (4,), 3001, 8, jnp.float32, "dv", True, scale=1.0)
    targets = rng.integers(0, 3001, 4).astype(np.int32)
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        dict(top_p=0.95),
        layout="dv",
        temperature=3.0,
        backend=backend,
    )
    z = oracle.linear_logits(h64, w64, b64, weight_layout="dv") / 3.0
    assert np.all(oracle.kept_set(z, top_p=0.95).sum(-1) > 1000)


def test_min_p_on_a_flat_row(backend, rng):
    """Equal logits: min-p keeps every token (each has the max probability)."""
    d, vocab = 4, 50
    h = jnp.zeros((3, d), jnp.float32)
    w, _ = rand(rng, (vocab, d))
    targets = jnp.asarray([0, 17, 49])
    logp, ent, kept = jk.linear_logprobs(
        h, w, targets, min_p=0.5, top_k=7, return_entropy=True, return_kept=True, backend=backend
    )
    np.testing.assert_allclose(np.asarray(logp), -np.log(vocab), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ent), np.log(vocab), rtol=1e-6)
    assert np.all(np.asarray(kept))


def test_targets_outside_the_kept_set(backend, rng):
    """A target the truncation drops: finite logp = z_t − lse(kept), kept False, and the
    gradient of that expression (checked by check_linear against the oracle)."""
    h, h64, w, w64, _, _ = head_inputs(rng, (6,), 120, 8, jnp.float32, "vd", False)
    z = oracle.linear_logits(h64, w64)
    targets = np.argsort(z, axis=-1)[:, 3].astype(np.int32)  # among the least likely
    logp, _, kept, grads = check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        None,
        None,
        targets,
        dict(top_k=5),
        layout="vd",
        temperature=1.0,
        backend=backend,
    )
    assert not np.any(np.asarray(kept))
    assert np.all(np.isfinite(np.asarray(logp)))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


# chunked: top_k alone slow (top_k with top_p holds it); pallas: top_k with top_p (the one-token
# nucleus) only, the others pallas_slow (~2 s each in interpret mode)
@pytest.mark.parametrize(
    "trunc",
    [
        pytest.param(
            dict(top_k=50), marks=[pytest.mark.pallas_slow, pytest.mark.slow_on("chunked")]
        ),
        dict(top_k=50, top_p=0.95),
        pallas_slow(dict(top_k=90, min_p=1e-30)),
    ],
    ids=("top_k", "top_k_top_p", "top_k_min_p"),
)
def test_spread_logits(backend, rng, trunc):
    """Logits tens apart (float32 gradients within docs/api.md's bound still): top-p's
    nucleus is one token, min-p keeps nearly everything top-k leaves. (Rows hundreds wide:
    ``test_pivot_search``.)"""
    h, h64, w, w64, _, _ = head_inputs(rng, (5,), 97, 8, jnp.float32, "vd", False, scale=12.0)
    targets = rng.integers(0, 97, 5).astype(np.int32)
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        None,
        None,
        targets,
        trunc,
        layout="vd",
        temperature=1.0,
        backend=backend,
    )


@pytest.mark.parametrize("spread", [0.01, 3.0, 300.0])
@pytest.mark.parametrize(
    "trunc",
    [
        dict(top_k=40),
        dict(top_k=40, top_p=0.9),
        dict(top_p=0.5),
        dict(min_p=0.01, top_k=120),
        dict(top_k=7, top_p=0.99),
    ],
)
def test_pivot_search(rng, spread, trunc):
    """The pivot search alone (kept_set.search; with top-k the op takes candidates first):
    the kept set ``u >= floor`` and its mass are the oracle's, on rows from nearly flat to
    hundreds wide (where top-k's search starts again from the lowest value)."""
    from jaxrl_kernels.formulas import sampler_math
    from jaxrl_kernels.head import kept_set

    u = (spread * rng.standard_normal((6, 500))).astype(np.float32)
    u[0, :50] = u[0, 0]  # a tie at the thresholds
    m = u.max(-1)
    found = kept_set.search(
        lambda start, size: jax.lax.dynamic_slice_in_dim(jnp.asarray(u), start, size, axis=1),
        6,
        500,
        jnp.asarray(m),
        jnp.ones(6, bool),
        sampler_math.truncation(**trunc),
    )
    want = oracle.kept_set(u, **trunc)
    np.testing.assert_array_equal(u >= np.asarray(found.floor)[:, None], want)
    mass = np.sum(np.where(want, np.exp(u.astype(np.float64) - m[:, None]), 0.0), -1)
    np.testing.assert_allclose(np.asarray(found.s), mass, rtol=1e-5)


def test_top_k_of_the_whole_vocabulary(backend, rng):
    """top_k >= V keeps every token: only top-p truncates (the pivot search's path)."""
    h, h64, w, w64, b, b64 = head_inputs(rng, (6,), 40, 8, jnp.float32, "dv", True)
    targets = rng.integers(0, 40, 6).astype(np.int32)
    for trunc in (dict(top_k=40), dict(top_k=64, top_p=0.8)):
        check_linear(
            rng,
            h,
            h64,
            w,
            w64,
            b,
            b64,
            targets,
            trunc,
            layout="dv",
            temperature=1.0,
            backend=backend,
        )


def test_ignored_rows_and_one_row(backend, rng):
    """ignore_index rows give 0 and no gradient; a single position (0-d target) works."""
    h, h64, w, w64, b, b64 = head_inputs(rng, (2, 4), 90, 8, jnp.float32, "vd", True)
    targets = rng.integers(0, 90, (2, 4)).astype(np.int32)
    targets[1] = 89
    logp, ent, kept, grads = check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        dict(top_k=8, top_p=0.8),
        layout="vd",
        temperature=1.0,
        ignore_index=89,
        backend=backend,
    )
    assert_zero(np.asarray(logp)[1], "logp of ignored rows")
    assert_zero(np.asarray(grads[0])[1], "d_hidden of ignored rows")
    assert not np.any(np.asarray(kept)[1])
    one = jk.linear_logprobs(h[0, 0], w, jnp.asarray(targets[0, 0]), b, top_p=0.8, backend=backend)
    want = oracle.sampler_logprobs(h64[0, 0], w64, targets[0, 0], b64, top_p=0.8)[0]
    assert one.shape == ()
    np.testing.assert_allclose(float(one), float(want), rtol=1e-5, atol=1e-5)


def test_no_truncation_is_the_plain_call(backend, rng):
    """top_p = 1 and min_p = 0 truncate nothing: bitwise the plain call."""
    h, _, w, _, _, _ = head_inputs(rng, (3, 5), 77, 8, jnp.float32, "vd", False)
    t = jnp.asarray(rng.integers(0, 77, (3, 5)))
    plain = jk.linear_logprobs(h, w, t, backend=backend)
    same, kept = jk.linear_logprobs(
        h, w, t, top_p=1.0, min_p=0.0, return_kept=True, backend=backend
    )
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(same))
    assert np.all(np.asarray(kept))


@kept_set.finding_row_max
def _find_on_whole_rows(
    logits, n_rows, vocab, m, active, trunc, *, vocab_axes=(), varying=lambda x: x, targets=None
):
    """The reference search, taking each row's max and target logit from its whole rows where
    asked (``m=None``), as ffi's kernel does on a GPU."""
    if m is not None:
        return kept_set.find(
            logits, n_rows, vocab, m, active, trunc, vocab_axes=vocab_axes, varying=varying
        )
    _find_on_whole_rows.without_max += 1
    m, target_rel = kept_set.row_max_and_target(logits.rows(0, n_rows), targets)
    found = kept_set.find(logits, n_rows, vocab, m, active, trunc, varying=varying)
    return dataclasses.replace(found, m=m, target_rel=target_rel)


# pallas: all three truncations only (top_k alone pallas_slow: "all" holds it)
@pytest.mark.parametrize(
    "trunc", [pallas_slow(TRUNCATIONS[0]), TRUNCATIONS[4]], ids=("top_k", "all")
)
def test_no_statistics_pass_where_the_search_finds_the_max(backend, rng, monkeypatch, trunc):
    """A ``kept_set`` implementation that finds each row's max and target itself (ffi's on a
    GPU) replaces the forward's statistics pass of a lean linear head: the oracle's values,
    kept flags and VJP, with odd V, a bias, ignored rows and a target outside [0, V)."""
    from jaxrl_kernels.backends import reference

    if backend == "reference":
        pytest.skip("the reference backend materialises the logits: no statistics pass")
    monkeypatch.setitem(reference.BACKEND.ops, "kept_set", _find_on_whole_rows)
    monkeypatch.setattr(_find_on_whole_rows, "without_max", 0, raising=False)
    h, h64, w, w64, b, b64 = head_inputs(rng, (2, 7), 211, 12, jnp.float32, "vd", True)
    targets = rng.integers(0, 211, (2, 7)).astype(np.int32)
    targets[1, ::3] = -100
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        trunc,
        layout="vd",
        temperature=1.2,
        ignore_index=-100,
        backend=backend,
    )
    assert _find_on_whole_rows.without_max > 0
    logp = jax.jit(lambda t: jk.linear_logprobs(h, w, t, b, **trunc, backend=backend))(
        jnp.asarray(targets).at[0, 0].set(211)
    )
    assert np.isnan(np.asarray(logp)[0, 0])  # as without truncation: an id outside [0, V)


def test_errors(rng):
    h, _, w, _, _, _ = head_inputs(rng, (3,), 20, 4, jnp.float32, "vd", False)
    t = jnp.zeros((3,), jnp.int32)
    for bad, match in [
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=2.0), "min_p"),
    ]:
        with pytest.raises(ValueError, match=match):
            jk.linear_logprobs(h, w, t, **bad)
        with pytest.raises(ValueError, match=match):
            jk.token_logprobs(jnp.zeros((3, 20)), t, **bad)
    with pytest.raises(ValueError, match="one target per position"):
        jk.linear_logprobs(h, w, jnp.zeros((3, 2), jnp.int32), top_k=3)


# -- sharded ------------------------------------------------------------------------------------

SHARDED = [("Explicit", "rows"), ("Explicit", "vocab"), ("Auto", "vocab"), ("Auto", "rows")]


# pallas: the vocabulary split only (its kernel's vocabulary offsets; the rows split runs on
# reference and chunked)
@pytest.mark.parametrize("kind,layout", [pallas_slow(*c) if c[1] == "rows" else c for c in SHARDED])
@pytest.mark.parametrize("memory", ["lean", "fast"])
def test_sharded(backend, rng, kind, layout, memory):
    """Under jit with sharded inputs: the unsharded call's values and gradients."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    if memory == "fast" and backend != "reference":
        pytest.skip("the fast mode has no backend: run once")
    h, _, w, _, b, _ = head_inputs(rng, (4, 3), 64, 8, jnp.float32, "vd", True)
    t = jnp.asarray(rng.integers(0, 64, (4, 3)))
    g = cotangent(rng, (4, 3))
    lean_backend = None if memory == "fast" else backend

    def loss(h, w, b):
        logp, ent = jk.linear_logprobs(
            h, w, t, b, top_k=9, top_p=0.8, return_entropy=True, backend=lean_backend, memory=memory
        )
        return jnp.sum(g * logp + ent)

    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(h, w, b)
    got = on_two_devices(loss, h, w, b, kind=kind, layout=layout)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, c in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("kind,layout", SHARDED)
def test_sharded_where_the_search_finds_the_max(rng, monkeypatch, kind, layout):
    """A search that finds each row's max itself (as ffi's on a GPU) under sharded inputs:
    the rows split skips the statistics pass on each device's rows, the vocabulary split over
    Explicit axes keeps it; the unsharded call's values and gradients either way."""
    from jaxrl_kernels.backends import reference

    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    monkeypatch.setitem(reference.BACKEND.ops, "kept_set", _find_on_whole_rows)
    monkeypatch.setattr(_find_on_whole_rows, "without_max", 0, raising=False)
    h, _, w, _, b, _ = head_inputs(rng, (4, 3), 64, 8, jnp.float32, "vd", True)
    t = jnp.asarray(rng.integers(0, 64, (4, 3)))
    g = cotangent(rng, (4, 3))

    def loss(h, w, b):
        logp, ent = jk.linear_logprobs(
            h, w, t, b, top_k=9, top_p=0.8, return_entropy=True, backend="chunked"
        )
        return jnp.sum(g * logp + ent)

    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(h, w, b)
    _find_on_whole_rows.without_max = 0
    got = on_two_devices(loss, h, w, b, kind=kind, layout=layout)
    if layout == "rows" or kind == "Explicit":  # Auto axes leave the vocabulary split to XLA
        assert (_find_on_whole_rows.without_max > 0) == (layout == "rows")
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for a, c in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)


def test_shard_map_vocab_axis(backend, rng):
    """Inside a user's shard_map with the vocabulary split: the kept set of the whole row."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    h, _, w, _, _, _ = head_inputs(rng, (6,), 64, 8, jnp.float32, "dv", False)
    t = jnp.asarray(rng.integers(0, 64, (6,)))
    mesh = jax.make_mesh((2,), ("v",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:2])
    kw = dict(
        weight_layout="dv", top_k=12, top_p=0.7, min_p=0.02, return_entropy=True, backend=backend
    )

    @jax.shard_map(mesh=mesh, in_specs=(P(), P(None, "v")), out_specs=(P(), P()))
    def sharded(h, w_slice):
        return jk.linear_logprobs(h, w_slice, t, vocab_axis="v", **kw)

    want = jk.linear_logprobs(h, w, t, **kw)
    with jax.set_mesh(mesh):
        w_sharded = jax.device_put(w, NamedSharding(mesh, P(None, "v")))
        got = jax.jit(sharded)(h, w_sharded)
        g = jax.jit(jax.grad(lambda h, w: jnp.sum(sharded(h, w)[0]), argnums=(0, 1)))(h, w_sharded)
    g_want = jax.grad(lambda h, w: jnp.sum(jk.linear_logprobs(h, w, t, **kw)[0]), argnums=(0, 1))(
        h, w
    )
    for a, c in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5, atol=1e-6)
    for a, c in zip(g, g_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)


# -- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["pallas", "ffi", "chunked", "fast"])
@pytest.mark.parametrize("trunc", [dict(top_k=50, top_p=0.95), dict(top_p=0.9, min_p=0.02)])
def test_gpu(rng, impl, trunc):
    """The kernel backends' sampler-matched log-probs on the GPU (bfloat16; the fast mode
    float32): 300 rows, V = 12304 (not a multiple of 256)."""
    if impl not in ("fast",) + tuple(jk.available_backends("linear_logprobs")):
        pytest.skip(f"{impl} is not available here")
    dtype = jnp.float32 if impl == "fast" else jnp.bfloat16
    h, h64, w, w64, b, b64 = head_inputs(rng, (3, 100), 12304, 256, dtype, "vd", True)
    targets = rng.integers(0, 12304, (3, 100)).astype(np.int32)
    check_linear(
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        trunc,
        layout="vd",
        temperature=0.9,
        backend=None if impl == "fast" else impl,
        memory="fast" if impl == "fast" else "lean",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("trunc", [dict(top_k=50, top_p=0.95), dict(top_p=0.9, min_p=0.02)])
def test_gpu_fast_bf16_on_the_kept_logits_kernel(rng, trunc):
    """``memory="fast"`` in bfloat16 (the kept logits from ffi's kernel where it serves the
    call) against the same op with the kernel withheld (XLA's GEMM and reductions): the two
    kept-logit arrays differ by at most one rounding step in a few entries, so each row's kept
    set and its log-prob, entropy and gradients agree but for rows where such a step crosses
    a truncation's threshold. 600 rows (above ffi.linear.KEPT_LOGITS_MIN_ROWS), V = 12304."""
    from benchmarks.bench_tokens import xla_logits
    from jaxrl_kernels.backends import ffi

    if ffi.unavailable_reason():
        pytest.skip(ffi.unavailable_reason())
    h, _, w, _, b, _ = head_inputs(rng, (6, 100), 12304, 256, jnp.bfloat16, "vd", True)
    targets = jnp.asarray(rng.integers(0, 12304, (6, 100)).astype(np.int32))
    kw = dict(
        bias=b, temperature=0.9, return_entropy=True, return_kept=True, memory="fast", **trunc
    )

    def run():
        f = lambda h, w: jk.linear_logprobs(h, w, targets, **kw)
        outs = jax.jit(f)(h, w)
        grads = jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w)[0]), argnums=(0, 1)))(h, w)
        return [np.asarray(x, np.float32) for x in (*outs, *grads)]

    assert "kept_logits: ffi" in jk.explain("linear_logprobs", h, w, targets, **kw)
    logp, ent, kept, dh, dw = run()
    logp_x, ent_x, kept_x, dh_x, dw_x = xla_logits(run)()
    same = (kept == kept_x).all(axis=-1) if kept.ndim > 2 else kept == kept_x
    assert same.mean() > 0.98, same.mean()
    rows = same & (kept > 0)
    np.testing.assert_allclose(logp[rows], logp_x[rows], rtol=0, atol=2e-2)
    np.testing.assert_allclose(ent[rows], ent_x[rows], rtol=0, atol=2e-2)
    for a, c in ((dh, dh_x), (dw, dw_x)):
        assert np.linalg.norm(a - c) <= 2e-2 * np.linalg.norm(c)
