"""linear_logprobs against the float64 oracle: both weight layouts, bias, VJP to hidden, weight
and bias."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
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

# (leading shape, V, D, temperature, with bias); every dtype and layout
CASES = [
    ((5,), 7, 16, 1.0, False),
    ((1,), 1, 8, 1.0, True),
    ((3, 4), 7, 8, 0.7, True),
    ((6,), 1000, 32, 1.0, False),
    ((2, 3), 1000, 16, 1.5, True),
    ((67,), 300, 24, 1.0, True),
]
# Large vocabularies / many rows (the vocabulary-chunked paths): one dtype and layout each.
BIG_CASES = [
    pallas_slow((2,), 32003, 16, 1.0, True, jnp.float32, "vd"),
    pallas_slow((2,), 32003, 16, 1.0, False, jnp.bfloat16, "dv"),
    pallas_slow((64,), 32003, 8, 1.0, False, jnp.float32, "dv"),
    pallas_slow((16, 128), 1000, 16, 1.2, True, jnp.float32, "vd"),
]
LAYOUTS = ["vd", "dv"]


def make_inputs(rng, lead, vocab, d, dtype, layout, with_bias):
    hidden, h64 = rand(rng, lead + (d,), dtype)
    wshape = (vocab, d) if layout == "vd" else (d, vocab)
    weight, w64 = rand(rng, wshape, dtype, scale=2.0 / np.sqrt(d))
    bias, b64 = rand(rng, (vocab,), dtype, scale=0.5) if with_bias else (None, None)
    targets = jnp.asarray(rng.integers(0, vocab, size=lead), jnp.int32)
    return hidden, h64, weight, w64, bias, b64, targets


def check_linear(
    backend,
    rng,
    hidden,
    h64,
    weight,
    w64,
    bias,
    b64,
    targets,
    *,
    layout,
    temperature,
    ignore_index=None,
):
    dtype = hidden.dtype
    primals = (hidden, weight) if bias is None else (hidden, weight, bias)

    def fn(h, w, b=None):
        return jk.linear_logprobs(
            h,
            w,
            targets,
            b,
            weight_layout=layout,
            temperature=temperature,
            ignore_index=ignore_index,
            return_entropy=True,
            backend=backend,
        )

    (logp, ent), vjp = jax.vjp(fn, *primals)
    assert_f32(logp, ent)
    t = np.asarray(targets)
    kw = dict(weight_layout=layout, temperature=temperature, ignore_index=ignore_index)
    want = oracle.linear_logprobs(h64, w64, t, b64, **kw)
    want32 = oracle.linear_logprobs(h64, w64, t, b64, dt=np.float32, **kw)
    z64 = oracle.linear_logits(h64, w64, b64, weight_layout=layout) / temperature
    zscale = np.max(np.abs(z64), initial=0)
    assert_close(logp, want[0], in_dtype=dtype, want32=want32[0], scale=zscale, name="logp")
    assert_close(ent, want[1], in_dtype=dtype, want32=want32[1], scale=zscale, name="entropy")

    g_lp, g_ent = cotangent(rng, targets.shape), cotangent(rng, targets.shape)
    grads = vjp((g_lp, g_ent))
    gw = oracle.linear_logprobs_vjp(h64, w64, t, np.asarray(g_lp), np.asarray(g_ent), b64, **kw)
    gw32 = oracle.linear_logprobs_vjp(
        h64, w64, t, np.asarray(g_lp), np.asarray(g_ent), b64, dt=np.float32, **kw
    )
    for name, got, p, w, w32 in zip(("d_hidden", "d_weight", "d_bias"), grads, primals, gw, gw32):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w, in_dtype=dtype, want32=w32, name=name)
    return logp, ent, grads


DTYPE_LAYOUTS = [(jnp.float32, "vd"), (jnp.float32, "dv"), (jnp.bfloat16, "vd")]
# pallas (interpret mode is slow; tests/backends/test_pallas_linear.py tests its kernels) runs each
# case once, the dtype-layouts in turn (each twice), but CASES[3] (V 1000 like CASES[4]: each
# dtype-layout still once); the rest is pallas_slow.
PALLAS_VALUES = {c + DTYPE_LAYOUTS[i % len(DTYPE_LAYOUTS)] for i, c in enumerate(CASES) if i != 3}


@pytest.mark.parametrize(
    "lead,vocab,d,temperature,with_bias,dtype,layout",
    pallas_sample(PALLAS_VALUES, CASES, DTYPE_LAYOUTS),
)
def test_values_and_vjp(backend, rng, lead, vocab, d, temperature, with_bias, dtype, layout):
    h, h64, w, w64, b, b64, t = make_inputs(rng, lead, vocab, d, dtype, layout, with_bias)
    check_linear(backend, rng, h, h64, w, w64, b, b64, t, layout=layout, temperature=temperature)


@pytest.mark.parametrize("lead,vocab,d,temperature,with_bias,dtype,layout", BIG_CASES)
def test_values_and_vjp_big(backend, rng, lead, vocab, d, temperature, with_bias, dtype, layout):
    test_values_and_vjp(backend, rng, lead, vocab, d, temperature, with_bias, dtype, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_token_logprobs_of_logits(backend, rng, layout):
    """The fused op equals token_logprobs(hidden @ W^T + b) (both on this backend)."""
    h, _, w, _, b, _, t = make_inputs(rng, (4, 3), 50, 12, jnp.float32, layout, True)
    logits = (h @ (w.T if layout == "vd" else w)) + b
    a = jk.linear_logprobs(h, w, t, b, weight_layout=layout, backend=backend)
    ref = jk.token_logprobs(logits, t, backend=backend)
    np.testing.assert_allclose(np.asarray(a), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_ignore_index(backend, rng, ignore_index):
    lead, vocab, d = (3, 5), 9, 8
    h, h64, w, w64, b, b64, _ = make_inputs(rng, lead, vocab, d, jnp.float32, "vd", True)
    t = rng.integers(0, vocab, size=lead)
    t[1, :] = ignore_index
    t[2, 1::2] = ignore_index
    if ignore_index == 2:
        t[0] = np.where(t[0] == 2, 3, t[0])
    targets = jnp.asarray(t, jnp.int32)
    logp, ent, grads = check_linear(
        backend,
        rng,
        h,
        h64,
        w,
        w64,
        b,
        b64,
        targets,
        layout="vd",
        temperature=1.0,
        ignore_index=ignore_index,
    )
    ign = t == ignore_index
    assert_zero(np.asarray(logp)[ign], "logp at ignored targets")
    assert_zero(np.asarray(ent)[ign], "entropy at ignored targets")
    assert_zero(np.asarray(grads[0])[ign], "d_hidden at ignored targets")


def test_all_ignored_gives_zero_grads(backend, rng):
    h, _, w, _, b, _, _ = make_inputs(rng, (2, 3), 7, 4, jnp.float32, "dv", True)
    t = jnp.full((2, 3), -1, jnp.int32)
    f = lambda h, w, b: jnp.sum(
        jk.linear_logprobs(h, w, t, b, weight_layout="dv", ignore_index=-1, backend=backend)
    )
    val, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(h, w, b)
    assert float(val) == 0.0
    for g in grads:
        assert_zero(g)


def test_targets_cotangent_is_float0(backend, rng):
    """Targets are not differentiable: their cotangent is float0 (or zero)."""
    h, _, w, _, _, _, t = make_inputs(rng, (3,), 7, 4, jnp.float32, "vd", False)
    out, vjp = jax.vjp(lambda h, w, t: jk.linear_logprobs(h, w, t, backend=backend), h, w, t)
    _, _, dt = vjp(jnp.ones_like(out))
    assert dt.dtype == jax.dtypes.float0 or not np.any(np.asarray(dt))


def test_extreme_hidden_stays_finite(backend, rng):
    """Logits of order 1e4 through the matmul stay finite in values and gradients."""
    h, h64, w, w64, _, _, t = make_inputs(rng, (4,), 11, 4, jnp.float32, "vd", False)
    h = h * 1e4 / 4
    h64 = np.asarray(h).astype(np.float64)
    (lp, ent), vjp = jax.vjp(
        lambda h, w: jk.linear_logprobs(h, w, t, return_entropy=True, backend=backend), h, w
    )
    dh, dw = vjp((jnp.ones(4), jnp.ones(4)))
    for x in (lp, ent, dh, dw):
        assert np.isfinite(np.asarray(x)).all()
    z = oracle.linear_logits(h64, w64)
    assert_close(lp, oracle.linear_logprobs(h64, w64, np.asarray(t))[0], scale=np.abs(z).max())
