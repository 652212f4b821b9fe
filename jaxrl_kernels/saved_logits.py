"""``memory="fast"``: the linear head's logits kept from the forward pass (3 GEMMs, not 4).

The lean ops never hold the ``[N, V]`` logits, so their backward recomputes them: one GEMM
forward, three backward (logits again, ``d_hidden``, ``d_weight``). Here the forward's GEMM
writes ``z = h·Wᵀ`` once, in the head's 16-bit dtype (float32 for float32 inputs), and the
backward reads it back: one GEMM forward, two backward. The price is ``N·V·itemsize`` bytes
held from the forward to the backward (1 GiB at N = 4096, V = 131072, bfloat16).

With ``z̃ = (z + b) / T`` in float32 per row::

    lse = log Σ_v exp z̃_v              (from the kept, rounded z)
    logp = z̃_t − lse                    (z̃_t recomputed exactly: hidden · W[t], N·D work)
    entropy = lse − Σ_v softmax(z̃)_v · z̃_v
    dz = g · (onehot_t − p) − g_H · p · (log p + H),  p = exp(z̃ − lse)   (softmax_math)
    d_hidden = dz·W / T,  d_weight = dzᵀ·h / T,  d_bias = Σ_rows dz / T

so only ``lse`` (and ``p`` in the backward) see the rounding of ``z`` to 16 bits, as in the
plain bf16-logits code users write. Rows, vocabulary splits, the custom_vjp's residuals and
the per-device reductions follow :mod:`logprob_core` and :mod:`sharding` exactly as the lean
ops do; the two per-device pieces below are plain jnp (XLA's GEMMs and fusions).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_kernels import head, head_grad, logprob_core, sharding, softmax_math


@dataclasses.dataclass(frozen=True)
class Config:
    """How the fast mode runs (the defaults are what the ops use).

    The defaults were the fastest on an H100 (N=4096, D=2048, V=131072,
    ``benchmarks/results/bench_fast_mode.md``); the float16 copy, the one-pass lse, vocabulary
    blocks and a float16 gradient were slower (the last is 30 % more accurate).

    ``kept``: the dtype a bfloat16 head's logits are kept in (float16 holds every bfloat16
    value below 65504 exactly; beyond, a row's lse and log-prob become inf / NaN: loud);
    float16 heads keep float16, float32 heads float32.
    ``lse``: ``"one_pass"`` (one read of the kept logits: a running (max, Σ exp) reduction)
    or ``"two_pass"`` (the max, then Σ exp). ``vocab_blocks``: the backward writes the
    logits' gradient in this many vocabulary blocks (1: all at once; more: less memory, more
    and smaller GEMMs). ``grad``: the dtype of the logits' gradient in the backward GEMMs of
    a bfloat16 head (a float16 head's is always the scaled float16): ``"head"`` (the head's
    own dtype) or ``"float16"`` (scaled per row as in ``head_grad.Scaled``: three more bits
    than bfloat16, for a float16 copy of W and h).
    """

    kept: str = "bfloat16"
    lse: str = "two_pass"
    vocab_blocks: int = 1
    grad: str = "head"


DEFAULT = Config()


def kept_dtype(hidden_dtype, weight_dtype, config: Config = DEFAULT):
    """The dtype the forward keeps the logits in: a bfloat16 head's ``config.kept``, a float16
    head's own dtype, float32 otherwise."""
    dtype = jnp.dtype(jnp.result_type(hidden_dtype, weight_dtype))
    if dtype == jnp.bfloat16:
        return jnp.dtype(config.kept)
    return dtype if dtype.itemsize == 2 else jnp.dtype(jnp.float32)


def kept_bytes(n_rows: int, vocab: int, hidden_dtype, weight_dtype,
               config: Config = DEFAULT) -> int:
    """Bytes of the logits the forward keeps for the backward."""
    return n_rows * vocab * kept_dtype(hidden_dtype, weight_dtype, config).itemsize


