"""Every op under jax.jit, jax.grad / jax.value_and_grad and jax.vmap (leading batch axis).

Numbers are checked against the same op run eagerly (the float64 comparisons live in the
op-specific files); the tolerance is float32 round-off: 1e-5 of the result's max-norm. Every
op is also repeatable bitwise (docs/api.md "Numerics"): its jitted value and gradient run
twice, and the op run eagerly twice, give the same bits (larger sizes: test_determinism.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from tests.conftest import assert_bitwise, call, random_mask

B, T, V, D = 4, 3, 11, 6
K = 3  # the vmapped batch


def _arrays(rng):
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    logp = -jnp.abs(f(B, T)) - 0.1
    return dict(
        logits=f(B, T, V) * 2,
        ref_logits=f(B, T, V) * 2,
        actions=jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
        hidden=f(B, T, D),
        weight=f(V, D) * 0.5,
        weight_dv=f(D, V) * 0.5,
        bias=f(V) * 0.1,
        logp=logp,
        old_logp=logp + 0.3 * f(B, T),
        ref_logp=logp + 0.3 * f(B, T),
        rollout_logp=logp + 0.3 * f(B, T),
        entropy=jnp.abs(f(B, T)),
        adv=f(B, T),
        adv_b=f(B),
        rewards=f(B),
        mask=jnp.asarray(random_mask(rng, B, T)),
    )


# name -> (differentiable arg names, other arg names, fn(backend, *args) -> outputs, main output)
CASES = {
    "token_logprobs": (
        ("logits",),
        ("actions",),
        lambda b, l, t: jk.token_logprobs(l, t, temperature=0.9, return_entropy=True, backend=b),
    ),
    "linear_logprobs": (
        ("hidden", "weight_dv", "bias"),
        ("actions",),
        lambda b, h, w, bb, t: jk.linear_logprobs(
            h, w, t, bb, weight_layout="dv", return_entropy=True, backend=b
        ),
    ),
    "kl_penalty": (("logp",), ("ref_logp",), lambda b, x, r: call(jk.kl_penalty, b, x, r, "k3")),
    "aggregate": (
        ("logp",),
        ("mask",),
        lambda b, x, m: call(jk.aggregate, b, x, m, "seq_mean_token_mean"),
    ),
    "group_advantages": (
        ("rewards",),
        (),
        lambda b, r: call(
            jk.group_advantages,
            b,
            r + jnp.arange(B, dtype=jnp.float32),
            group_boundaries=jnp.asarray([0, 2, B]),
        ),
    ),
    "ppo_loss": (
        ("logp", "entropy"),
        ("old_logp", "adv", "mask", "rollout_logp", "ref_logp"),
        lambda b, lp, e, o, a, m, ro, rf: jk.ppo_loss(
            lp,
            o,
            a,
            m,
            entropy=e,
            entropy_coef=0.01,
            rollout_logp=ro,
            tis_cap=2.0,
            ref_logp=rf,
            kl_coef=0.1,
            dual_clip=3.0,
            backend=b,
        ),
    ),
    "policy_gradient_loss": (
        ("logp",),
        ("adv_b", "mask"),
        lambda b, lp, a, m: call(
            jk.policy_gradient_loss, b, lp, a, m, loss_agg_mode="seq_mean_token_sum"
        ),
    ),
    "ratio_kl": (
        ("logits",),
        ("ref_logits", "actions", "old_logp", "mask"),
        lambda b, l, r, t, o, m: jk.ratio_kl(l, r, t, o, m, kl_estimator="k2", backend=b),
    ),
    "grpo_loss": (
        ("logits",),
        ("ref_logits", "actions", "old_logp", "rewards", "mask"),
        lambda b, l, r, t, o, rw, m: jk.grpo_loss(
            l, r, t, o, rw, m, group_size=2, beta=0.1, backend=b
        ),
    ),
    "linear_ppo_loss": (
        ("hidden", "weight", "bias"),
        ("actions", "old_logp", "adv_b", "mask", "ref_logp"),
        lambda b, h, w, bb, t, o, a, m, rf: jk.linear_ppo_loss(
            h,
            w,
            t,
            o,
            a,
            m,
            bias=bb,
            ref_logp=rf,
            kl_coef=0.1,
            entropy_coef=0.01,
            temperature=1.1,
            backend=b,
        ),
    ),
    "linear_grpo_loss": (
        ("hidden", "weight_dv"),
        ("actions", "old_logp", "rewards", "mask", "ref_logp"),
        lambda b, h, w, t, o, rw, m, rf: jk.linear_grpo_loss(
            h,
            w,
            t,
            o,
            rw,
            m,
            weight_layout="dv",
            ref_logp=rf,
            beta=0.05,
            group_boundaries=jnp.asarray([0, 1, B]),
            backend=b,
        ),
    ),
}
OPS = list(CASES)


def _main(out):
    """The differentiable outputs: (loss, metrics) -> loss; tuples/arrays as they are."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return out[0]
    return out


