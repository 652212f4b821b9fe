"""``memory="fast"`` log-probs with the settings it does not use (measurement only).

``saved_logits`` keeps a bfloat16 head's logits as bfloat16, takes the lse in two passes over
them, writes the logits' gradient in one piece and runs the backward GEMMs in the head's
dtype. :func:`fast_linear_logprobs` here does the same op as an ``engine`` op with any of
the alternatives ``bench_fast_mode`` times against it:

* ``kept="float16"``: the logits kept as float16 (every bfloat16 value below 65504 exactly);
* ``lse="one_pass"``: one read of the kept logits, a running ``(max, Σ exp)`` reduction;
* ``vocab_blocks=k``: the backward writes the logits' gradient ``k`` vocabulary blocks at a
  time (less memory, more and smaller GEMMs);
* ``grad="float16"``: the logits' gradient of a bfloat16 head scaled per row into float16
  (``head_grad.Scaled``: three more bits, for a float16 copy of W and h).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_kernels.engine import linear_head
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry, head_grad, rounded_logits
from jaxrl_kernels.head.blocks import blocks


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings above; the defaults are ``saved_logits``' own."""

    kept: str = "bfloat16"
    lse: str = "two_pass"
    vocab_blocks: int = 1
    grad: str = "head"


def _kept(z, hidden, weight, config):
    dtype = jnp.result_type(hidden, weight)
    return z.astype(config.kept) if dtype == jnp.bfloat16 else z


def _max_and_sum_exp(zs):
    """Per row ``(m, Σ exp(z − m))`` in one reduction over the columns."""

    def combine(x, y):
        m = jnp.maximum(x[0], y[0])
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        return m, x[1] * jnp.exp(x[0] - m_safe) + y[1] * jnp.exp(y[0] - m_safe)

    return jax.lax.reduce(
        (zs, jnp.ones_like(zs)), (jnp.float32(-jnp.inf), jnp.float32(0.0)), combine, (1,)
    )


def _stats(config, weight_layout, temperature, with_entropy):
    def stats(plan, h, w, b, t_local, valid):
        if config.lse != "one_pass" or with_entropy:
            out = rounded_logits.local_stats(
                plan,
                h,
                w,
                b,
                t_local,
                valid,
                weight_layout=weight_layout,
                temperature=temperature,
                with_entropy=with_entropy,
            )
            return out[:2] + (_kept(out[2], h, w, config),)
        z = rounded_logits.product(h, w, weight_layout)
        m, s = _max_and_sum_exp(rounded_logits.scaled(z, b, temperature))
        t_rel = rounded_logits.target_logits(h, w, b, t_local, weight_layout, temperature) - m
        return (m, s), t_rel, _kept(z, h, w, config)

    return stats


def _block_grads(
    hidden,
    weight,
    bias,
    z,
    cols,
    t_local,
    lse,
    entropy,
    g,
    g_ent,
    *,
    weight_layout,
    temperature,
    config,
    fresh=None,
):
    """(dz·W_c, d_W_c, d_b_c) for the kept logits ``z`` [N, C] of columns ``cols``."""
    dtype = jnp.result_type(hidden, weight)
    is_target = cols[None, :] == t_local[:, None]
    if config.grad == "float16" and dtype == jnp.bfloat16:
        sc = head_grad.Scaled.of(hidden, weight, lse, entropy, g, g_ent, temperature)
        dz = softmax_math.logprob_grad_tile(
            rounded_logits.scaled(z, bias, temperature),
            lse,
            entropy,
            is_target,
            sc.rows.g,
            sc.rows.g_ent,
            temperature,
        )
        dz = dz if fresh is None else jnp.where(fresh, dz, 0.0)
        g16 = dz.astype(jnp.float16)
        w16 = (weight.astype(jnp.float32) * sc.sigma_w).astype(jnp.float16)
        acc = geometry.hidden_grad(g16, w16, weight_layout, preferred_element_type=jnp.float32)
        d_w = head_grad.rounded_weight_grad(g16, sc.h16, w16, weight_layout, sc.d_w_scale)
        d_b = None if bias is None else jnp.sum(dz * sc.s[:, None], axis=0)
        return sc.finish(acc, jnp.float32), d_w.astype(weight.dtype), d_b
    dz = softmax_math.logprob_grad_tile(
        rounded_logits.scaled(z, bias, temperature), lse, entropy, is_target, g, g_ent, temperature
    )
    dz = dz if fresh is None else jnp.where(fresh, dz, 0.0)
    dz_op = dz.astype(dtype)
    d_hidden = geometry.hidden_grad(
        dz_op,
        weight.astype(dtype),
        weight_layout,
        precision=geometry.matmul_precision(dtype),
        preferred_element_type=jnp.float32,
    )
    d_weight = head_grad.rounded_weight_grad(dz_op, hidden.astype(dtype), weight, weight_layout)
    return d_hidden, d_weight, None if bias is None else jnp.sum(dz, axis=0)


def _backward(config, weight_layout, temperature):
    options = dict(weight_layout=weight_layout, temperature=temperature, config=config)

    def backward(hidden, weight, bias, z, *rows):
        vocab = z.shape[1]
        if config.vocab_blocks == 1:
            dh, dw, db = _block_grads(hidden, weight, bias, z, jnp.arange(vocab), *rows, **options)
            return dh, dw, None if bias is None else db.astype(bias.dtype)
        spans = blocks(vocab, -(-vocab // config.vocab_blocks))

        def block(c, carry):
            d_hidden, d_weight, d_bias = carry
            start, fresh = spans.start(c), spans.fresh(c)
            cols = start + jnp.arange(spans.size)
            z_c = jax.lax.dynamic_slice_in_dim(z, start, spans.size, axis=1)
            w_c = geometry.vocab_slice(weight, start, spans.size, weight_layout)
            b_c = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, spans.size)
            dh, dw, db = _block_grads(hidden, w_c, b_c, z_c, cols, *rows, fresh=fresh, **options)
            old = geometry.vocab_slice(d_weight, start, spans.size, weight_layout)
            d_weight = geometry.vocab_update(
                d_weight,
                jnp.where(geometry.per_column(fresh, weight_layout), dw, old),
                start,
                weight_layout,
            )
            if d_bias is not None:
                old_b = jax.lax.dynamic_slice_in_dim(d_bias, start, spans.size)
                d_bias = jax.lax.dynamic_update_slice_in_dim(
                    d_bias, jnp.where(fresh, db, old_b), start, 0
                )
            return d_hidden + dh, d_weight, d_bias

        init = (
            jnp.zeros(hidden.shape, jnp.float32),
            jnp.zeros(weight.shape, weight.dtype),
            None if bias is None else jnp.zeros((vocab,), jnp.float32),
        )
        d_hidden, d_weight, d_bias = jax.lax.fori_loop(0, spans.count, block, init)
        return d_hidden, d_weight, None if bias is None else d_bias.astype(bias.dtype)

    return backward


def fast_linear_logprobs(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    return_entropy,
    vocab_axis=None,
    config=Config(),
):
    """``saved_logits.fast_linear_logprobs`` with ``config``'s settings."""
    call = linear_head.HeadCall(
        weight_layout=weight_layout,
        temperature=temperature,
        return_entropy=return_entropy,
        vocab_axis=vocab_axis,
    )
    return linear_head.linear_head_op(
        _stats(config, weight_layout, temperature, return_entropy),
        _backward(config, weight_layout, temperature),
        hidden,
        weight,
        bias,
        targets,
        row_valid,
        call,
        n_kept=1,
    )
