"""Check mode (``JAXRL_KERNELS_CHECKS=1`` / ``jk.checks()``): what eager calls catch, traced
calls catch too, with the eager message, inside ``jax.jit``, ``jax.grad`` and ``jax.vmap``;
with check mode off, not one operation is added to the traced computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from tests.ops.test_errors import MASK_OPS, A, B, T, V, call_op

TARGET_OPS = [
    "token_logprobs",
    "linear_logprobs",
    "ratio_kl",
    "grpo_loss",
    "linear_ppo_loss",
    "linear_grpo_loss",
]


def eager_message(op, **over):
    """The ValueError an eager call of ``op`` raises (in check mode)."""
    with jk.checks(), pytest.raises(ValueError) as info:
        call_op(op, **over)
    return str(info.value)


def traced_raises(fn, *args, message):
    """``fn(*args)`` raises, and its message ends with ``message`` (JAX reports an error raised
    in a host callback as a JaxRuntimeError whose message ends with the callback's)."""
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn(*args))
    assert message in str(info.value), (message, str(info.value)[-400:])


def jit_over(op, name):
    """``op`` jitted over the argument ``name`` (the rest valid and small)."""
    return jax.jit(lambda x: call_op(op, **{name: x}))


def bad_targets(value=V + 2):
    return jnp.zeros((B, T), jnp.int32).at[1, 0].set(value)


@pytest.mark.parametrize("op", TARGET_OPS)
def test_out_of_range_targets_raise_under_jit(op):
    message = eager_message(op, targets=bad_targets())
    assert "(1, 0)" in message and f"[0, {V})" in message
    with jk.checks():
        traced_raises(jit_over(op, "targets"), bad_targets(), message=message)
    jit_over(op, "targets")(bad_targets())  # off: NaN, as documented, and no error


@pytest.mark.parametrize("op", MASK_OPS)
def test_mask_values_outside_0_1_raise_under_jit(op):
    mask = jnp.ones((B, T)).at[1, 2].set(2.0)
    message = eager_message(op, mask=mask)
    with jk.checks():
        traced_raises(jit_over(op, "mask"), mask, message=message)
    jit_over(op, "mask")(mask)


@pytest.mark.parametrize(
    "op,name,value",
    [
        ("token_logprobs", "logits", jnp.nan),
        ("linear_logprobs", "hidden", jnp.nan),
        ("linear_ppo_loss", "hidden", jnp.inf),
        ("grpo_loss", "logits", -jnp.inf),
        ("ppo_loss", "old_logp", jnp.nan),
        ("linear_grpo_loss", "old_logp", -jnp.inf),
    ],
)
def test_non_finite_inputs_raise_in_check_mode(op, name, value):
    x = A[name].at[(1,) * A[name].ndim].set(value)
    message = eager_message(op, **{name: x})
    assert f"{name}: expected finite values, got {value!r}" in message, message
    with jk.checks():
        traced_raises(jit_over(op, name), x, message=message)
    call_op(op, **{name: x})  # off: NaN propagates, eager or traced, as documented
    jit_over(op, name)(x)


def test_inside_grad_and_vmap():
    t = bad_targets()
    message = eager_message("linear_ppo_loss", targets=t)
    grad = jax.jit(jax.grad(lambda h, t: call_op("linear_ppo_loss", hidden=h, targets=t)[0]))
    with jk.checks():
        traced_raises(grad, A["hidden"], t, message=message)
        per_row = jax.jit(jax.vmap(lambda l, t: jk.token_logprobs(l, t)))
        traced_raises(per_row, A["logits"], t, message="targets: value 7 at position (0,)")


def test_masked_or_ignored_targets_pass():
    t = bad_targets()
    with jk.checks():
        mask = jnp.ones((B, T)).at[1, 0].set(0)
        loss = jax.jit(lambda m: call_op("linear_grpo_loss", targets=t, mask=m))(mask)[0]
        assert np.isfinite(float(loss))
        logp = jax.jit(lambda t: jk.token_logprobs(A["logits"], t, ignore_index=V + 2))(t)
        assert float(logp[1, 0]) == 0.0


def test_traced_group_boundaries():
    with jk.checks():
        traced_raises(
            jax.jit(lambda b: jk.group_advantages(jnp.ones(4), groups=jk.Groups(boundaries=b))),
            jnp.array([0, 3, 2, 4]),
            message="groups.boundaries: expected strictly increasing values starting "
            "at 0 and ending at B = 4, got 2 at position (2,)",
        )


def test_environment_variable_and_scope(monkeypatch):
    mask = jnp.ones((B, T)).at[0, 1].set(3.0)
    message = eager_message("aggregate", mask=mask)
    monkeypatch.setenv("JAXRL_KERNELS_CHECKS", "1")
    traced_raises(jit_over("aggregate", "mask"), mask, message=message)
    with jk.checks(False):
        jit_over("aggregate", "mask")(mask)
    monkeypatch.setenv("JAXRL_KERNELS_CHECKS", "0")
    jit_over("aggregate", "mask")(mask)


@pytest.mark.parametrize(
    "op", ["linear_grpo_loss", "linear_ppo_loss", "grpo_loss", "token_logprobs", "aggregate"]
)
def test_free_when_off(op, monkeypatch):
    """Off, the jaxpr is the same operation for operation as with the mode never consulted
    (JAXRL_KERNELS_CHECKS unset, "0", or overridden by checks(False)), and has no callback;
    on, it has one."""

    def jaxpr():
        return str(
            jax.make_jaxpr(lambda t, m: call_op(op, targets=t, mask=m))(A["targets"], A["mask"])
        )

    monkeypatch.delenv("JAXRL_KERNELS_CHECKS", raising=False)
    off = jaxpr()
    assert "callback" not in off
    monkeypatch.setenv("JAXRL_KERNELS_CHECKS", "0")
    assert jaxpr() == off
    monkeypatch.setenv("JAXRL_KERNELS_CHECKS", "1")
    on = jaxpr()
    assert "debug_callback" in on and len(on) > len(off)
    with jk.checks(False):
        assert jaxpr() == off
