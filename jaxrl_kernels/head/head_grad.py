"""The backward of a 16-bit linear head in two GEMMs per vocabulary chunk, shared by the kernel
backends: ``Scaled`` prepares what every chunk needs, ``backward`` runs the chunks as XLA
GEMMs in a loop around a backend kernel that writes the logit gradient (``pallas``), and
``ffi`` runs the same chunks in one custom call with its own GEMMs.

With ``z = (hidden @ Wᵀ + b) / T``, saved ``lse`` and per-row cotangents ``g`` (of logp) and
``g_ent`` (of the entropy H), ``dz = (g (onehot − p) − g_ent p (log p + H)) / T``. Per row,
``s = (|g| + |g_ent| (1/e + |H|)) / T`` bounds |dz| (|onehot − p| <= 1 and
|p (log p + H)| <= 1/e + |H|), so ``G = dz / s`` lies in [−1, 1] and float16 holds it to 2⁻¹¹:
three bits more than bf16, at bf16's GEMM speed. A truncated softmax (p = 0 where z is below
a per-row floor) keeps the same s. For each chunk of C vocabulary columns, in order, a backend
kernel writes ``G_c`` [N, C] (float16; it recomputes the chunk's logits), and ``W16_c`` if it
can (else XLA converts it), and two GEMMs (float16 operands, float32 accumulation) add

    acc      += G_c · W16_c                      W16 = σ_W · W            (float16)
    d_W_c     = (S / σ_h) · G_cᵀ · h16            h16 = σ_h (s / S) · hidden (float16)
    d_b_c     = Σ_n s_n G_c[n]

and at the end ``d_hidden = (s / σ_W) · acc``. σ_W, σ_h and S are powers of two that keep the
float16 operands in range, so every scale is exact except s. Extra memory: the float32
accumulator [N, D], h16 [N, D], and per chunk G_c, W16_c, and with XLA's GEMMs d_W_c (XLA
fuses the scale and the cast to W's dtype into the GEMM, then copies it into d_weight). No
atomics: every sum has a fixed order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_kernels.head import blocks, geometry, head_ids
from jaxrl_kernels.sharding.vma import varying_like


@dataclasses.dataclass(frozen=True)
class RowGrad:
    """What the logit-gradient kernel needs per row [N], in two forms (a kernel uses one):
    ``lse``, the cotangents already divided by the row bound s (``g``, ``g_ent`` | None), the
    ``entropy`` | None and the temperature; and the coefficients of
    ``G = alpha [v = target] − p (beta + gamma log p)`` (``gamma`` None without ``g_ent``).
    ``floor`` | None: the truncated softmax's per-row floor on z (p = 0 where z < floor; the
    one-hot term stays). Built once per backward by :meth:`of`, outside the chunk loop."""

    lse: jax.Array
    g: jax.Array
    g_ent: jax.Array | None
    entropy: jax.Array | None
    temperature: float
    alpha: jax.Array
    beta: jax.Array
    gamma: jax.Array | None
    floor: jax.Array | None = None

    @classmethod
    def of(cls, lse, g, g_ent, entropy, temperature, floor=None) -> RowGrad:
        inv_t = 1.0 / temperature
        if g_ent is None:
            return cls(lse, g, None, None, temperature, g * inv_t, g * inv_t, None, floor)
        return cls(
            lse,
            g,
            g_ent,
            entropy,
            temperature,
            g * inv_t,
            (g + g_ent * entropy) * inv_t,
            g_ent * inv_t,
            floor,
        )


WriteGrad = Callable[
    [RowGrad, jax.Array, int, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array | None]
]
"""``(rows, start, size, hidden, weight, sigma_w) -> (G, W16 | None)``: G float16 [N, size] for
vocabulary columns [start, start + size), and, if the kernel writes it too, the chunk's
W16 = float16(σ_W · W[those columns]) in W's layout (None: ``backward`` converts it)."""


def row_bound(g_logp, g_ent, entropy, temperature, g_ids=None):
    """s = (|g| + |g_ent|·(1/e + |H|)) / T >= max |dz| over the row (1 where it is 0); with K
    ids per row (``g_ids`` [N, K], ``g_logp`` their sum: ``head_ids.split_targets``) the
    one-hot terms add ``Σ_k |g_k|``. A truncated softmax (p = 0 below a floor) only makes
    |dz| smaller: the bound holds for it as well."""
    bound = jnp.abs(g_logp)
    if g_ids is not None:
        bound = bound + jnp.sum(jnp.abs(g_ids), axis=-1)
    if g_ent is not None:
        bound = bound + jnp.abs(g_ent) * (jnp.exp(-1.0) + jnp.abs(entropy))
    bound = bound / temperature
    return jnp.where(bound > 0, bound, 1.0).astype(jnp.float32)