def _product(hidden, weight, weight_layout, config):
    """``hidden @ Wᵀ`` [N, V]: accumulated in float32, rounded once to the head's dtype, kept
    in :func:`kept_dtype` (float16 holds every bfloat16 value up to 65504 exactly)."""
    dtype = jnp.result_type(hidden, weight)
    z = head.logits(hidden.astype(dtype), weight.astype(dtype), weight_layout,
                    precision=head.matmul_precision(dtype),
                    preferred_element_type=head.gemm_dtype(dtype))
    return z.astype(dtype).astype(kept_dtype(hidden.dtype, weight.dtype, config))


def _max_and_sum_exp(zs):
    """Per row ``(m, Σ exp(z − m))`` in one reduction over the columns."""
    def combine(x, y):
        m = jnp.maximum(x[0], y[0])
        m_safe = jnp.where(m == -jnp.inf, 0.0, m)
        return m, x[1] * jnp.exp(x[0] - m_safe) + y[1] * jnp.exp(y[0] - m_safe)

    return jax.lax.reduce((zs, jnp.ones_like(zs)), (jnp.float32(-jnp.inf), jnp.float32(0.0)),
                          combine, (1,))


def _scaled(z, bias, temperature):
    """z̃ = (z + b) / T in float32, from the values the kept logits ``z`` hold.

    ``reduce_precision`` pins them: XLA's GPU compiler drops a float32 → 16-bit → float32
    round trip where it can (``xla_allow_excess_precision``, as when an N = 1 product becomes
    a fused reduction), which would take the forward's statistics from unrounded logits and
    the backward's softmax from the kept, rounded ones."""
    finfo = jnp.finfo(z.dtype)
    z = jax.lax.reduce_precision(z.astype(jnp.float32), exponent_bits=finfo.nexp,
                                 mantissa_bits=finfo.nmant)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return z if temperature == 1.0 else z / temperature


def _target_logits(hidden, weight, bias, t_local, weight_layout, temperature):
    """z̃ at each row's target column, in float32 from the operands (exact, not rounded);
    anything for a target outside this device's columns."""
    t = jnp.clip(t_local, 0, head.vocab_size(weight, weight_layout) - 1)
    rows = head.target_rows(weight, t, weight_layout)
    z_t = jnp.sum(hidden.astype(jnp.float32) * rows.astype(jnp.float32), axis=-1)
    if bias is not None:
        z_t = z_t + bias[t].astype(jnp.float32)
    return z_t if temperature == 1.0 else z_t / temperature


def local_forward(plan, hidden, weight, bias, targets, row_valid, *, weight_layout,
                  temperature, with_entropy, config=DEFAULT):
    """One device's rows [N, D] and columns: (logp, entropy | None, lse, active, z [N, V])."""
    vocab = head.vocab_size(weight, weight_layout)
    t_local = targets - plan.vocab_offset(vocab)
    z = _product(hidden, weight, weight_layout, config)
    zs = _scaled(z, bias, temperature)
    if config.lse == "one_pass" and not with_entropy:
        stats = _max_and_sum_exp(zs)
        m = stats[0]
    else:
        m = jnp.max(zs, axis=-1)
        shifted = zs - m[:, None]
        e = jnp.exp(shifted)
        stats = (m, jnp.sum(e, axis=-1))
        if with_entropy:
            stats += (jnp.sum(e * shifted, axis=-1),)
    target_rel = _target_logits(hidden, weight, bias, t_local, weight_layout, temperature) - m
    logp, entropy, lse, active = logprob_core._finish(plan, stats, target_rel, t_local, vocab,
                                                      row_valid)
    return logp, entropy, lse, active, z


