"""The Pallas backward passes under a per-row floor (a truncated softmax) against float64.

Per row the kept set is ``{j : u_j >= floor}`` with ``u = z / T``; the caller passes that set's
lse and entropy, and the backward uses ``p = exp(u − lse)`` on it and 0 below the floor, while
the one-hot term stays wherever the target lies. CPU: interpret mode, odd sizes (N, V and D
not multiples of the tiles) and many vocabulary chunks / splits.

Special rows: 0 has floor = −inf (no truncation), 1 a target below its floor, 2 no gradient
(lse = +inf, g = g_ent = 0). Each floor is the midpoint of two distinct logits of its row, so
float rounding cannot move a logit across it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels.backends.pallas import linear as pallas_linear
from jaxrl_kernels.backends.pallas import logits as pl_logits
from tests.conftest import assert_close, dtype_id, rand

TINY = pallas_linear.Config(
    forward=pallas_linear.TileConfig(16, 16, 16, 4, 2),
    tiles_per_split=2,
    target_rows=16,
    target_k=16,
    grad=pallas_linear.TileConfig(16, 16, 16, 4, 2),
    chunk_bytes=1,
)
"""16-wide tiles and one 16-column tile per backward chunk."""

PLANS = {"default": None, "three_splits": pl_logits.LogitsLaunch(64, 3, 2, 1)}
"""For V = 150: the heuristic's plan, and three 64-wide tiles (the last 22 wide) on 3 splits."""

N, D, V, TEMPERATURE = 37, 40, 300, 0.8
NO_FLOOR, BELOW, DEAD = 0, 1, 2


def floors(u64):
    """Per row a float32 floor halfway between two distinct neighbouring values among the 3rd
    to 9th largest (the widest such gap), −inf on row NO_FLOOR."""
    out = np.empty(u64.shape[0], np.float32)
    for r, row in enumerate(u64):
        top = np.unique(row)[::-1][2:10]
        k = int(np.argmax(top[:-1] - top[1:]))
        out[r] = np.float32((top[k] + top[k + 1]) / 2)
        assert top[k + 1] < out[r] < top[k]
    out[NO_FLOOR] = -np.inf
    return out


def truncated(u, floor, targets, g, g_ent, temperature, dt=np.float64):
    """(dz, lse, entropy) of the truncated softmax of ``u`` [N, V], in ``dt``; ``targets`` and
    ``g`` [N] or [N, K]; ``g_ent`` None for no entropy. Row DEAD gets dz = 0, lse = +inf."""
    u = np.asarray(u, dt)
    keep = u >= np.asarray(floor, np.float64)[:, None]
    m = np.max(np.where(keep, u, -np.inf), axis=1, keepdims=True)
    e = np.where(keep, np.exp(u - m), 0.0).astype(dt)
    lse = m + np.log(np.sum(e, axis=1, keepdims=True))
    p = np.where(keep, np.exp(u - lse), 0.0).astype(dt)
    log_p = np.where(keep, u - lse, 0.0)
    entropy = -np.sum(p * log_p, axis=1, keepdims=True)
    t2, g2 = np.asarray(targets).reshape(len(u), -1), np.asarray(g, dt).reshape(len(u), -1)
    onehot = np.zeros(u.shape, dt)
    np.add.at(onehot, (np.arange(len(u))[:, None].repeat(t2.shape[1], 1), t2), g2)
    dz = onehot - np.sum(g2, axis=1, keepdims=True) * p
    if g_ent is not None:
        dz = dz - np.asarray(g_ent, dt)[:, None] * p * (log_p + entropy)
    dz = (dz / dt(temperature)).astype(dt)
    dz[DEAD] = 0
    lse, entropy = lse[:, 0], entropy[:, 0]
    lse[DEAD] = np.inf
    return dz, lse, entropy


def head_grads(dz, h, w, layout, dt=np.float64):
    """(d_hidden, d_weight, d_bias) of z = h Wᵀ + b from the logit gradient ``dz``."""
    dz, h, w = (np.asarray(x, dt) for x in (dz, h, w))
    if layout == "vd":
        return dz @ w, dz.T @ h, dz.sum(0)
    return dz @ w.T, h.T @ dz, dz.sum(0)


def cotangents(rng, shape, entropy):
    g = rng.standard_normal(shape).astype(np.float32)
    g_ent = rng.standard_normal(shape[0]).astype(np.float32) if entropy else None
    g[DEAD] = 0
    if g_ent is not None:
        g_ent[DEAD] = 0
    return g, g_ent