def pow2_at_least(x):
    """The smallest power of two >= x (1 for x <= 0 or not finite)."""
    ok = jnp.isfinite(x) & (x > 0)
    return jnp.where(ok, jnp.exp2(jnp.ceil(jnp.log2(jnp.where(ok, x, 1.0)))), 1.0)


def pow2_range(amax, target=2.0**14):
    """A power of two σ with σ·amax <= target: float16 operands keep their range (max 65504)
    and leave the subnormals to what is 2⁻²⁴ of the largest value."""
    return target / pow2_at_least(amax.astype(jnp.float32))


INVARIANT_CHUNK_COLUMNS = 4096
"""Columns of a backward chunk when batch-invariant (:func:`invariant_chunk_columns`): a
function of V alone, so that a row's d_hidden sums the same chunks' products in the same order
whatever N is; a chunk's logit gradient is then ``N·4096`` entries."""

GEMM_ROWS = 1024
"""Rows of every d_hidden GEMM when batch-invariant (``blocks.map_blocks``): XLA picks a GEMM,
its blocking and any split of K by the shape, so one shape whatever N."""


def invariant_chunk_columns(vocab: int, align: int, columns: int = INVARIANT_CHUNK_COLUMNS) -> int:
    """``columns`` (a backend's constant, :data:`INVARIANT_CHUNK_COLUMNS` by default) rounded
    down to a multiple of ``align`` (at least ``align``), at most V."""
    return min(max(align, columns - columns % align), vocab)


def hidden_grad_rows(g, w, weight_layout, gemm_rows: int | None, **dot_options):
    """``geometry.hidden_grad(g, w)`` [N, D], in blocks of ``gemm_rows`` rows when given (every GEMM
    of one shape, ``blocks.map_blocks``), else as one GEMM."""
    if gemm_rows is None:
        return geometry.hidden_grad(g, w, weight_layout, **dot_options)
    return blocks.map_blocks(
        lambda g: geometry.hidden_grad(g, w, weight_layout, **dot_options), (g,), gemm_rows
    )


def chunk_columns(
    n_rows, vocab, chunk_bytes, align, bytes_per_entry=2, *, min_columns=0, logits_fraction=32
) -> int:
    """Columns per chunk: the chunk's logit gradient fits ``chunk_bytes`` or is
    ``min_columns`` wide, whichever is wider, a multiple of ``align`` (the kernel's vocabulary
    tile), and at most 1/``logits_fraction`` of what float32 [N, V] logits would take (small
    problems stay small). ``min_columns`` bounds a chunk's fixed costs at large N, where the byte
    budget alone leaves few columns (d_hidden's float32 [N, D] is read and written once a
    chunk)."""
    cap = n_rows * vocab * 4 // logits_fraction
    budget = min(max(chunk_bytes, bytes_per_entry * n_rows * min_columns), cap)
    size = budget // (bytes_per_entry * max(n_rows, 1))
    size = max(align, size - size % align)
    return min(size, vocab)


def initial_grads(hidden, weight, bias, weight_grad_init=jnp.zeros_like):
    """The carry of the chunk loop: float32 d_hidden (or its accumulator), d_weight in W's
    dtype (``weight_grad_init(weight)``: zeros, or a buffer the loop overwrites in full),
    float32 d_bias | None."""
    return (
        jnp.zeros(hidden.shape, jnp.float32),
        weight_grad_init(weight),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )


def run_chunks(chunk, carry, vocab: int, size: int):
    """``carry`` after ``chunk(carry, start, width)`` over the vocabulary in order: a
    ``fori_loop`` over the full chunks of ``size`` columns, then the narrower rest."""
    n_full, rest = divmod(vocab, size)
    carry = lax.fori_loop(0, n_full, lambda c, carry: chunk(carry, c * size, size), carry)
    if rest:
        carry = chunk(carry, n_full * size, rest)
    return carry