def _block_grads(hidden, weight, bias, z, cols, t_local, lse, entropy, g, g_ent, *,
                 weight_layout, temperature, fresh=None, scaled=None):
    """For the kept logits ``z`` [N, C] of columns ``cols``: (dz·W_c, d_W_c, d_b_c), with dz
    zero outside the ``fresh`` columns (all when None). With ``scaled`` (a
    ``head_grad.Scaled``; ``hidden`` and ``weight`` then its float16 h16 and σ_W·W), the
    GEMMs take G = dz / s in float16 and return the float32 G·W16 and the scaled d_W_c."""
    is_target = cols[None, :] == t_local[:, None]
    if scaled is not None:
        g, g_ent = scaled.rows.g, scaled.rows.g_ent
    dz = softmax_math.logprob_grad_tile(_scaled(z, bias, temperature), lse, entropy, is_target, g,
                                   g_ent, temperature)
    if fresh is not None:
        dz = jnp.where(fresh, dz, 0.0)
    if scaled is not None:
        g16 = dz.astype(jnp.float16)
        acc = head.hidden_grad(g16, weight, weight_layout, preferred_element_type=jnp.float32)
        d_w = head_grad.rounded_weight_grad(g16, hidden, weight, weight_layout,
                                            scaled.d_w_scale)
        d_b = None if bias is None else jnp.sum(dz * scaled.s[:, None], axis=0)
        return acc, d_w, d_b
    dtype = jnp.result_type(hidden, weight)
    dz_op = dz.astype(dtype)
    d_hidden = head.hidden_grad(dz_op, weight.astype(dtype), weight_layout,
                                precision=head.matmul_precision(dtype),
                                preferred_element_type=jnp.float32)
    d_weight = head_grad.rounded_weight_grad(dz_op, hidden.astype(dtype), weight, weight_layout)
    d_bias = None if bias is None else jnp.sum(dz, axis=0)
    return d_hidden, d_weight, d_bias


def local_backward(hidden, weight, bias, z, t_local, lse, entropy, g, g_ent, *, weight_layout,
                   temperature, config=DEFAULT):
    """(d_hidden, d_weight, d_bias | None) on one device from the kept logits; rows without a
    gradient arrive with g = g_ent = 0 and lse = +inf (``logprob_core._backward_rows``)."""
    vocab = z.shape[1]
    rows = (t_local, lse, entropy, g, g_ent)
    options = dict(weight_layout=weight_layout, temperature=temperature)
    blocks = max(1, min(config.vocab_blocks, vocab))
    dtype = jnp.dtype(jnp.result_type(hidden, weight))
    # float16 always takes the scaled gradient: unscaled, a row's small entries of dz fall
    # among float16's subnormals (below 6.1e-5), where it keeps few bits
    if dtype == jnp.float16 or (config.grad == "float16" and dtype.itemsize == 2):
        scaled = head_grad.Scaled.of(hidden, weight, lse, entropy, g, g_ent, temperature)
        w16 = (weight.astype(jnp.float32) * scaled.sigma_w).astype(jnp.float16)
        acc, d_w, d_b = _block_grads(scaled.h16, w16, bias, z, jnp.arange(vocab), *rows,
                                     scaled=scaled, **options)
        return (scaled.finish(acc, hidden.dtype), d_w.astype(weight.dtype),
                None if bias is None else d_b.astype(bias.dtype))
    if blocks == 1:
        d_hidden, d_weight, d_bias = _block_grads(hidden, weight, bias, z, jnp.arange(vocab),
                                                  *rows, **options)
        return d_hidden, d_weight, None if bias is None else d_bias.astype(bias.dtype)
    # Blocks of `size` columns; the last one is pulled back to end at V, and the columns an
    # earlier block already wrote (col < c·size) keep their values.
    size = -(-vocab // blocks)

    def block(c, carry):
        d_hidden, d_weight, d_bias = carry
        start = jnp.minimum(c * size, vocab - size)
        cols = start + jnp.arange(size)
        fresh = cols >= c * size
        z_c = jax.lax.dynamic_slice_in_dim(z, start, size, axis=1)
        w_c = head.vocab_slice(weight, start, size, weight_layout)
        b_c = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
        dh, dw, db = _block_grads(hidden, w_c, b_c, z_c, cols, *rows,
                                  fresh=fresh, **options)
        old = head.vocab_slice(d_weight, start, size, weight_layout)
        d_weight = head.vocab_update(
            d_weight, jnp.where(head.per_column(fresh, weight_layout), dw, old), start,
            weight_layout)
        if d_bias is not None:
            old_b = jax.lax.dynamic_slice_in_dim(d_bias, start, size)
            d_bias = jax.lax.dynamic_update_slice_in_dim(d_bias, jnp.where(fresh, db, old_b),
                                                         start, 0)
        return d_hidden + dh, d_weight, d_bias

    init = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(weight.shape, weight.dtype),
            None if bias is None else jnp.zeros((vocab,), jnp.float32))
    d_hidden, d_weight, d_bias = jax.lax.fori_loop(0, blocks, block, init)
    return (d_hidden.astype(hidden.dtype), d_weight,
            None if bias is None else d_bias.astype(bias.dtype))