def linear_case(rng, dtype, layout, bias, k=None):
    h, h64 = rand(rng, (N, D), dtype)
    w, w64 = rand(rng, (V, D) if layout == "vd" else (D, V), dtype, scale=2.0 / np.sqrt(D))
    b, b64 = rand(rng, (V,), dtype, scale=0.5) if bias else (None, None)
    z64 = h64 @ (w64.T if layout == "vd" else w64) + (0.0 if b64 is None else b64)
    u64 = z64 / TEMPERATURE
    floor = floors(u64)
    shape = (N,) if k is None else (N, k)
    t = rng.integers(0, V, shape).astype(np.int32)
    t.reshape(N, -1)[BELOW, 0] = np.argmin(u64[BELOW])
    return (h, w, b, t, floor), (h64, w64, b64, u64)


@functools.cache
def _linear_backward(layout, config):
    return jax.jit(
        functools.partial(
            pallas_linear.linear_backward,
            weight_layout=layout,
            temperature=TEMPERATURE,
            config=config,
        )
    )


def check_linear(got, primals, want, want32, dtype):
    for name, x, primal, w64, w32 in zip(
        ("d_hidden", "d_weight", "d_bias"), got, primals, want, want32
    ):
        if primal is None:
            assert x is None, name
            continue
        # a backend's d_hidden is float32, unrounded (dispatch/contract.py: the engine rounds
        # it once, after any sum over a vocabulary split); the head's gradients keep its dtype
        want_dtype = np.float32 if name == "d_hidden" else primal.dtype
        assert x.dtype == want_dtype and x.shape == primal.shape, name
        assert_close(x, w64, in_dtype=dtype, want32=w32, name=name)


def run_linear(rng, dtype, layout, bias, entropy, k=None, config=TINY):
    (h, w, b, t, floor), (h64, w64, b64, u64) = linear_case(rng, dtype, layout, bias, k)
    g, g_ent = cotangents(rng, t.shape, entropy)
    dz, lse, ent = truncated(u64, floor, t, g, g_ent, TEMPERATURE)
    dz32, _, _ = truncated(u64.astype(np.float32), floor, t, g, g_ent, TEMPERATURE, np.float32)
    f32 = lambda x: None if x is None or not entropy else jnp.asarray(x, jnp.float32)
    got = _linear_backward(layout, config)(
        h,
        w,
        b,
        jnp.asarray(t),
        jnp.asarray(lse, jnp.float32),
        f32(ent),
        jnp.asarray(g),
        f32(g_ent),
        floor=jnp.asarray(floor),
    )
    check_linear(
        got,
        (h, w, b),
        head_grads(dz, h64, w64, layout),
        head_grads(dz32, h64, w64, layout, np.float32),
        dtype,
    )
    return got


# CI runs a pairwise-covering sample of dtype × layout × bias × entropy (every pair of values
# of any two of them; bfloat16 with bias and entropy also in the tests below), all 16 with
# JAXRL_TEST_SLOW=1
LINEAR_FLOOR_PAIRWISE = {
    (jnp.float32, "vd", True, True),
    (jnp.float32, "dv", False, False),
    (jnp.bfloat16, "vd", False, False),
    (jnp.bfloat16, "dv", True, False),
    (jnp.bfloat16, "dv", False, True),
}


@pytest.mark.parametrize(
    "dtype,layout,bias,entropy",
    [
        pytest.param(
            dtype,
            layout,
            bias,
            entropy,
            id=f"{dtype_id(dtype)}-{layout}-{'' if bias else 'no_'}bias-"
            f"{'' if entropy else 'no_'}entropy",
            marks=()
            if (dtype, layout, bias, entropy) in LINEAR_FLOOR_PAIRWISE
            else pytest.mark.slow,
        )
        for dtype in (jnp.float32, jnp.bfloat16)
        for layout in ("vd", "dv")
        for bias in (True, False)
        for entropy in (True, False)
    ],
)
def test_linear_backward_floor(rng, dtype, layout, bias, entropy):
    got = run_linear(rng, dtype, layout, bias, entropy)
    assert not np.any(np.asarray(got[0][DEAD], np.float32)), "d_hidden of a row without gradient"


