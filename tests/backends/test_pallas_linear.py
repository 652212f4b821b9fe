"""The Pallas linear_logprobs kernels against the float64 oracle.

CPU: interpret mode (the same kernels, ``interpret=True``) at small sizes, each case one jitted
forward + VJP. Tile configs as small as the kernels allow exercise every ragged edge (N, V and D
not multiples of the tile), several vocabulary splits and several backward chunks.
GPU (``-m gpu``): the LM-head sizes of the benchmark in bf16 against float64 computed on the
device, and bitwise determinism.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from benchmarks import kernel_entry
from jaxrl_kernels.backends.chunked import logprobs as chunked
from jaxrl_kernels.backends.pallas import linear as pallas_linear
from jaxrl_kernels.dispatch.contract import Problem
from tests import conftest
from tests.conftest import assert_close, assert_zero, dtype_id, rand
from tests.support import oracle

IGNORE = -100

TINY = pallas_linear.Config(
    forward=pallas_linear.TileConfig(16, 16, 16, 4, 2),
    tiles_per_split=2,
    target_rows=16,
    target_k=16,
    grad=pallas_linear.TileConfig(16, 16, 16, 4, 2),
    chunk_bytes=1,
)
"""16-wide tiles, 2 tiles per split, and one 16-column tile per backward chunk."""


def make_case(rng, n, d, vocab, dtype, layout, *, bias, invalid=(), bad=()):
    h, h64 = rand(rng, (n, d), dtype)
    wshape = (vocab, d) if layout == "vd" else (d, vocab)
    w, w64 = rand(rng, wshape, dtype, scale=2.0 / np.sqrt(d))
    b, b64 = rand(rng, (vocab,), dtype, scale=0.5) if bias else (None, None)
    t = rng.integers(0, vocab, size=n).astype(np.int32)
    valid = np.ones(n, bool)
    valid[list(invalid)] = False
    for i, value in bad:
        t[i] = value
    return (h, w, b, t, valid), (h64, w64, b64)


@functools.cache
def _jitted(layout, temperature, return_entropy, config):
    def run(h, w, b, t, valid, g_logp, g_ent):
        def f(h, w, b):
            return kernel_entry.pallas_linear_logprobs(
                h,
                w,
                b,
                t,
                valid,
                weight_layout=layout,
                temperature=temperature,
                return_entropy=return_entropy,
                config=config,
            )

        out, vjp = jax.vjp(f, h, w, b)
        return out, vjp((g_logp, g_ent if return_entropy else None))

    return jax.jit(run)


def check(rng, case, wide, *, layout, temperature=1.0, return_entropy=True, config=None):
    """Forward values and the VJP (random cotangents) of the primitive against the oracle."""
    (h, w, b, t, valid), (h64, w64, b64) = case, wide
    n = h.shape[0]
    dtype = jnp.result_type(h, w)
    g_lp = rng.standard_normal(n).astype(np.float32)
    g_ent = rng.standard_normal(n).astype(np.float32)
    config = config or pallas_linear.DEFAULT_CONFIG
    fn = _jitted(layout, float(temperature), return_entropy, config)
    (logp, ent), grads = fn(
        h, w, b, jnp.asarray(t), jnp.asarray(valid), jnp.asarray(g_lp), jnp.asarray(g_ent)
    )
    assert logp.dtype == jnp.float32 and logp.shape == (n,)
    assert (ent is not None) == return_entropy

    t_oracle = np.where(valid, t, IGNORE)
    kw = dict(weight_layout=layout, temperature=temperature, ignore_index=IGNORE)
    want = oracle.linear_logprobs(h64, w64, t_oracle, b64, **kw)
    want32 = oracle.linear_logprobs(h64, w64, t_oracle, b64, dt=np.float32, **kw)
    z64 = oracle.linear_logits(h64, w64, b64, weight_layout=layout)
    zscale = np.max(np.abs(z64)) / temperature
    assert_close(logp, want[0], in_dtype=dtype, want32=want32[0], scale=zscale, name="logp")
    if return_entropy:
        assert ent.dtype == jnp.float32
        assert_close(ent, want[1], in_dtype=dtype, want32=want32[1], scale=zscale, name="entropy")

    # NaN rows (valid, target out of range) get no gradient: the oracle ignores them too.
    bad = valid & ((t < 0) | (t >= (w64.shape[0] if layout == "vd" else w64.shape[1])))
    t_grad = np.where(bad, IGNORE, t_oracle)
    ge = g_ent if return_entropy else None
    gw = oracle.linear_logprobs_vjp(h64, w64, t_grad, g_lp, ge, b64, **kw)
    gw32 = oracle.linear_logprobs_vjp(h64, w64, t_grad, g_lp, ge, b64, dt=np.float32, **kw)
    for name, got, primal, want_g, want_g32 in zip(
        ("d_hidden", "d_weight", "d_bias"), grads, (h, w, b), gw, gw32
    ):
        if primal is None:
            assert got is None
            continue
        assert got.dtype == primal.dtype and got.shape == primal.shape, name
        assert_close(got, want_g, in_dtype=dtype, want32=want_g32, name=name)
    return (logp, ent), grads


# ----------------------------------------------------------------------------- CPU, interpret


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_odd_sizes_bias_temperature_ignored_rows(rng, dtype, layout):
    """N = 37, D = 40 (not multiples of 16), V = 1000; ignored rows, one out-of-range target."""
    case, wide = make_case(
        rng, 37, 40, 1000, dtype, layout, bias=True, invalid=(3, 20), bad=((5, 1000), (6, -2))
    )
    (logp, _), _ = check(rng, case, wide, layout=layout, temperature=0.7)
    assert np.isnan(logp[5]) and np.isnan(logp[6]) and logp[3] == 0 and logp[20] == 0


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_tiny_tiles_many_splits_and_chunks(rng, dtype, layout):
    """16-wide tiles: ragged N/V/D tiles, 10 vocabulary splits, 19 backward chunks + a tail."""
    case, wide = make_case(rng, 37, 40, 300, dtype, layout, bias=True, invalid=(0,))
    check(rng, case, wide, layout=layout, temperature=1.3, config=TINY)


@pytest.mark.parametrize(
    "vocab,layout,dtype,entropy,bias",
    [
        (1, "vd", jnp.float32, True, False),
        (7, "dv", jnp.bfloat16, False, True),
        (32003, "vd", jnp.bfloat16, True, True),
        (32003, "dv", jnp.float32, False, False),
    ],
    ids=lambda x: dtype_id(x) if not isinstance(x, (int, str, bool)) else str(x),
)
def test_vocab_sizes(rng, vocab, layout, dtype, entropy, bias):
    n = 2 if vocab > 1000 else 5
    case, wide = make_case(rng, n, 24, vocab, dtype, layout, bias=bias)
    check(rng, case, wide, layout=layout, return_entropy=entropy)


def test_single_row(rng):
    case, wide = make_case(rng, 1, 40, 1000, jnp.float32, "vd", bias=False)
    check(rng, case, wide, layout="vd", temperature=2.0)


def test_float16(rng):
    case, wide = make_case(rng, 9, 24, 200, jnp.float16, "vd", bias=True)
    check(rng, case, wide, layout="vd", temperature=0.9)


def test_mixed_dtypes_compute_in_float32(rng):
    """float32 hidden with a bf16 weight: tiles are cast in the kernel, W is not copied."""
    (h, w, b, t, valid), (h64, w64, b64) = make_case(
        rng, 11, 24, 100, jnp.bfloat16, "vd", bias=True
    )
    h = h.astype(jnp.float32)
    check(rng, (h, w, b, t, valid), (h64, w64, b64), layout="vd")


def test_all_rows_ignored(rng):
    (h, w, b, t, _), _ = make_case(rng, 6, 24, 50, jnp.float32, "dv", bias=True)
    valid = np.zeros(6, bool)
    fn = _jitted("dv", 1.0, True, pallas_linear.DEFAULT_CONFIG)
    (logp, ent), grads = fn(
        h,
        w,
        b,
        jnp.asarray(t),
        jnp.asarray(valid),
        jnp.ones(6, jnp.float32),
        jnp.ones(6, jnp.float32),
    )
    assert_zero(logp, "logp")
    assert_zero(ent, "entropy")
    for name, g in zip(("d_hidden", "d_weight", "d_bias"), grads):
        assert_zero(g, name)


def test_public_op_jit_and_determinism(rng):
    """jaxrl_kernels.linear_logprobs(backend="pallas") under jit; two runs are bitwise equal."""
    h, h64 = rand(rng, (3, 5, 24), jnp.float32)
    w, w64 = rand(rng, (24, 70), jnp.float32, scale=0.4)
    t = jnp.asarray(rng.integers(0, 70, (3, 5)), jnp.int32).at[1, 2].set(IGNORE)

    @jax.jit
    def fn(h, w):
        def loss(h, w):
            lp, ent = jk.linear_logprobs(
                h,
                w,
                t,
                weight_layout="dv",
                ignore_index=IGNORE,
                return_entropy=True,
                backend="pallas",
            )
            return jnp.sum(lp * jnp.arange(15.0).reshape(3, 5)) + jnp.sum(ent), lp

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

    first = fn(h, w)
    (_, logp), _ = first
    want, _ = oracle.linear_logprobs(
        h64, w64, np.asarray(t), weight_layout="dv", ignore_index=IGNORE
    )
    assert_close(logp, want, scale=np.max(np.abs(h64.reshape(15, 24) @ w64)), name="logp")
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(fn(h, w))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_vmap(rng):
    """vmap over a batch of (hidden, targets): the same as one call per batch element."""
    hs, _ = rand(rng, (2, 7, 24), jnp.float32)
    w, _ = rand(rng, (60, 24), jnp.float32, scale=0.4)
    ts = jnp.asarray(rng.integers(0, 60, (2, 7)), jnp.int32)
    valid = jnp.ones(7, bool)

    def f(h, t):
        return kernel_entry.pallas_linear_logprobs(
            h, w, None, t, valid, weight_layout="vd", temperature=1.0, return_entropy=True
        )

    def loss(h, t):
        lp, ent = f(h, t)
        return jnp.sum(lp) + 0.5 * jnp.sum(ent)

    batched = jax.jit(jax.vmap(jax.value_and_grad(loss)))(hs, ts)
    for i in range(2):
        one = jax.jit(jax.value_and_grad(loss))(hs[i], ts[i])
        np.testing.assert_allclose(batched[0][i], one[0], rtol=1e-6)
        np.testing.assert_allclose(batched[1][i], one[1], rtol=1e-6, atol=1e-7)


def test_backward_matches_chunked_backend(rng):
    """The backward part (logprob_core contract) agrees with the chunked backend's: rows without
    a gradient come with lse = +inf and zero cotangents; a target outside [0, V) adds no
    one-hot term."""
    (h, w, b, t, valid), _ = make_case(
        rng, 13, 24, 90, jnp.float32, "vd", bias=True, invalid=(2,), bad=((4, 95),)
    )
    t, valid = jnp.asarray(t), jnp.asarray(valid)
    kw = dict(weight_layout="vd", temperature=0.8)
    m, s, a, _ = chunked.linear_stats(h, w, b, t, valid, with_entropy=True, **kw)
    lse, ent = m + jnp.log(s), jnp.log(s) - a / s
    active = valid & (t >= 0) & (t < 90)
    lse = jnp.where(active, lse, jnp.inf)
    g_lp, g_ent = jnp.where(active, jnp.asarray(rng.standard_normal((2, 13)), jnp.float32), 0.0)
    got = jax.jit(functools.partial(pallas_linear.linear_backward, **kw))(
        h, w, b, t, lse, ent, g_lp, g_ent
    )
    want = chunked.linear_backward(h, w, b, t, lse, ent, g_lp, g_ent, **kw)
    for a_, b_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(a_), np.asarray(b_), rtol=1e-5, atol=1e-6)
    assert_zero(got[0][2], "d_hidden of an ignored row")


def test_declines_float64():
    problem = Problem(n_rows=4, vocab=8, hidden_dim=4, dtype="float64", platform="gpu")
    assert "float64" in pallas_linear.declines("linear_logprobs", problem)
    assert (
        pallas_linear.declines("linear_logprobs", dataclasses.replace(problem, dtype="bfloat16"))
        is None
    )


# ----------------------------------------------------------------------------- GPU


def _device_oracle(h, w, b, t, valid, g_lp, g_ent, *, layout, temperature, dtype, rows=512):
    """our formulas in ``dtype`` (float64 or float32, full precision) on the device, in row
    chunks: (logp, entropy, d_hidden, d_weight, d_bias) as device arrays (call it and use the
    results inside ``jax.enable_x64`` for float64)."""
    prec = jax.lax.Precision.HIGHEST
    cast = functools.partial(jnp.asarray, dtype=dtype)
    hw, ww = cast(h.astype(jnp.float32)), cast(w.astype(jnp.float32))
    bw = None if b is None else cast(b.astype(jnp.float32))
    wv = ww if layout == "vd" else ww.T

    @jax.jit  # the weight is an argument: a closed-over GiB array would become an HLO constant
    def part(wv, bw, hc, tc, vc, gl, ge):
        z = jnp.matmul(hc, wv.T, precision=prec)
        z = (z if bw is None else z + bw) / temperature
        lse = jax.scipy.special.logsumexp(z, axis=-1)
        logp_all = z - lse[:, None]
        p = jnp.exp(logp_all)
        mean_z = jnp.sum(p * z, axis=-1, keepdims=True)
        vocab = z.shape[1]
        ok = vc & (tc >= 0) & (tc < vocab)
        onehot = jnp.arange(vocab)[None, :] == tc[:, None]
        logp = jnp.sum(jnp.where(onehot, logp_all, 0), 1)
        logp = jnp.where(vc, jnp.where(ok, logp, jnp.nan), 0)
        ent = jnp.where(vc, jnp.where(ok, lse - mean_z[:, 0], jnp.nan), 0)
        dz = gl[:, None] * (onehot - p) - ge[:, None] * p * (z - mean_z)
        dz = jnp.where(ok[:, None], dz, 0) / temperature
        return (
            logp,
            ent,
            jnp.matmul(dz, wv, precision=prec),
            jnp.matmul(dz.T, hc, precision=prec),
            jnp.sum(dz, 0),
        )

    outs = [
        part(
            wv,
            bw,
            hw[i : i + rows],
            jnp.asarray(t[i : i + rows]),
            jnp.asarray(valid[i : i + rows]),
            cast(g_lp[i : i + rows]),
            cast(g_ent[i : i + rows]),
        )
        for i in range(0, h.shape[0], rows)
    ]
    logp, ent, dh = (jnp.concatenate([o[k] for o in outs]) for k in range(3))
    dwv = functools.reduce(lambda acc, o: acc + o[3], outs[1:], outs[0][3])
    db = functools.reduce(lambda acc, o: acc + o[4], outs[1:], outs[0][4])
    return logp, ent, dh, (dwv if layout == "vd" else dwv.T), db


def _assert_close_bf16_on_device(got, want, want32, name):
    """conftest.assert_close's bf16 rule, evaluated on the device (the arrays are GiB-sized):
    NaN at the same places, |got - want| <= |want32 - want| + slack·S (+ half an ulp of a
    16-bit output times |want|), S = max(max|want|, SCALE_FLOOR)."""
    out_dtype = got.dtype
    g = got.astype(jnp.float64)
    nan_g, nan_w = jnp.isnan(g), jnp.isnan(want)
    assert not bool(jnp.any(nan_g != nan_w)), f"{name}: NaN positions differ from the oracle"
    fin = ~nan_w
    s = max(float(jnp.max(jnp.where(fin, jnp.abs(want), 0))), conftest.SCALE_FLOOR)
    bound = jnp.abs(want32.astype(jnp.float64) - want) + conftest.LOW_PRECISION_SLACK * s
    if out_dtype != jnp.float32:
        bound = bound + float(jnp.finfo(out_dtype).eps) / 2 * jnp.abs(want)
    excess = jnp.where(fin, jnp.abs(g - want) - bound, -jnp.inf)
    worst = int(jnp.argmax(excess))
    n_bad = int(jnp.sum(excess > 0))
    assert n_bad == 0, (
        f"{name}: {n_bad} elements off; worst flat index {worst}: got "
        f"{float(g.ravel()[worst])} want {float(want.ravel()[worst])} (S={s:.3e})"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "vocab,layout,bias",
    [(32768, "vd", False), (50257, "vd", True), (50257, "dv", False), (131072, "vd", False)],
)
def test_gpu_lm_head_bf16_against_float64(rng, vocab, layout, bias):
    n, d = 4096, 2048
    case, _ = make_case(rng, n, d, vocab, jnp.bfloat16, layout, bias=bias, invalid=(7, 100))
    h, w, b, t, valid = case
    g_lp = rng.standard_normal(n).astype(np.float32)
    g_ent = rng.standard_normal(n).astype(np.float32)
    fn = _jitted(layout, 1.0, True, pallas_linear.DEFAULT_CONFIG)
    (logp, ent), grads = fn(
        h, w, b, jnp.asarray(t), jnp.asarray(valid), jnp.asarray(g_lp), jnp.asarray(g_ent)
    )
    kw = dict(layout=layout, temperature=1.0)
    with jax.enable_x64(True):
        want = _device_oracle(h, w, b, t, valid, g_lp, g_ent, dtype=jnp.float64, **kw)
        want32 = _device_oracle(h, w, b, t, valid, g_lp, g_ent, dtype=jnp.float32, **kw)
        names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
        for name, got, w64, w32 in zip(names, (logp, ent) + tuple(grads), want, want32):
            if got is not None:
                _assert_close_bf16_on_device(got, w64, w32, name)


@pytest.mark.gpu
def test_gpu_bitwise_deterministic(rng):
    case, _ = make_case(rng, 4096, 2048, 50257, jnp.bfloat16, "vd", bias=True, invalid=(3,))
    h, w, b, t, valid = case
    g = jnp.asarray(rng.standard_normal((2, 4096)), jnp.float32)
    fn = _jitted("vd", 1.0, True, pallas_linear.DEFAULT_CONFIG)
    first = jax.tree.map(np.asarray, fn(h, w, b, jnp.asarray(t), jnp.asarray(valid), g[0], g[1]))
    second = jax.tree.map(np.asarray, fn(h, w, b, jnp.asarray(t), jnp.asarray(valid), g[0], g[1]))
    for a, b_ in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        assert np.array_equal(a.view(np.uint8), b_.view(np.uint8))


@pytest.mark.gpu
def test_gpu_float32_full_precision(rng):
    """float32 inputs: IEEE float32 dots (not tf32) meet the 1e-5 bound."""
    case, wide = make_case(rng, 512, 1000, 32003, jnp.float32, "dv", bias=True, invalid=(1,))
    check(rng, case, wide, layout="dv", temperature=0.8)
