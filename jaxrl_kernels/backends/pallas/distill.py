"""``distill_divergence`` on Mosaic GPU kernels: the divergence between two linear heads (the
kernels: ``distill_kernels.py``).

* :func:`distill_forward`: ``distill_kernels.pair_stats`` of every row, combined over the
  vocabulary's mesh axes and finalised by ``divergence_math``; for the JSD,
  ``distill_kernels.jsd_sums`` once ``lse_s`` and ``lse_t`` are known.
* :func:`distill_backward`: per vocabulary chunk, ``distill_kernels.student_grad`` writes the
  student's float32 logit gradient ``dz``; the chunk's two GEMMs ``d_hidden += dz·W_c`` and
  ``d_W_c = dzᵀ·h`` are XLA's, as in the chunked backend (``vocab_chunks.student_backward``),
  so that no ``[N, V]`` array exists: a chunk is ``vocab_chunks.DISTILL_CHUNK_BYTES``.

GEMMs per forward + backward: ``4 S + 2 T`` for either KL, ``5 S + 3 T`` for the JSD. The
kernels take 16-bit heads (each head's hidden states and weight of one dtype): wgmma's float32
path is TF32, which would break the float32 accuracy rule of docs/api.md. Off a GPU they run
in Mosaic GPU interpret mode (jax ≥ 0.12), for the tests.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxrl_kernels.backends.pallas import distill_kernels as kernels
from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.formulas import divergence_math as dm
from jaxrl_kernels.head import geometry, vocab_chunks

SERVED_DTYPES = ("bfloat16", "float16")


def declines(primitive, problem) -> str | None:
    dtypes = {
        problem.dtype,
        problem.weight_dtype,
        problem.teacher_dtype,
        problem.teacher_weight_dtype,
    }
    if (
        not dtypes <= set(SERVED_DTYPES)
        or len({problem.dtype, problem.weight_dtype}) > 1
        or (problem.teacher_dtype != problem.teacher_weight_dtype)
    ):
        return (
            "pallas distill_divergence takes 16-bit heads, each head's hidden states and "
            "weight of one dtype (bfloat16 or float16; wgmma's float32 is TF32), got "
            f"student {problem.dtype} × {problem.weight_dtype}, teacher "
            f"{problem.teacher_dtype} × {problem.teacher_weight_dtype}"
        )
    if not problem.on_gpu and not hasattr(plgpu, "InterpretGPUParams"):
        return "Mosaic GPU interpret mode (jax >= 0.12) is needed off a GPU"
    return None


def automatic(primitive, problem) -> str | None:
    """Automatic choice on a GPU passes these kernels over: they trail the chunked backend's
    cuBLAS GEMMs (benchmarks/results/bench_distill_pallas.md: 1.4× its time for a KL, 1.6×
    for the JSD, on an H100); ``backend="pallas"`` runs them."""
    return (
        "its Mosaic GPU kernels are slower than the chunked backend's cuBLAS GEMMs "
        "(benchmarks/results/bench_distill_pallas.md); backend='pallas' runs them"
    )


# -- the parts ----------------------------------------------------------------------------------


def distill_forward(
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    *,
    weight_layout,
    teacher_weight_layout,
    divergence,
    beta,
    temperature,
    vocab_axes=(),
):
    """Per row [N]: ``(d, lse_s, lse_t, kl_s)``, as the chunked backend's ``distill_forward``."""
    n_rows = hidden.shape[0]
    layouts = (weight_layout, teacher_weight_layout)
    student = kernels.prepare(hidden, weight, bias, weight_layout, temperature)
    teacher = kernels.prepare(t_hidden, t_weight, t_bias, teacher_weight_layout, temperature)
    stats = kernels.pair_stats(student, teacher, layouts=layouts, temperature=temperature)
    stats = dm.pair_stats_combine(tuple(x[:n_rows] for x in stats), vocab_axes)
    lse_s, lse_t, reverse, forward = dm.pair_stats_finalize(stats)

    def jsd_sums():
        pad = lambda x: kernels.pad(x, 0, kernels.BLOCK_ROWS)
        sums = kernels.jsd_sums(
            student, teacher, pad(lse_s), pad(lse_t), beta, layouts=layouts, temperature=temperature
        )
        return tuple(x[:n_rows] for x in sums)

    d, kl_s = dm.choose_divergence(divergence, beta, reverse, forward, jsd_sums, vocab_axes)
    return d, lse_s, lse_t, kl_s


def distill_backward(
    hidden,
    weight,
    bias,
    t_hidden,
    t_weight,
    t_bias,
    lse_s,
    lse_t,
    d,
    kl_s,
    g,
    *,
    weight_layout,
    teacher_weight_layout,
    divergence,
    beta,
    temperature,
):
    """(d_hidden, d_weight, d_bias | None) of the student for per-row cotangents ``g``."""
    (n_rows, dim), vocab = hidden.shape, geometry.vocab_size(weight, weight_layout)
    layouts = (weight_layout, teacher_weight_layout)
    hs, ws, bs = kernels.prepare(hidden, weight, bias, weight_layout, temperature)
    ht, wt, bt = kernels.prepare(t_hidden, t_weight, t_bias, teacher_weight_layout, temperature)
    rows = tuple(
        kernels.pad(x.astype(jnp.float32), 0, kernels.BLOCK_ROWS)
        for x in (lse_s, lse_t, d, kl_s, g)
    )

    def tile_grad(start, cols, fresh, size):
        chunk = lambda w, b, layout: (
            geometry.vocab_slice(w, start, size, layout),
            lax.dynamic_slice_in_dim(b, start, size),
        )
        return kernels.student_grad(
            (hs, *chunk(ws, bs, weight_layout)),
            (ht, *chunk(wt, bt, teacher_weight_layout)),
            rows,
            layouts=layouts,
            divergence=divergence,
            beta=beta,
            temperature=temperature,
        )

    d_bias_proxy = None if bias is None else kernels.pad(bias, 0, kernels.BLOCK_VOCAB)
    dh, dw, db = vocab_chunks.student_backward(
        hs, ws, d_bias_proxy, weight_layout, tile_grad, (hs, ws, bs, ht, wt, bt) + rows
    )
    dw = dw[:vocab, :dim] if weight_layout == "vd" else dw[:dim, :vocab]
    return dh[:n_rows, :dim], dw, None if db is None else db[:vocab]


OPS = {"distill_divergence": Parts(distill_forward, distill_backward)}
