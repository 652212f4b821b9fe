"""token_logprobs against the float64 oracle: values, entropy, VJP, odd shapes, dtypes."""

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
    dtype_id,
    pallas_slow,
    rand,
)
from tests.support import oracle

# (leading shape, V, temperature); every dtype
CASES = [
    ((5,), 7, 1.0),
    ((1,), 1, 1.0),
    ((1,), 7, 2.5),
    ((3, 4), 7, 0.7),
    ((), 7, 1.0),
    ((6,), 1000, 1.0),
    ((2, 3), 1000, 0.7),
]
# Large vocabularies / many rows (the vocabulary-chunked paths): few dtypes, kept small in N.
BIG_CASES = [
    pallas_slow((2,), 32003, 1.0, jnp.float32),
    pallas_slow((2,), 32003, 1.0, jnp.bfloat16),
    pallas_slow((64,), 32003, 1.0, jnp.float32),
    pallas_slow((2048,), 1000, 0.9, jnp.float32),
]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _targets(rng, lead, v):
    return jnp.asarray(rng.integers(0, v, size=lead), jnp.int32)


def check_token_logprobs(backend, rng, logits, l64, targets, *, temperature=1.0, ignore_index=None):
    """Values and the VJP (random cotangents on logp and entropy) against the oracle."""
    dtype = logits.dtype
    fn = lambda l: jk.token_logprobs(
        l,
        targets,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=True,
        backend=backend,
    )
    (logp, ent), vjp = jax.vjp(fn, logits)
    assert_f32(logp, ent)
    assert logp.shape == targets.shape and ent.shape == targets.shape
    t = np.asarray(targets)
    kw = dict(temperature=temperature, ignore_index=ignore_index)
    want_lp, want_ent = oracle.token_logprobs(l64, t, **kw)
    w32 = oracle.token_logprobs(l64, t, dt=np.float32, **kw)
    zscale = np.max(np.abs(l64), initial=0) / temperature  # logp, H: differences of O(|z|) terms
    assert_close(logp, want_lp, in_dtype=dtype, want32=w32[0], scale=zscale, name="logp")
    assert_close(ent, want_ent, in_dtype=dtype, want32=w32[1], scale=zscale, name="entropy")

    g_lp, g_ent = cotangent(rng, targets.shape), cotangent(rng, targets.shape)
    (d_logits,) = vjp((g_lp, g_ent))
    assert d_logits.dtype == dtype and d_logits.shape == logits.shape
    g_lp, g_ent = np.asarray(g_lp), np.asarray(g_ent)
    want = oracle.token_logprobs_vjp(l64, t, g_lp, g_ent, **kw)
    want32 = oracle.token_logprobs_vjp(l64, t, g_lp, g_ent, dt=np.float32, **kw)
    assert_close(d_logits, want, in_dtype=dtype, want32=want32, name="d_logits")
    return logp, ent, d_logits


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("lead,vocab,temperature", CASES)
def test_values_and_vjp(backend, rng, lead, vocab, temperature, dtype):
    logits, l64 = rand(rng, lead + (vocab,), dtype, scale=3.0)
    targets = _targets(rng, lead, vocab)
    check_token_logprobs(backend, rng, logits, l64, targets, temperature=temperature)


@pytest.mark.parametrize("lead,vocab,temperature,dtype", BIG_CASES)
def test_values_and_vjp_big(backend, rng, lead, vocab, temperature, dtype):
    test_values_and_vjp(backend, rng, lead, vocab, temperature, dtype)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logp_only(backend, rng, temperature):
    """return_entropy=False returns one array; its VJP is (onehot - p) * g / T."""
    logits, l64 = rand(rng, (4, 5, 33), scale=2.0)
    targets = _targets(rng, (4, 5), 33)
    logp, vjp = jax.vjp(
        lambda l: jk.token_logprobs(l, targets, temperature=temperature, backend=backend), logits
    )
    assert isinstance(logp, jax.Array) and logp.shape == (4, 5)
    want, _ = oracle.token_logprobs(l64, np.asarray(targets), temperature=temperature)
    assert_close(logp, want, scale=np.abs(l64).max() / temperature)
    g = cotangent(rng, (4, 5))
    (d,) = vjp(g)
    assert_close(
        d,
        oracle.token_logprobs_vjp(l64, np.asarray(targets), np.asarray(g), temperature=temperature),
    )