def _scalarize(out, weights):
    leaves = jax.tree.leaves(_main(out))
    return sum(jnp.sum(x * w) for x, w in zip(leaves, weights))


def _setup(op, backend, rng):
    diff, other, fn = CASES[op]
    arrs = _arrays(rng)
    args = [arrs[n] for n in diff + other]
    f = lambda *a: fn(backend, *a)
    weights = [
        jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
        for x in jax.tree.leaves(_main(jax.eval_shape(f, *args)))
    ]
    return f, args, len(diff), weights


def assert_tree_close(a, b, what, scale=None):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, what
        s = max(np.abs(y).max(initial=0), 1e-3, scale or 0)
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * s, err_msg=what)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.op
def test_jit_grad_value_and_grad(backend, rng, op):
    """jit(f) == f; jit(value_and_grad) == (f, grad) run eagerly; gradients finite, not all 0;
    each of the jitted function and f (eager) run twice gives the same bits."""
    f, args, n_diff, weights = _setup(op, backend, rng)
    out = f(*args)
    assert_bitwise(out, f(*args), f"{op}: eager, run twice")
    loss = lambda *a: _scalarize(f(*a), weights)
    argnums = tuple(range(n_diff))
    step = jax.jit(lambda *a: (f(*a), jax.value_and_grad(loss, argnums=argnums)(*a)))
    jit_out, (value, jitted) = step(*args)
    assert_bitwise((jit_out, (value, jitted)), step(*args), f"{op}: jit, run twice")
    assert_tree_close(jit_out, out, f"{op}: jit differs from eager")
    eager = jax.grad(loss, argnums=argnums)(*args)
    abs_sum = float(_scalarize(jax.tree.map(jnp.abs, out), [jnp.abs(w) for w in weights]))
    assert_tree_close(value, loss(*args), f"{op}: value_and_grad value", scale=abs_sum)
    assert_tree_close(jitted, eager, f"{op}: jit(value_and_grad) vs grad")
    for g, x in zip(jitted, args):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert np.isfinite(np.asarray(g)).all(), f"{op}: non-finite gradient"
    assert any(np.any(np.asarray(g) != 0) for g in jitted), f"{op}: all gradients are zero"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.op
def test_vmap(backend, rng, op):
    """vmap over a new leading axis equals a loop over it (values, and gradients via vmap(grad))."""
    diff, other, fn = CASES[op]
    batches = [_arrays(rng) for _ in range(K)]
    names = diff + other
    stacked = [jnp.stack([bt[n] for bt in batches]) for n in names]
    f = lambda *a: fn(backend, *a)
    weights = [
        jnp.asarray(rng.standard_normal(np.shape(x)).astype(np.float32))
        for x in jax.tree.leaves(_main(jax.eval_shape(f, *[batches[0][n] for n in names])))
    ]
    grad = jax.grad(lambda *a: _scalarize(f(*a), weights), argnums=tuple(range(len(diff))))
    both = lambda *a: (f(*a), grad(*a))
    got = jax.jit(jax.vmap(both))(*stacked)
    one = jax.jit(both)
    per_batch = [one(*[bt[n] for n in names]) for bt in batches]
    want = jax.tree.map(lambda *xs: jnp.stack(xs), *per_batch)
    assert_tree_close(got[0], want[0], f"{op}: vmap values")
    assert_tree_close(got[1], want[1], f"{op}: vmap(grad)")