@dataclasses.dataclass(frozen=True)
class Scaled:
    """What every 16-bit head backward computes before its chunks: the row bound ``s``, the
    kernel's per-row ``rows``, ``h16`` = float16(σ_h (s / S) · hidden), σ_W (None where no
    weight is given: the kernel scales each chunk's weight copy by its own max |W| and
    divides it out again in the GEMM), and the scale of d_W = ``d_w_scale`` · Gᵀ · h16.
    ``finish`` turns the float32 accumulator of G · W16 (/ σ) into d_hidden, float32: a
    vocabulary split sums the devices' shares before the one rounding to hidden's dtype
    (``engine.vjp``)."""

    s: jax.Array
    rows: RowGrad | None
    h16: jax.Array
    sigma_w: jax.Array | None
    d_w_scale: jax.Array

    @classmethod
    def of(
        cls, hidden, weight, lse, entropy, g_logp, g_ent, temperature, g_ids=None, floor=None
    ) -> Scaled:
        s = row_bound(g_logp, g_ent, entropy, temperature, g_ids)
        rows = RowGrad.of(
            lse, g_logp / s, None if g_ent is None else g_ent / s, entropy, temperature, floor
        )
        return cls.of_bound(hidden, weight, s, rows)

    @classmethod
    def of_bound(cls, hidden, weight, s, rows=None) -> Scaled:
        """The scaled operands for a given row bound ``s`` [N] of |dz| (another head loss's
        gradient; ``rows`` None)."""
        top = pow2_at_least(jnp.max(s))
        scaled_h = hidden.astype(jnp.float32) * (s / top)[:, None]
        sigma_h = pow2_range(jnp.max(jnp.abs(scaled_h)))
        sigma_w = None if weight is None else pow2_range(jnp.max(jnp.abs(weight)))
        return cls(s, rows, (scaled_h * sigma_h).astype(jnp.float16), sigma_w, top / sigma_h)

    def finish(self, acc):
        scale = self.s if self.sigma_w is None else self.s / self.sigma_w
        return acc * scale[:, None]


def backward(
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
    write_grad: WriteGrad,
    chunk_bytes: int,
    align: int,
    weight_grad_init=jnp.zeros_like,
    floor=None,
    batch_invariant=False,
):
    """(d_hidden, d_weight, d_bias | None) of ``linear_logprobs`` for 16-bit hidden and weight;
    the arguments are those of the ``logprob_core`` backward part (rows without a gradient:
    lse = +inf, g = g_ent = 0). The chunks run in a ``fori_loop`` (unrolled, they are no
    faster: benchmarks/results/bench_linear_backward.md); they write every column of
    d_weight, so ``weight_grad_init`` may leave its buffer unwritten (pallas keeps the zeros;
    the measurement variant benchmarks/studies/variants/ffi_xla_gemms.py passes an unwritten one).
    ``targets`` and ``g_logp`` [N, K]: K ids per row (``head_ids.split_targets``), their
    one-hot terms added to each chunk's G (``write_grad`` is to write G with no target:
    built on the split's row targets). ``floor`` [N] | None: the truncated softmax's floor
    on z, handed to ``write_grad`` in ``RowGrad.floor`` (the one-hot terms are not masked).
    ``batch_invariant``: chunks of :func:`invariant_chunk_columns` and d_hidden's GEMMs in
    blocks of :data:`GEMM_ROWS` rows, so that each row's d_hidden is bitwise independent of N
    and of the other rows (``write_grad`` is to write each row's G independently of them)."""
    _, g_logp, ids, g_ids = head_ids.split_targets(targets, g_logp)
    scaled = Scaled.of(hidden, weight, lse, entropy, g_logp, g_ent, temperature, g_ids, floor)

    def write_g(start, size):
        g16, w16 = write_grad(scaled.rows, start, size, hidden, weight, scaled.sigma_w)
        if ids is not None:
            g16 = head_ids.add_id_grads(g16, ids, g_ids / (scaled.s * temperature)[:, None], start)
        return g16, w16

    return scaled_backward(
        hidden,
        weight,
        bias,
        scaled,
        write_g,
        weight_layout=weight_layout,
        chunk_bytes=chunk_bytes,
        align=align,
        weight_grad_init=weight_grad_init,
        batch_invariant=batch_invariant,
    )


