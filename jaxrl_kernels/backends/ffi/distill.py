"""The ``ffi`` backend's ``distill_divergence``: SM90 kernels that hold both heads' logit tiles.

With ``S`` a GEMM of the student head ([N, D_s] × [D_s, V]) and ``T`` one of the teacher head,
the schedule is the chunked backend's (``4 S + 2 T`` for either KL, ``5 S + 3 T`` for the
JSD), with the elementwise work inside the kernels (``csrc/sm90_distill_kernel.cuh``):

* forward: one custom call, ``jaxrl_kernels_sm90_distill_stats``, computes each 128 × 128
  tile of both heads' logits with TMA + wgmma (``S + T``) and folds it into per-row
  statistics ``(m_s, s_s, A_s, m_t, s_t, A_t)`` of ``divergence_math`` and the row's smallest
  teacher logit, per vocabulary split; the splits merge here like vocabulary shards. The JSD
  calls it again for its sums ``KL_t``, ``KL_s`` (``S + T``).
* backward: per vocabulary chunk, ``jaxrl_kernels_sm90_distill_grad`` recomputes both heads'
  tiles (``S + T``) and writes ``G = ∂d/∂z_s · g / (T s)`` as float16, with ``s`` a per-row
  bound of the logit gradient (``divergence_math.student_grad_bound``), so that |G| <= 1;
  XLA's GEMMs add ``G · W16`` and write ``Gᵀ · h16`` (``head_grad.scaled_backward``, ``2 S``).

The fourth per-row residual (``kl_s`` of the other backends) is the row value the bound
needs: ``KL_s`` for the JSD, the teacher's log-prob range ``lse_t − min z_t`` (>= every
|log p_t|) for the reverse KL, 0 for the forward KL.

Serves bias-free heads in the ``"vd"`` layout, hidden states and weights of one 16-bit dtype
for both heads, D_s and D_t multiples of 8 (TMA's 16-byte strides).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.formulas import divergence_math as dm
from jaxrl_kernels.head import head_grad
from jaxrl_kernels.sharding.vma import varying_like

STATS_TARGET = "jaxrl_kernels_sm90_distill_stats"  # csrc/ffi_distill.cc
GRAD_TARGET = "jaxrl_kernels_sm90_distill_grad"
TILE_COLS = 128  # the kernels' vocabulary tile (kDistillBlockN): chunks start at multiples
PAIR_STATS_K = 7  # (m_s, s_s, A_s, m_t, s_t, A_t, min z_t) per row and split
GRAD_MODES = {"reverse_kl": 2, "forward_kl": 3, "jsd": 4}  # DistillMode in csrc/sm90_launch.h


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """What tunes the distillation kernels."""

    chunk_bytes: int = 32 * 2**20
    """Bytes of one backward chunk's float16 logit gradient (``head_grad.chunk_columns``); a
    chunk's gradient, weight copy and float32 d_weight scale with it, and 32 MiB keeps the
    device's peak under the lean mode's budget (docs/performance.md, "Constants and the
    measurements behind them")."""
    num_sms: int = 0
    """Multiprocessors the statistics' plan spreads over; 0: the GPU's own count (give it to
    lower for CUDA where no GPU is attached)."""


DEFAULT_CONFIG = DistillConfig()


def _num_sms(config):
    if config.num_sms:
        return config.num_sms
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    count = getattr(gpus[0], "core_count", None) if gpus else None
    if not count:
        raise RuntimeError(
            "ffi distill_divergence needs the GPU's multiprocessor count "
            "(jax.Device.core_count); set DistillConfig.num_sms to lower without one"
        )
    return int(count)


def declines(primitive: str, problem) -> str | None:
    """Why the kernels do not serve this distillation (None if they do)."""
    dtypes = {
        problem.dtype,
        problem.weight_dtype,
        problem.teacher_dtype,
        problem.teacher_weight_dtype,
    }
    if len(dtypes) != 1 or not dtypes <= {"bfloat16", "float16"}:
        return (
            "ffi distill_divergence takes both heads' hidden states and weights in one 16-bit "
            f"dtype, got student {problem.dtype} × {problem.weight_dtype}, teacher "
            f"{problem.teacher_dtype} × {problem.teacher_weight_dtype}"
        )
    if problem.weight_layout != "vd" or problem.teacher_weight_layout != "vd":
        return 'ffi distill_divergence takes "vd" weights [V, D] for both heads'
    if problem.has_bias or problem.teacher_has_bias:
        return "ffi distill_divergence takes heads without a bias"
    if problem.hidden_dim % 8 or problem.teacher_hidden_dim % 8:
        return (
            f"D_s = {problem.hidden_dim} and D_t = {problem.teacher_hidden_dim} must be "
            "multiples of 8 (TMA needs 16-byte row strides)"
        )
    if max(problem.n_rows, problem.vocab) >= 2**31:
        return "N and V must be below 2**31"
    return None


def _partials(heads, lse_s, lse_t, *, jsd_sums, beta, temperature, config):
    n_rows, vocab = heads[0].shape[0], heads[1].shape[0]
    splits = extension.sm90.distill_plan(n_rows, vocab, _num_sms(config))["splits"]
    k = 2 if jsd_sums else PAIR_STATS_K
    call = jax.ffi.ffi_call(
        STATS_TARGET,
        jax.ShapeDtypeStruct((splits, k, n_rows), jnp.float32),
        vmap_method="sequential",
    )
    partials = call(
        *heads,
        lse_s,
        lse_t,
        jsd_sums=jsd_sums,
        beta=np.float32(beta),
        temperature=np.float32(temperature),
        splits=np.int32(splits),
    )
    return varying_like(partials, *heads, lse_s, lse_t)  # a custom call's results vary over none


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
    config=None,
):
    """Per row [N]: ``(d, lse_s, lse_t, aux)`` (the module docstring says what ``aux`` is)."""
    config = config or DEFAULT_CONFIG
    heads = (hidden, weight, t_hidden, t_weight)
    none = jnp.zeros((0,), jnp.float32)
    partials = _partials(
        heads, none, none, jsd_sums=False, beta=beta, temperature=temperature, config=config
    )
    stats = dm.pair_stats_merge_splits(tuple(partials[:, k] for k in range(6)))
    min_t = jnp.min(partials[:, 6], axis=0)
    stats = dm.pair_stats_combine(stats, vocab_axes)
    if vocab_axes:
        min_t = jax.lax.pmin(min_t, vocab_axes)
    lse_s, lse_t, reverse, forward = dm.pair_stats_finalize(stats)

    def jsd_sums():
        sums = _partials(
            heads, lse_s, lse_t, jsd_sums=True, beta=beta, temperature=temperature, config=config
        )
        return jnp.sum(sums[:, 0], axis=0), jnp.sum(sums[:, 1], axis=0)

    d, kl_s = dm.choose_divergence(divergence, beta, reverse, forward, jsd_sums, vocab_axes)
    aux = {"reverse_kl": lse_t - min_t, "forward_kl": jnp.zeros_like(d), "jsd": kl_s}[divergence]
    return d, lse_s, lse_t, aux


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
    aux,
    g,
    *,
    weight_layout,
    teacher_weight_layout,
    divergence,
    beta,
    temperature,
    config=None,
):
    """(d_hidden, d_weight, None) of the student for per-row cotangents ``g``."""
    config = config or DEFAULT_CONFIG
    heads = (hidden, weight, t_hidden, t_weight)
    n_rows = hidden.shape[0]
    bound = jnp.abs(g) * dm.student_grad_bound(divergence, d, aux, beta) / temperature
    s = jnp.where(bound > 0, bound, 1.0).astype(jnp.float32)
    coef = (g / (temperature * s)).astype(jnp.float32)
    row_value = d if divergence == "reverse_kl" else aux
    scaled = head_grad.Scaled.of_bound(hidden, weight, s)
    rows = tuple(x.astype(jnp.float32) for x in (lse_s, lse_t, row_value, coef))

    def write_g(start, size):
        call = jax.ffi.ffi_call(
            GRAD_TARGET, jax.ShapeDtypeStruct((n_rows, size), jnp.float16), vmap_method="sequential"
        )
        g16 = call(
            *heads,
            *rows,
            jnp.asarray(start, jnp.int32).reshape(1),
            mode=np.int32(GRAD_MODES[divergence]),
            beta=np.float32(beta),
            temperature=np.float32(temperature),
        )
        return varying_like(g16, *heads, *rows), None

    return head_grad.scaled_backward(
        hidden,
        weight,
        None,
        scaled,
        write_g,
        weight_layout=weight_layout,
        chunk_bytes=config.chunk_bytes,
        align=TILE_COLS,
        weight_grad_init=extension.uninitialized_like,
        varying=(*heads, *rows),
    )


PARTS = Parts(distill_forward, distill_backward)

OPS = {"distill_divergence": PARTS}
