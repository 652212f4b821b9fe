"""kl_penalty, aggregate and group_advantages against the float64 oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from tests.conftest import (
    as_jnp,
    assert_close,
    assert_f32,
    assert_zero,
    call,
    cotangent,
    dtype_id,
    rand,
    random_mask,
)
from tests.support import oracle

DTYPES = [jnp.float32, jnp.bfloat16]
MODES = [
    "token_mean",
    "seq_mean_token_mean",
    "sequence_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
]


# ----------------------------------------------------------------------------- kl_penalty


def _logps(rng, shape, dtype, spread=1.0):
    lp64 = -np.abs(rng.standard_normal(shape)) * 2 - 0.05
    # |d| >= 0.15 survives bf16 rounding: no tie at the kink of "abs"
    ref64 = lp64 + rng.choice([-1, 1], shape) * (0.15 + spread * np.abs(rng.standard_normal(shape)))
    return as_jnp(lp64, dtype) + as_jnp(ref64, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3"])
@pytest.mark.op("kl_penalty")
def test_kl_penalty(backend, rng, estimator, dtype):
    lp, lp64, ref, ref64 = _logps(rng, (4, 9), dtype)
    kl, vjp = jax.vjp(lambda x: call(jk.kl_penalty, backend, x, ref, estimator), lp)
    assert_f32(kl)
    want = oracle.kl_penalty(lp64, ref64, estimator)
    want32 = oracle.kl_penalty(lp64, ref64, estimator, dt=np.float32)
    # k3 = exp(d) - d - 1 cancels for small d: its condition scale is exp(d) + |d| + 1.
    d = ref64 - lp64
    scale = np.exp(np.clip(d, -20, 20)) + np.abs(d) + 1 if estimator == "k3" else np.abs(d)
    assert_close(kl, want, in_dtype=dtype, want32=want32, scale=scale, name="kl")
    g = cotangent(rng, (4, 9))
    (d_lp,) = vjp(g)
    want_g = np.asarray(g) * oracle.kl_penalty_grad(lp64, ref64, estimator)
    want_g32 = np.asarray(g) * oracle.kl_penalty_grad(lp64, ref64, estimator, dt=np.float32)
    assert_close(d_lp, want_g, in_dtype=dtype, want32=want_g32, name="d_logp")


@pytest.mark.op("kl_penalty")
def test_kl_k3_clips_d(backend, rng):
    """k3 clips d = ref - logp to [-20, 20]: finite values, zero gradient beyond the clip."""
    lp = jnp.asarray([[-1.0, -1.0, -30.0, -50.0, -2.0]])
    ref = jnp.asarray([[-40.0, -25.5, -1.0, -1.0, -2.5]])
    kl, vjp = jax.vjp(lambda x: call(jk.kl_penalty, backend, x, ref, "k3"), lp)
    lp64, ref64 = np.asarray(lp, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(np.asarray(kl)).all()
    assert_close(kl, oracle.kl_penalty(lp64, ref64, "k3"))
    (d,) = vjp(jnp.ones_like(kl))
    assert_close(d, oracle.kl_penalty_grad(lp64, ref64, "k3"))
    assert_zero(np.asarray(d)[0, :4], "k3 gradient outside the clip")


@pytest.mark.op("kl_penalty")
def test_kl_penalty_leading_shapes(backend, rng):
    """kl_penalty is elementwise: any matching shape works."""
    lp, lp64, ref, ref64 = _logps(rng, (2, 3, 4), jnp.float32)
    assert_close(call(jk.kl_penalty, backend, lp, ref, "k2"), oracle.kl_penalty(lp64, ref64, "k2"))


# ----------------------------------------------------------------------------- aggregate


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("max_len", [None, 11])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.op("aggregate")
def test_aggregate(backend, rng, mode, max_len, dtype):
    b, t = 5, 7
    x, x64 = rand(rng, (b, t), dtype)
    m = random_mask(rng, b, t, empty_rows=(0, 3))
    mask = jnp.asarray(m)
    out, vjp = jax.vjp(lambda v: call(jk.aggregate, backend, v, mask, mode, max_len=max_len), x)
    assert_f32(out)
    assert out.shape == ()
    want = oracle.aggregate(x64, m, mode, max_len)
    want32 = oracle.aggregate(x64, m, mode, max_len, dt=np.float32)
    scale = oracle.aggregate(np.abs(x64), m, mode, max_len)
    assert_close(out, want, in_dtype=dtype, want32=want32, scale=scale)
    g = cotangent(rng, ())
    (dx,) = vjp(g)
    assert dx.dtype == x.dtype
    w = oracle.aggregate_weights(m, mode, max_len)
    assert_close(dx, float(g) * w, in_dtype=dtype, want32=float(g) * w, name="d_values")
    assert_zero(np.asarray(dx)[m == 0], "gradient at masked tokens")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.op("aggregate")
def test_aggregate_all_masked(backend, rng, mode):
    """A fully masked batch aggregates to 0 with zero gradient, in every mode."""
    x, _ = rand(rng, (3, 4))
    mask = jnp.zeros((3, 4))
    out, g = jax.value_and_grad(lambda v: call(jk.aggregate, backend, v, mask, mode))(x)
    assert float(out) == 0.0
    assert_zero(g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.op("aggregate")
def test_aggregate_bool_mask(backend, rng, mode):
    """A bool mask is the same as its {0, 1} float version."""
    x, x64 = rand(rng, (4, 6))
    m = random_mask(rng, 4, 6, empty_rows=(2,))
    a = call(jk.aggregate, backend, x, jnp.asarray(m > 0), mode)
    b = call(jk.aggregate, backend, x, jnp.asarray(m), mode)
    assert float(a) == float(b)
    assert_close(a, oracle.aggregate(x64, m, mode), scale=oracle.aggregate(np.abs(x64), m, mode))


@pytest.mark.op("aggregate")
def test_aggregate_sequence_mean_alias(backend, rng):
    x, _ = rand(rng, (4, 6))
    mask = jnp.asarray(random_mask(rng, 4, 6))
    a = call(jk.aggregate, backend, x, mask, "sequence_mean")
    b = call(jk.aggregate, backend, x, mask, "seq_mean_token_mean")
    assert float(a) == float(b)


# ----------------------------------------------------------------------------- group_advantages

# (B, group_size, group_boundaries)
GROUPINGS = [
    (8, 4, None),
    (6, 1, None),  # every group is a group of one
    (6, 6, None),
    (7, None, [0, 3, 4, 7]),  # a group of one in the middle
    (5, None, [0, 1, 5]),
    (5, None, [0, 5]),
    (1, None, [0, 1]),
]


STD_OPTIONS = [
    (True, 0, 1e-6, jnp.float32),
    (True, 1, 1e-3, jnp.float32),
    (False, 0, 1e-6, jnp.float32),
    (True, 0, 1e-6, jnp.bfloat16),
]


STD_IDS = ["std", "std_ddof1", "nostd", "std-bf16"]


def _advantage_cases():
    """Every grouping × std option; pallas (interpret mode is slow) runs each grouping once,
    the std options in turn (each at least once); the rest is pallas_slow."""
    for i, (b, size, bounds) in enumerate(GROUPINGS):
        grouping = f"size{size}" if size else "bounds" + "/".join(map(str, bounds))
        for j, (options, sid) in enumerate(zip(STD_OPTIONS, STD_IDS)):
            yield pytest.param(
                b,
                size,
                bounds,
                *options,
                id=f"{b}-{grouping}-{sid}",
                marks=() if i % len(STD_OPTIONS) == j else pytest.mark.pallas_slow,
            )


@pytest.mark.parametrize(
    "b,group_size,group_boundaries,normalize_std,std_ddof,eps,dtype", list(_advantage_cases())
)
@pytest.mark.op("group_advantages")
def test_group_advantages(
    backend, rng, b, group_size, group_boundaries, normalize_std, std_ddof, eps, dtype
):
    r, r64 = rand(rng, (b,), dtype, scale=2.0, loc=0.5)
    kw = dict(
        group_size=group_size,
        normalize_std=normalize_std,
        std_ddof=std_ddof,
        eps=eps,
        group_boundaries=None if group_boundaries is None else jnp.asarray(group_boundaries),
    )
    okw = dict(kw, group_boundaries=group_boundaries)
    adv, vjp = jax.vjp(lambda x: call(jk.group_advantages, backend, x, **kw), r)
    assert_f32(adv)
    assert adv.shape == (b,)
    want = oracle.group_advantages(r64, **okw)
    want32 = oracle.group_advantages(r64, dt=np.float32, **okw)
    # adv = (r - mean) / std cancels: condition factor 1 + max|r| / max|r - mean|.
    cond = 1 + np.abs(r64).max() / max(np.abs(r64 - r64.mean()).max(), 1e-30)
    assert_close(
        adv,
        want,
        in_dtype=dtype,
        want32=want32,
        scale=cond * np.abs(want).max(initial=0),
        name="advantages",
    )
    singletons = _singletons(b, group_size, group_boundaries)
    assert_zero(np.asarray(adv)[singletons], "advantage of a group of one")

    g = cotangent(rng, (b,))
    (dr,) = vjp(g)
    assert dr.dtype == r.dtype
    assert np.isfinite(np.asarray(dr).astype(np.float64)).all(), "gradient not finite"
    want_g = oracle.group_advantages_vjp(r64, np.asarray(g), **okw)
    # The float32 formula error of the analytic VJP is not computed: bound the f32 error by the
    # f32 tolerance itself (the low-precision rule then adds its 1e-3).
    assert_close(
        dr,
        want_g,
        in_dtype=dtype,
        want32=want_g,
        scale=cond * np.abs(want_g).max(initial=0),
        name="d_rewards",
    )
    assert_zero(np.asarray(dr)[singletons], "gradient of a group of one")


def _singletons(b, group_size, group_boundaries):
    if group_size is not None:
        return np.arange(b) if group_size == 1 else np.zeros(0, int)
    sizes = np.diff(group_boundaries)
    return np.asarray(group_boundaries[:-1])[sizes == 1]


@pytest.mark.op("group_advantages")
def test_group_advantages_equal_rewards(backend):
    """A group whose rewards are all equal gets advantage 0 (std 0 -> 0 / eps)."""
    r = jnp.asarray([1.0, 1.0, 1.0, 0.0, 2.0, 1.0])
    adv = call(jk.group_advantages, backend, r, group_size=3)
    assert_zero(np.asarray(adv)[:3])
    assert_close(adv, oracle.group_advantages(np.asarray(r, np.float64), group_size=3))


@pytest.mark.op("group_advantages")
def test_group_advantages_size_vs_boundaries(backend, rng):
    """group_size=k is the same as boundaries 0, k, 2k, ..., B."""
    r, _ = rand(rng, (12,))
    a = call(jk.group_advantages, backend, r, group_size=4)
    b = call(jk.group_advantages, backend, r, group_boundaries=jnp.asarray([0, 4, 8, 12]))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    c = call(jk.group_advantages, backend, r, group_boundaries=[0, 4, 8, 12])
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)