def scaled_backward(
    hidden,
    weight,
    bias,
    scaled: Scaled,
    write_g,
    *,
    weight_layout,
    chunk_bytes: int,
    align: int,
    weight_grad_init=jnp.zeros_like,
    varying=(),
    batch_invariant=False,
):
    """:func:`backward`'s chunk loop for any head loss: ``write_g(start, size)`` gives the
    chunk's ``(G, W16 | None)`` with G = dz / s for the row bound ``scaled.s``. Inside a
    ``shard_map`` the loop's carry varies over the manual axes of hidden, weight, ``s`` and
    the other operands of ``write_g`` (``varying``). ``batch_invariant``: as in
    :func:`backward`."""
    n_rows = hidden.shape[0]
    vocab = geometry.vocab_size(weight, weight_layout)
    h16, sigma_w = scaled.h16, scaled.sigma_w
    gemm_rows = GEMM_ROWS if batch_invariant else None

    def chunk(carry, start, size):
        acc, d_weight, d_bias = carry
        g16, w16 = write_g(start, size)
        if w16 is None:
            w16 = (
                geometry.vocab_slice(weight, start, size, weight_layout).astype(jnp.float32)
                * sigma_w
            ).astype(jnp.float16)
        acc = acc + hidden_grad_rows(
            g16, w16, weight_layout, gemm_rows, preferred_element_type=jnp.float32
        )
        d_w = geometry.weight_grad(g16, h16, weight_layout, preferred_element_type=jnp.float32)
        d_weight = geometry.vocab_update(
            d_weight, (d_w * scaled.d_w_scale).astype(weight.dtype), start, weight_layout
        )
        if d_bias is not None:
            d_b = lax.dot_general(
                scaled.s,
                g16.astype(jnp.float32),
                (((0,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            d_bias = lax.dynamic_update_slice_in_dim(d_bias, d_b, start, axis=0)
        return acc, d_weight, d_bias

    init = varying_like(
        initial_grads(hidden, weight, bias, weight_grad_init), hidden, weight, scaled.s, *varying
    )
    columns = (
        invariant_chunk_columns(vocab, align)
        if batch_invariant
        else chunk_columns(n_rows, vocab, chunk_bytes, align)
    )
    acc, d_weight, d_bias = run_chunks(chunk, init, vocab, columns)
    return (
        scaled.finish(acc),
        d_weight,
        None if bias is None else d_bias.astype(bias.dtype),
    )


WEIGHT_BLOCK_BYTES = 64 * 2**20
""":func:`rounded_weight_grad`'s float32 GEMM results come a block of vocabulary columns of
about this many bytes at a time."""


def rounded_weight_grad(dz, hidden, weight, weight_layout, scale=None):
    """``scale · dzᵀ·hidden`` [W's shape] in W's dtype, accumulated in float32 and rounded once
    (``dz`` [N, V] and ``hidden`` [N, D] in the head's dtype; ``scale`` a float32 scalar or
    None). Where the GEMM can round its own float32 accumulator to W's dtype
    (:func:`geometry.gemm_dtype`) and there is no scale, that is one GEMM; otherwise the
    float32 results come a block of vocabulary columns at a time (``WEIGHT_BLOCK_BYTES``), so
    no ``[V, D]`` float32 buffer is held."""
    dtype = jnp.result_type(dz, hidden)
    precision = geometry.matmul_precision(dtype)
    if scale is None and geometry.gemm_dtype(dtype) == weight.dtype == dtype:
        return geometry.weight_grad(
            dz, hidden, weight_layout, precision=precision, preferred_element_type=dtype
        )
    vocab, dim = (
        geometry.vocab_size(weight, weight_layout),
        geometry.hidden_dim(weight, weight_layout),
    )

    def block(d_weight, start, size):
        dz_c = lax.dynamic_slice_in_dim(dz, start, size, axis=1)
        d_w = geometry.weight_grad(
            dz_c, hidden, weight_layout, precision=precision, preferred_element_type=jnp.float32
        )
        d_w = d_w if scale is None else d_w * scale
        return geometry.vocab_update(d_weight, d_w.astype(weight.dtype), start, weight_layout)

    init = varying_like(jnp.zeros(weight.shape, weight.dtype), dz, hidden, weight)
    size = min(vocab, max(128, WEIGHT_BLOCK_BYTES // (4 * max(dim, 1))))
    return run_chunks(block, init, vocab, size)
