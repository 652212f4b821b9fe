"""``linear_logprobs`` on Pallas (Triton) kernels: log-probs of an LM head without logits.

With ``z = (hidden @ Wᵀ + b) / T`` (W is [V, D] for ``"vd"``, [D, V] for ``"dv"``):
``logp = z[target] - lse(z)`` and ``entropy = lse(z) - Σ softmax(z)·z``.

This module is the op: the ``logprob_core`` parts built from the kernels in
``linear_kernels.py`` (statistics, target) and ``linear_grad_kernel.py`` (logit gradient),
tuned by ``linear_config.Config``.

Forward (:func:`linear_stats`)
  the statistics kernel leaves S partial (max, Σ exp[, Σ exp·z]) per row, one per vocabulary
  split; they are combined in a fixed pairwise tree (``softmax_math.online_softmax_merge``); the
  target logit comes from a gather-dot kernel.
Backward (:func:`linear_backward`)
  per vocabulary chunk of C columns, the grad kernel recomputes the chunk's logits and writes
  ``dz = d loss / d logits`` (``softmax_math.logprob_grad_tile``, saved lse, optional per-row
  floor of a truncated softmax) -- for 16-bit inputs
  scaled per row into float16 (``head_grad``); XLA's GEMMs then add ``dz · W_c`` to a float32
  d_hidden and write ``d_W_c = dzᵀ · hidden``. C bounds the extra memory; no atomics, the
  order of every sum is fixed.
Batch-invariant (:data:`INVARIANT_OPS`, ``Config.batch_invariant``)
  row tiles of ``block_rows`` whatever N, C fixed (``head_grad.invariant_chunk_columns``) and
  d_hidden's GEMMs on blocks of ``head_grad.GEMM_ROWS`` rows: each row's results do not
  depend on the other rows.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxrl_kernels.backends.pallas import linear_grad_kernel as grad_kernel
from jaxrl_kernels.backends.pallas import linear_kernels as kernels
from jaxrl_kernels.backends.pallas.linear_config import (
    DEFAULT_CONFIG,
    INVARIANT_CONFIG,
    Config,
    TileConfig,
)
from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.formulas import softmax_math
from jaxrl_kernels.head import geometry, head_grad, head_ids

__all__ = [
    "Config",
    "DEFAULT_CONFIG",
    "INVARIANT_CONFIG",
    "TileConfig",
    "declines",
    "kernel_parts",
    "linear_backward",
    "linear_stats",
    "OPS",
    "INVARIANT_OPS",
]

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def declines(primitive, problem) -> str | None:
    if problem.dtype not in SUPPORTED_DTYPES:
        return f"pallas linear_logprobs serves {', '.join(SUPPORTED_DTYPES)}, not {problem.dtype}"
    return None


def _isolated(outs, config):
    """A kernel's outputs behind an optimization barrier under ``config.batch_invariant``: in
    interpret mode a grid of one program is inlined by XLA and fused with what follows, which
    can round differently from the loop over several programs."""
    return lax.optimization_barrier(outs) if config.batch_invariant else outs


def merge_splits(parts):
    """Combine [S, N] partial statistics into [N] in a fixed pairwise tree."""
    while parts[0].shape[0] > 1:
        if parts[0].shape[0] % 2:
            identity = (-jnp.inf,) + (0.0,) * (len(parts) - 1)
            parts = tuple(
                jnp.concatenate([p, jnp.full((1, p.shape[1]), e, p.dtype)])
                for p, e in zip(parts, identity)
            )
        parts = softmax_math.online_softmax_merge(
            tuple(p[0::2] for p in parts), tuple(p[1::2] for p in parts)
        )
    return tuple(p[0] for p in parts)


def linear_stats(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    *,
    weight_layout,
    temperature,
    with_entropy,
    config=None,
):
    """The row statistics ``(m, s, a | None, z_target − m)`` of ``logprob_core``."""
    config = config or DEFAULT_CONFIG
    vocab = geometry.vocab_size(weight, weight_layout)
    scale = 1.0 / temperature
    parts = _isolated(
        kernels.stats_call(
            hidden,
            weight,
            bias,
            layout=weight_layout,
            scale=scale,
            with_entropy=with_entropy,
            config=config,
        ),
        config,
    )
    stats = merge_splits(tuple(parts))
    in_range = (targets >= 0) & (targets < vocab)
    safe = jnp.where(in_range & row_valid, targets, 0).astype(jnp.int32)
    target_z = _isolated(
        kernels.target_call(
            hidden, weight, bias, safe, layout=weight_layout, scale=scale, config=config
        ),
        config,
    )
    return stats[0], stats[1], (stats[2] if with_entropy else None), target_z - stats[0]


def _write_grad(bias, targets, *, layout, config):
    """``head_grad.WriteGrad`` on the Triton grad kernel: G = dz / s as float16."""

    def write(rows: head_grad.RowGrad, start, size, hidden, weight, sigma_w):
        g16, _ = _isolated(
            grad_kernel.grad_call(
                start,
                size,
                hidden,
                weight,
                bias,
                targets,
                rows.lse,
                rows.g,
                rows.entropy,
                rows.g_ent,
                layout=layout,
                temperature=rows.temperature,
                dz_dtype=jnp.float16,
                config=config,
                floor=rows.floor,
            ),
            config,
        )
        # the kernel's column sums of dz are unused (head_grad takes d_bias from G), and
        # head_grad converts the weight chunk
        return g16, None

    return write


def _float32_backward(
    hidden,
    weight,
    bias,
    targets,
    lse,
    entropy,
    g_logp,
    g_ent,
    *,
    layout,
    temperature,
    config,
    floor,
):
    """Per chunk float32 dz, d_hidden += dz·W_c, d_W_c = dzᵀ·hidden and d_b_c = Σ_rows dz,
    with full-precision float32 GEMMs."""
    targets, g_logp, ids, g_ids = head_ids.split_targets(targets, g_logp)
    n_rows = hidden.shape[0]
    vocab = geometry.vocab_size(weight, layout)
    w_axis = 0 if layout == "vd" else 1
    hidden32 = hidden.astype(jnp.float32)

    def dot(a, b, contract):
        return lax.dot_general(
            a,
            b,
            (contract, ((), ())),
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )

    def chunk(carry, start, size):
        d_hidden, d_weight, d_bias = carry
        dz, d_b = _isolated(
            grad_kernel.grad_call(
                start,
                size,
                hidden,
                weight,
                bias,
                targets,
                lse,
                g_logp,
                entropy,
                g_ent,
                layout=layout,
                temperature=temperature,
                dz_dtype=jnp.float32,
                config=config,
                floor=floor,
            ),
            config,
        )
        if ids is not None:
            dz = head_ids.add_id_grads(dz, ids, g_ids / temperature, start)
            d_b = jnp.sum(dz, axis=0)
        w_c = lax.dynamic_slice_in_dim(weight, start, size, axis=w_axis).astype(jnp.float32)
        d_h = head_grad.hidden_grad_rows(
            dz,
            w_c,
            layout,
            gemm_rows,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        if layout == "vd":
            d_w = dot(dz, hidden32, ((0,), (0,)))
        else:
            d_w = dot(hidden32, dz, ((0,), (0,)))
        d_hidden = d_hidden + d_h
        d_weight = lax.dynamic_update_slice_in_dim(
            d_weight, d_w.astype(weight.dtype), start, axis=w_axis
        )
        if d_bias is not None:
            d_bias = lax.dynamic_update_slice_in_dim(d_bias, d_b, start, axis=0)
        return d_hidden, d_weight, d_bias

    gemm_rows = head_grad.GEMM_ROWS if config.batch_invariant else None
    if config.batch_invariant:
        size = head_grad.invariant_chunk_columns(vocab, config.grad.block_vocab)
    else:
        size = head_grad.chunk_columns(
            n_rows, vocab, config.chunk_bytes, config.grad.block_vocab, bytes_per_entry=4
        )
    d_hidden, d_weight, d_bias = head_grad.run_chunks(
        chunk, head_grad.initial_grads(hidden, weight, bias), vocab, size
    )
    return (
        d_hidden,
        d_weight,
        None if bias is None else d_bias.astype(bias.dtype),
    )


def linear_backward(
    hidden,
    weight,
    bias,
    targets,
    lse,
    entropy,
    g_logp,
    g_ent,
    *,
    weight_layout,
    temperature,
    floor=None,
    config=None,
):
    """(d_hidden, d_weight, d_bias | None) of linear_logprobs from per-row cotangents.

    The backward part of ``logprob_core``: ``lse`` [N] is the per-row logsumexp of z (+inf on
    rows without a gradient, whose cotangents are 0), ``entropy`` [N] the entropy output;
    ``g_ent``/``entropy`` may be None; targets outside [0, V) add no one-hot term; targets
    and ``g_logp`` [N, K]: K ids per row (``head_ids.split_targets``). ``floor`` [N] | None:
    a truncated softmax keeping z >= floor per row (``lse``/``entropy`` are the kept set's), so
    p = 0 below it in every term; the one-hot terms are not masked.

    16-bit inputs: ``head_grad.backward``, with the grad kernel writing each chunk's
    G = dz / s in float16 -- two GEMM-equivalents per chunk. float32 inputs: float32 dz and
    full-precision float32 GEMMs per chunk.
    """
    config = config or DEFAULT_CONFIG
    targets = targets.astype(jnp.int32)
    if jnp.dtype(jnp.result_type(hidden, weight)).itemsize == 4:
        return _float32_backward(
            hidden,
            weight,
            bias,
            targets,
            lse,
            entropy,
            g_logp,
            g_ent,
            layout=weight_layout,
            temperature=temperature,
            config=config,
            floor=floor,
        )
    row_targets = head_ids.split_targets(targets, g_logp)[0]
    return head_grad.backward(
        hidden,
        weight,
        bias,
        targets,
        lse,
        entropy,
        g_logp,
        g_ent,
        weight_layout=weight_layout,
        temperature=temperature,
        write_grad=_write_grad(bias, row_targets, layout=weight_layout, config=config),
        chunk_bytes=config.chunk_bytes,
        align=config.grad.block_vocab,
        floor=floor,
        batch_invariant=config.batch_invariant,
    )


# -- the parts of logprob_core, and the primitive built from them ---------------------------


def kernel_parts(config: Config | None = None) -> Parts:
    """The ``logprob_core.Parts`` of these kernels under ``config``."""
    config = config or DEFAULT_CONFIG
    return Parts(
        functools.partial(linear_stats, config=config),
        functools.partial(linear_backward, config=config),
    )


OPS = {"linear_logprobs": kernel_parts(), "linear_logprobs_backward": linear_backward}

INVARIANT_OPS = {
    "linear_logprobs": kernel_parts(INVARIANT_CONFIG),
    "linear_logprobs_backward": functools.partial(linear_backward, config=INVARIANT_CONFIG),
}
"""The same under ``linear_config.INVARIANT_CONFIG``: each row's results bitwise independent of
the other rows."""
