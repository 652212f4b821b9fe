"""formulas/ordered_sums: sums over segment ids in a fixed order equal float64 sums, with any
id layout (runs split within a row, ids absent, -1), and their gradient is the spread."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels.formulas import aggregation_math, ordered_sums


def _exact(x, ids, count):
    out = np.zeros((x.shape[0], count))
    for k in range(x.shape[0]):
        keep = ids >= 0
        np.add.at(out[k], ids[keep], x[k][keep].astype(np.float64))
    return out


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (4, 64)])
def test_run_sums_match_float64_and_spread_back(rng, shape):
    count = 7  # some ids never appear: their sums are 0
    ids = rng.integers(-1, count - 2, shape).astype(np.int32)  # runs interleave within rows
    x = rng.standard_normal((2,) + shape).astype(np.float32)
    got = ordered_sums.run_sums(jnp.asarray(x), jnp.asarray(ids), count)
    np.testing.assert_allclose(got, _exact(x, ids, count), rtol=1e-6, atol=1e-6)
    g = rng.standard_normal((2, count)).astype(np.float32)
    (dx,) = jax.vjp(lambda v: ordered_sums.run_sums(v, jnp.asarray(ids), count), jnp.asarray(x))[1](
        jnp.asarray(g)
    )
    want = np.where(ids >= 0, g[:, np.maximum(ids, 0)], 0.0)
    np.testing.assert_array_equal(dx, want)


def test_group_advantages_match_float64(rng):
    r = rng.standard_normal(12).astype(np.float32)
    ids = np.repeat(np.arange(4), 3)
    got = aggregation_math.group_advantages(jnp.asarray(r), jnp.asarray(ids), 4)
    r64 = r.astype(np.float64).reshape(4, 3)
    centred = r64 - r64.mean(1, keepdims=True)
    want = centred / (np.sqrt((centred**2).mean(1, keepdims=True)) + 1e-6)
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-6)
