"""The reference backend: plain jnp, materialises float32 logits. The oracle the others match."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels import rl_math


def unavailable_reason() -> str | None:
    return None


def declines(primitive, problem) -> str | None:
    return None


def matmul_precision(dtype) -> jax.lax.Precision:
    """float32 operands get full float32 products; narrower ones are exact in float32 anyway."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def linear_logits(hidden, weight, bias, weight_layout):
    """hidden @ W^T (+ bias) in float32, for either weight layout."""
    dtype = jnp.result_type(hidden, weight)
    contract = 1 if weight_layout == "vd" else 0
    logits = jax.lax.dot_general(
        hidden.astype(dtype), weight.astype(dtype), (((1,), (contract,)), ((), ())),
        precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
    return logits if bias is None else logits + bias.astype(jnp.float32)


def _logprobs_from_z(z, targets, row_valid, return_entropy):
    vocab = z.shape[-1]
    logp_all = jax.nn.log_softmax(z, axis=-1)
    in_range = (targets >= 0) & (targets < vocab)
    safe = jnp.where(in_range & row_valid, targets, 0)
    logp = jnp.take_along_axis(logp_all, safe[:, None], axis=-1)[:, 0]
    entropy = None
    if return_entropy:
        p = jnp.exp(logp_all)
        entropy = -jnp.sum(p * jnp.where(p > 0, logp_all, 0.0), axis=-1)
    return rl_math.finalize_logprob(logp, jnp.zeros_like(logp), entropy, in_range, row_valid)


def token_logprobs(logits, targets, row_valid, *, temperature, return_entropy):
    z = logits.astype(jnp.float32) / temperature
    return _logprobs_from_z(z, targets, row_valid, return_entropy)


def paired_logprobs(policy_logits, ref_logits, targets, row_valid, *, temperature):
    logp, _ = token_logprobs(policy_logits, targets, row_valid, temperature=temperature,
                             return_entropy=False)
    ref, _ = token_logprobs(jax.lax.stop_gradient(ref_logits), targets, row_valid,
                            temperature=temperature, return_entropy=False)
    return logp, ref


def linear_logprobs(hidden, weight, bias, targets, row_valid, *, weight_layout, temperature,
                    return_entropy):
    z = linear_logits(hidden, weight, bias, weight_layout) / temperature
    return _logprobs_from_z(z, targets, row_valid, return_entropy)


OPS = {
    "token_logprobs": token_logprobs,
    "paired_logprobs": paired_logprobs,
    "linear_logprobs": linear_logprobs,
    "ppo_loss": rl_math.ppo_loss,
    "group_advantages": rl_math.group_advantages,
}