@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_ignore_index(backend, rng, ignore_index, dtype):
    """Ignored targets give logp = entropy = 0 and no gradient (ignore_index may be a valid id)."""
    lead, vocab = (3, 6), 11
    logits, l64 = rand(rng, lead + (vocab,), dtype, scale=2.0)
    t = rng.integers(0, vocab, size=lead)
    t[0, :] = ignore_index  # a whole sequence ignored
    t[1, ::2] = ignore_index
    if ignore_index == 3:
        t[2, :] = np.where(t[2, :] == 3, 4, t[2, :])
    targets = jnp.asarray(t, jnp.int32)
    logp, ent, d = check_token_logprobs(
        backend, rng, logits, l64, targets, ignore_index=ignore_index
    )
    ign = t == ignore_index
    assert_zero(np.asarray(logp)[ign], "logp at ignored targets")
    assert_zero(np.asarray(ent)[ign], "entropy at ignored targets")
    assert_zero(np.asarray(d)[ign], "gradient at ignored targets")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_extreme_logits_stay_finite(backend, rng, dtype):
    """Logits of +-1e4 (one dominant entry, ties at the max, all equal) stay finite and accurate."""
    vocab = 9
    l = rng.choice([-1e4, 1e4, 0.0], size=(6, vocab)).astype(np.float32)
    l[0] = 1e4  # all equal at the top
    l[1] = -1e4  # all equal at the bottom
    l[2] = -1e4
    l[2, 4] = 1e4  # one dominant logit
    l[3] = rng.standard_normal(vocab) * 1e4
    logits = jnp.asarray(l).astype(dtype)
    l64 = np.asarray(logits).astype(np.float64)
    t = rng.integers(0, vocab, size=6)
    t[2] = 0  # the target far below the max: logp ~ -2e4
    targets = jnp.asarray(t, jnp.int32)
    fn = lambda x: jk.token_logprobs(x, targets, return_entropy=True, backend=backend)
    (logp, ent), vjp = jax.vjp(fn, logits)
    (d,) = vjp((cotangent(rng, (6,)), cotangent(rng, (6,))))
    for name, x in (("logp", logp), ("entropy", ent), ("d_logits", d)):
        assert np.isfinite(np.asarray(x).astype(np.float64)).all(), f"{name} not finite"
    want_lp, want_ent = oracle.token_logprobs(l64, t)
    w32 = oracle.token_logprobs(l64, t, dt=np.float32)
    assert_close(logp, want_lp, in_dtype=dtype, want32=w32[0], scale=1e4, name="logp")
    assert_close(ent, want_ent, in_dtype=dtype, want32=w32[1], scale=1e4, name="entropy")


def test_leading_shapes_flatten(backend, rng):
    """[B, T, V] gives the same numbers as the flattened [B*T, V] call."""
    logits, _ = rand(rng, (3, 5, 13))
    targets = _targets(rng, (3, 5), 13)
    a, ea = jk.token_logprobs(logits, targets, return_entropy=True, backend=backend)
    b, eb = jk.token_logprobs(
        logits.reshape(15, 13), targets.reshape(15), return_entropy=True, backend=backend
    )
    np.testing.assert_allclose(np.asarray(a).reshape(15), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ea).reshape(15), np.asarray(eb), rtol=1e-6, atol=1e-6)


def test_integer_target_dtypes(backend, rng):
    """Any integer dtype works for targets (int32, int64 via numpy, uint8)."""
    logits, l64 = rand(rng, (4, 7))
    t = rng.integers(0, 7, size=4)
    want, _ = oracle.token_logprobs(l64, t)
    for tt in (jnp.asarray(t, jnp.int32), np.asarray(t, np.int64), jnp.asarray(t, jnp.uint8)):
        assert_close(jk.token_logprobs(logits, tt, backend=backend), want, scale=np.abs(l64).max())


def test_nan_propagates(backend, rng):
    """A NaN logit makes its row's logp NaN; nothing is silently zeroed."""
    logits, _ = rand(rng, (3, 5))
    logits = logits.at[1, 2].set(jnp.nan)
    targets = jnp.asarray([0, 1, 2], jnp.int32)
    logp = np.asarray(jk.token_logprobs(logits, targets, backend=backend))
    assert np.isnan(logp[1]) and np.isfinite(logp[[0, 2]]).all()