@pytest.mark.parametrize(
    "layout,dtype", [("vd", jnp.bfloat16), ("dv", jnp.float32)], ids=["vd-bfloat16", "dv-float32"]
)
def test_linear_backward_floor_k_ids(rng, layout, dtype):
    """Targets [N, K]: the floor masks the −p part only; row BELOW's first id is under its floor."""
    run_linear(rng, dtype, layout, True, True, k=3)


def test_linear_backward_floor_default_config(rng):
    run_linear(rng, jnp.bfloat16, "dv", True, True, config=pallas_linear.DEFAULT_CONFIG)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_linear_backward_floor_none(rng, dtype):
    """floor=None is the call without it, bit for bit; an all −inf floor truncates nothing."""
    (h, w, b, t, _), (_, _, _, u64) = linear_case(rng, dtype, "vd", True)
    g, g_ent = cotangents(rng, t.shape, True)
    _, lse, ent = truncated(u64, np.full(N, -np.inf), t, g, g_ent, TEMPERATURE)
    args = (
        h,
        w,
        b,
        jnp.asarray(t),
        jnp.asarray(lse, jnp.float32),
        jnp.asarray(ent, jnp.float32),
        jnp.asarray(g),
        jnp.asarray(g_ent),
    )
    fn = _linear_backward("vd", TINY)
    plain, with_none = fn(*args), fn(*args, floor=None)
    no_cut = fn(*args, floor=jnp.full((N,), -jnp.inf, jnp.float32))
    for a, b_, c in zip(plain, with_none, no_cut):
        a, b_, c = (np.asarray(x, np.float32) for x in (a, b_, c))
        assert np.array_equal(a, b_)
        np.testing.assert_allclose(c, a, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- logits


def token_case(rng, dtype, entropy, n=11, vocab=150):
    x, x64 = rand(rng, (n, vocab), dtype, scale=3.0)
    u64 = x64 / TEMPERATURE
    floor = floors(u64)
    t = rng.integers(0, vocab, n).astype(np.int32)
    t[BELOW] = np.argmin(u64[BELOW])
    g, g_ent = cotangents(rng, (n,), entropy)
    return x, u64, floor, t, g, g_ent


def _token_backward(plan):
    return jax.jit(
        functools.partial(pl_logits.token_backward, temperature=TEMPERATURE, plan=PLANS[plan])
    )


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no_entropy"])
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_token_backward_floor(rng, dtype, plan, entropy):
    x, u64, floor, t, g, g_ent = token_case(rng, dtype, entropy)
    dz, lse, ent = truncated(u64, floor, t, g, g_ent, TEMPERATURE)
    dz32, _, _ = truncated(u64.astype(np.float32), floor, t, g, g_ent, TEMPERATURE, np.float32)
    f32 = lambda v: jnp.asarray(v, jnp.float32) if entropy else None
    got = _token_backward(plan)(
        x,
        jnp.asarray(t),
        jnp.asarray(lse, jnp.float32),
        f32(ent),
        jnp.asarray(g),
        f32(g_ent),
        floor=jnp.asarray(floor),
    )
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_close(got, dz, in_dtype=dtype, want32=dz32, name="d_logits")
    assert not np.any(np.asarray(got[DEAD], np.float32))
    below = u64 < floor[:, None]
    below[np.arange(len(t)), t] = False
    assert not np.any(np.asarray(got, np.float32)[below]), "p = 0 under the floor"
    assert np.asarray(got, np.float32)[BELOW, t[BELOW]] != 0, "the target under the floor"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_token_backward_floor_none(rng, dtype):
    x, u64, _, t, g, g_ent = token_case(rng, dtype, True)
    _, lse, ent = truncated(u64, np.full(len(t), -np.inf), t, g, g_ent, TEMPERATURE)
    args = (
        x,
        jnp.asarray(t),
        jnp.asarray(lse, jnp.float32),
        jnp.asarray(ent, jnp.float32),
        jnp.asarray(g),
        jnp.asarray(g_ent),
    )
    fn = _token_backward("three_splits")
    plain, with_none = fn(*args), fn(*args, floor=None)
    no_cut = fn(*args, floor=jnp.full((len(t),), -jnp.inf, jnp.float32))
    assert np.array_equal(np.asarray(plain, np.float32), np.asarray(with_none, np.float32))
    np.testing.assert_allclose(
        np.asarray(no_cut, np.float32), np.asarray(plain, np.float32), rtol=1e-6, atol=1e-7
    )