def forward(hidden, weight, bias, targets, row_valid, *, weight_layout, temperature,
            with_entropy, vocab_axis=None, record=None, config=DEFAULT):
    """``((logp, entropy | None), (lse, active, z))`` of ``hidden @ Wᵀ + bias`` with the
    logits ``z`` [..., V] kept (each device its columns), through :func:`sharding.run`.

    Same arguments and layouts as ``logprob_core.linear_from_parts`` (rows ``[...]``, global
    target ids, ``vocab_axis`` inside ``jax.shard_map``)."""
    k = targets.ndim
    rows = "r" * k
    h_roles, w_roles, b_roles = logprob_core.head_roles(k, weight_layout)
    n_out = 2 if with_entropy else 1

    def local(plan, hidden, weight, bias, targets, row_valid):
        shape = targets.shape
        flat = logprob_core._rows_flat
        outs = local_forward(plan, flat(hidden, k), weight, bias, targets.reshape(-1),
                             row_valid.reshape(-1), with_entropy=with_entropy,
                             weight_layout=weight_layout, temperature=temperature,
                             config=config)
        logp, ent, lse, active, z = outs
        per_row = (logp, ent)[:n_out] + (lse, active)
        return tuple(o.reshape(shape) for o in per_row) + (z.reshape(shape + z.shape[-1:]),)

    outs = sharding.run(local, (hidden, weight, bias, targets, row_valid),
                        (h_roles, w_roles, b_roles, rows, rows),
                        (rows,) * (n_out + 2) + (rows + "v",), vocab_axis=vocab_axis,
                        record=record)
    logp, ent = outs[0], (outs[1] if with_entropy else None)
    lse, active, z = outs[n_out:]
    return (logp, ent), (lse, active, z)


def backward(hidden, weight, bias, kept, targets, lse, entropy, active, g, g_ent, *,
             weight_layout, temperature, vocab_axis=None, config=DEFAULT):
    """(d_hidden, d_weight, d_bias | None) from the kept logits ``kept`` (None: the logits
    are recomputed, one GEMM more) and per-token cotangents ``g`` / ``g_ent``."""
    options = dict(weight_layout=weight_layout, temperature=temperature, config=config)

    def local(hidden, weight, bias, *rest):
        if kept is None:
            rest = (_product(hidden, weight, weight_layout, config),) + rest
        return local_backward(hidden, weight, bias, *rest, **options)

    return logprob_core.head_backward(
        local, hidden, weight, bias, () if kept is None else (kept,), targets, lse, entropy,
        active, g, g_ent, weight_layout=weight_layout, vocab_axis=vocab_axis)


def fast_linear_logprobs(hidden, weight, bias, targets, row_valid, *, weight_layout,
                         temperature, return_entropy, vocab_axis=None, record=None,
                         config=DEFAULT):
    """``(logp, entropy | None)`` of ``hidden @ Wᵀ + bias``, the logits kept for the backward.

    Same arguments and layouts as ``logprob_core.linear_from_parts`` (rows ``[...]``, global
    target ids, ``vocab_axis`` inside ``jax.shard_map``)."""
    options = dict(weight_layout=weight_layout, temperature=temperature,
                   vocab_axis=vocab_axis, config=config)

    @jax.custom_vjp
    def op(hidden, weight, bias, targets, row_valid):
        return fwd(hidden, weight, bias, targets, row_valid)[0]

    def fwd(hidden, weight, bias, targets, row_valid):
        out, (lse, active, z) = forward(hidden, weight, bias, targets, row_valid,
                                        with_entropy=return_entropy, record=record, **options)
        return out, (hidden, weight, bias, targets, z, lse, out[1], active)

    def bwd(res, cot):
        hidden, weight, bias, targets, z, lse, ent, active = res
        g, g_ent = cot
        grads = backward(hidden, weight, bias, z, targets, lse, ent, active, g,
                         g_ent if return_entropy else None, **options)
        return grads + (None, None)

    op.defvjp(fwd, bwd)
    return op(hidden, weight, bias, targets, row_valid)
