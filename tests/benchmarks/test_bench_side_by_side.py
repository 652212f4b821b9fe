"""The benchmarks' own arithmetic: bf16 rounding of the side-by-side inputs, its chunked
float64 exact gradients, and the e2e benchmark's jnp GRPO loss."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxrl_kernels as jk
from benchmarks.e2e_grpo_step import grpo_from_logp
from benchmarks.side_by_side import exact, shared


def test_bf16_bits_round_to_nearest_even():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32)
    ties = (rng.integers(0, 0x7F80, 1000, dtype=np.uint32) << 16 | 0x8000).view(
        np.float32
    )  # finite
    x = np.concatenate([x, ties, np.float32([0.0, -0.0, 1.0, -3.5])])
    bits = shared.bf16_bits(x)
    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(
        shared.bf16_to_f32(bits), x.astype(ml_dtypes.bfloat16).astype(np.float32)
    )


def test_exact_grads_match_the_unchunked_float64_formula():
    rng = np.random.default_rng(4)
    n, d, v = 5, 8, 37
    h, w = rng.standard_normal((n, d)) * 2, rng.standard_normal((v, d))
    t = np.array([0, v - 1, 9, 10, 30], np.int32)  # chunk edges of 10: first, last, both sides
    g = rng.standard_normal(n)
    z = h @ w.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = g[:, None] * (np.eye(v)[t] - p)
    with jax.enable_x64(True):
        dh, dw, logp = exact.exact_grads(
            jnp.asarray(h), jnp.asarray(w), jnp.asarray(t), jnp.asarray(g), chunk=10
        )
        dh, dw, logp = np.asarray(dh), np.asarray(dw), np.asarray(logp)
    assert dh.dtype == np.float64 and dw.dtype == np.float32
    np.testing.assert_allclose(dh, dz @ w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw, dz.T @ h, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(logp, np.log(p[np.arange(n), t]), rtol=1e-12)


def test_e2e_jnp_grpo_loss_equals_linear_grpo_loss():
    rng = np.random.default_rng(5)
    b, t, d, v, group = 8, 6, 16, 50, 4
    hidden = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    weight = jnp.asarray(rng.standard_normal((v, d)) * 0.3, jnp.float32)
    actions = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    old_logp = jnp.asarray(-np.log(v) + 0.3 * rng.standard_normal((b, t)), jnp.float32)
    rewards = jnp.asarray(rng.integers(0, 2, b), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (b, t)), jnp.float32)

    def ours(hidden):
        return jk.linear_grpo_loss(
            hidden,
            weight,
            actions,
            old_logp,
            rewards,
            mask,
            groups=jk.Groups(size=group),
            backend="reference",
        )[0]

    def jnp_path(hidden):
        logp = jnp.take_along_axis(
            jax.nn.log_softmax(hidden @ weight.T), actions[..., None], axis=-1
        )[..., 0]
        return grpo_from_logp(logp, old_logp, rewards, mask, group)

    def value_and_grad(f):
        return jax.jit(jax.value_and_grad(f))(hidden)

    (got, got_grad), (want, want_grad) = value_and_grad(jnp_path), value_and_grad(ours)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-6)
