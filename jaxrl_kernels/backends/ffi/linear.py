"""``linear_logprobs`` and its backward on the SM90 (Hopper) kernels, as XLA FFI custom calls.

With ``z = (hidden @ Wᵀ + b) / T`` (W is [V, D] for ``"vd"``, [D, V] for ``"dv"``):
``logp = z[target] - lse(z)``, ``entropy = lse(z) - Σ softmax(z)·z``.

Forward: one custom call, ``jaxrl_kernels_sm90_linear_logprobs`` (``csrc/``), that streams
hidden and weight tiles into shared memory with TMA, multiplies them with wgmma (float32
accumulators) and folds each 128 × 256 logit tile into per-row running (max, Σ exp,
Σ exp·z) in registers; logits never reach device memory. Outputs logp, the unmasked
entropy and the lse per row; scratch is 3 floats per row per vocabulary split.
These are the row statistics of ``logprob_core`` (which holds the custom_vjp and the
sharding). ``memory="fast"``'s ``kept_logits`` is the same kernel with one more result,
``jaxrl_kernels_sm90_linear_kept_logits``: it also writes the logits rounded to the head's
dtype [N, V], staged through shared memory, and folds those rounded values.
Backward: the ``linear_logprobs_backward`` primitive of the backend that ``dispatch`` resolves
for it (``Choice.backward``) -- this one's on Hopper: ``head_grad.Scaled`` (row bounds, float16
hidden, power-of-two scales), then one custom call, ``jaxrl_kernels_sm90_linear_logprobs_backward``,
that walks the vocabulary in chunks on XLA's stream. Per chunk a kernel with the same TMA +
wgmma mainloop recomputes the chunk's logits and writes their gradient G = dz / s (float16
[N, C]), and from its otherwise idle producer warps the chunk's float16 weight copy W16 (scaled
by a power of two from the chunk's max |W|, which the previous chunk's kernel found) and
the next chunk's max |W|; two CUTLASS GEMMs add G · W16 to a float32 d_hidden accumulator
and write Gᵀ · h16 straight into d_weight (``csrc/sm90_backward.cu``), over W16, which sits in
the chunk's own part of d_weight until then. :class:`Config` holds what tunes them: the
forward's vocabulary splits (0: the planner's choice) and the backward's chunk size. A
truncated softmax's per-row ``floor`` (on ``z``, with ``lse`` and ``entropy`` the kept set's)
is the backward call's last operand: its grad kernel takes p = 0 below it.

Serves bfloat16 or float16 hidden and weight of the same dtype, D a multiple of 8 and,
for ``"dv"``, V a multiple of 8 (TMA needs 16-byte row strides), on each device: a
vocabulary split that leaves a device a share that is not raises ``NotImplementedError`` when
the per-device call is traced. Under ``vmap`` the call runs once per batch element
(``vmap_method="sequential"``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.dispatch.contract import Parts
from jaxrl_kernels.head import geometry, head_grad, head_ids

TARGET = "jaxrl_kernels_sm90_linear_logprobs"  # csrc/ffi_forward.cc
KEPT_TARGET = "jaxrl_kernels_sm90_linear_kept_logits"  # csrc/ffi_forward.cc
KEPT_EXP_TARGET = "jaxrl_kernels_sm90_linear_kept_exp"  # the relative form (exp_offsets)
BACKWARD_TARGET = "jaxrl_kernels_sm90_linear_logprobs_backward"  # csrc/ffi_backward.cc
# Registered only by an extension built with JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON
# (csrc/ffi_variants.cc): the grad kernel alone over one chunk, called only by
# benchmarks/studies/variants/ffi_xla_gemms.py and tests.
GRAD_TARGET = "jaxrl_kernels_sm90_linear_logprobs_grad"
GRAD_CHUNK_BYTES = 64 * 2**20
"""Bytes of one backward chunk's float16 logit gradient: larger chunks run faster GEMMs for more
temporary memory; 64 MiB is where the gain levelled off (docs/performance.md, "Constants")."""
MIN_CHUNK_COLUMNS = 8192
"""The fewest columns of a backward chunk (still at most 1/:data:`LOGITS_FRACTION` of float32
[N, V]): past 4096 rows 64 MiB alone would narrow them, and each chunk costs d_hidden's GEMM a
read and a write of its float32 [N, D] accumulator (docs/performance.md, "Constants")."""
LOGITS_FRACTION = 16
"""A chunk's float16 G is at most 1/16 of float32 [N, V] logits: at small N each chunk is a fixed
cost, and G is all a wider chunk adds (docs/performance.md, "Constants")."""
TILE_COLS = 256  # the kernels' vocabulary tile: backward chunks start at multiples of it
INVARIANT_CHUNK_COLUMNS = 8192
"""The backward's chunk when batch-invariant (a function of V alone): twice the other backends'
(``head_grad.INVARIANT_CHUNK_COLUMNS``). Its d_hidden GEMM does not split K, so each chunk is a
GEMM with few output tiles at small N, and halving their number halves what a chunk costs
beyond its arithmetic (docs/performance.md, "Constants and the measurements behind them"). Its
G holds ``N·8192`` float16 entries."""
INVARIANT_SPLITS = 132
"""The forward's vocabulary splits when batch-invariant (at most one per 256-column tile): a
constant, where the planner's choice follows N. 132 (an H100 / H200 SXM's SM count) keeps the
planner's model of the busiest CTA's tiles (``makespan`` in csrc/sm90_launch.cu) within 1 % of
its own choice for N = 128 ... 16384 and V = 32000 ... 151936; on the GPU it is not measured."""
SERVED_DTYPES = ("bfloat16", "float16")
ALIGN = 8  # elements: 16-byte TMA strides for 16-bit types


@dataclasses.dataclass(frozen=True)
class Config:
    """What tunes the SM90 kernels (docs/architecture.md: a Config is what a caller sets, the
    C++ ``Plan`` what one shape makes of it), passed to them as custom-call attributes:
    ``splits`` to the forward call, ``chunk_bytes`` as the backward call's ``chunk`` columns."""

    splits: int = 0
    """Vocabulary splits of the forward's persistent grid; 0: the planner's choice
    (``choose_plan`` in csrc/sm90_launch.cu, ``_sm90.plan``)."""
    chunk_bytes: int = GRAD_CHUNK_BYTES
    """Bytes of one backward chunk's float16 logit gradient (``head_grad.chunk_columns``)."""
    weight_copy: str = "auto"
    """Who writes each backward chunk's float16 weight copy: ``"in_kernel"``, the grad kernel's
    otherwise idle producer warps, under its tiles; ``"apart"``, a kernel of its own on the
    whole GPU before it (faster where too few rows' tiles hide the copy: under 2048 rows);
    ``"auto"``: the backward's choice per chunk (``choose_weight_copy`` in
    csrc/sm90_launch.cu). Results are bitwise the same either way."""
    batch_invariant: bool = False
    """Launch parameters that do not depend on N: ``splits`` (0: :data:`INVARIANT_SPLITS`),
    backward chunks of :data:`INVARIANT_CHUNK_COLUMNS` and a d_hidden GEMM
    that never splits K (the backward call's ``split_k`` attribute; otherwise it splits K by a
    count that follows N where its tiles fill the GPU poorly: ``hidden_plan`` in
    csrc/sm90_gemm_hidden.cu). Each row's results are then bitwise independent of the other
    rows."""
    hidden_tiles: str = "auto"
    """How d_hidden's GEMM covers its output: ``"auto"``, ``hidden_plan``'s choice of K's parts
    and tile width (csrc/sm90_gemm_hidden.cu); ``"wide"`` (256 columns) or ``"narrow"`` (128),
    K unsplit in tiles of that width, for measuring that rule. ``"wide"`` and ``"narrow"`` give
    bitwise the same results (a tile's width leaves each sum as it is), and ``"auto"`` too
    where it does not split K."""

    def weight_copy_code(self) -> int:
        """The backward call's ``weight_copy`` attribute (csrc/sm90_launch.h ``WeightCopy``)."""
        return _code("weight_copy", self.weight_copy, ("auto", "in_kernel", "apart"))

    def hidden_tiles_code(self) -> int:
        """The backward call's ``hidden_tiles`` attribute (csrc/sm90_launch.h ``HiddenTiles``)."""
        return _code("hidden_tiles", self.hidden_tiles, ("auto", "wide", "narrow"))

    def forward_splits(self) -> int:
        """The forward call's ``splits`` attribute (0: the planner's choice)."""
        return self.splits or (INVARIANT_SPLITS if self.batch_invariant else 0)


def _code(field: str, value: str, names: tuple[str, ...]) -> int:
    """A C++ enum's value: ``value``'s place among ``names``, or the error naming them."""
    if value not in names:
        raise ValueError(f"{field}: expected one of {sorted(names)}, got {value!r}")
    return names.index(value)


DEFAULT_CONFIG = Config()

INVARIANT_CONFIG = Config(batch_invariant=True)


def declines(primitive: str, problem) -> str | None:
    """Why the kernel does not serve these inputs to ``linear_logprobs`` or its backward (None
    if it does)."""
    if problem.dtype not in SERVED_DTYPES:
        return (
            f"hidden is {problem.dtype}; the SM90 kernel serves bfloat16 and float16 "
            "(wgmma operands)"
        )
    if problem.weight_dtype is not None and problem.weight_dtype != problem.dtype:
        return (
            f"weight is {problem.weight_dtype} and hidden {problem.dtype}; the kernel needs "
            "one 16-bit dtype for both"
        )
    if problem.hidden_dim % ALIGN != 0:
        return (
            f"D = {problem.hidden_dim} is not a multiple of {ALIGN} (TMA needs 16-byte row strides)"
        )
    if problem.weight_layout == "dv" and problem.vocab % ALIGN != 0:
        return (
            f'V = {problem.vocab} is not a multiple of {ALIGN}; the "dv" weight [D, V] needs '
            "16-byte row strides for TMA"
        )
    if max(problem.n_rows, problem.vocab, problem.hidden_dim) >= 2**31:
        return "N, V and D must each be below 2**31"
    return None


def _check_served(hidden, weight, weight_layout):
    """The per-device operands' checks (dispatch saw the global shapes: a vocabulary split can
    leave a device a "dv" slice whose width TMA cannot stride)."""
    if weight.dtype != hidden.dtype or hidden.dtype.name not in SERVED_DTYPES:
        raise NotImplementedError(
            f"ffi: hidden {hidden.dtype} / weight {weight.dtype}: the kernel needs both bfloat16 "
            "or both float16 (dispatch should have declined this call)"
        )
    vocab = geometry.vocab_size(weight, weight_layout)
    if weight_layout == "dv" and vocab % ALIGN != 0:
        raise NotImplementedError(
            f'ffi: this device\'s "dv" weight slice is [{weight.shape[0]}, {vocab}]; its '
            f"{vocab} vocabulary columns are not a multiple of {ALIGN} (TMA needs 16-byte row "
            "strides). Split the vocabulary so that each device's share is a multiple of "
            f'{ALIGN}, use the "vd" layout, or pass backend="pallas" or "chunked".'
        )


def _f32_or_empty(x):
    """An optional operand as the custom calls take it: float32, or [0] when absent."""
    return jnp.zeros((0,), jnp.float32) if x is None else x.astype(jnp.float32)


def _forward_call(
    hidden,
    weight,
    bias,
    targets,
    row_valid,
    weight_layout,
    temperature,
    config=DEFAULT_CONFIG,
    keep_logits=False,
    logits_rows=None,
    exp_offsets=None,
):
    """(logp, entropy unmasked, lse), float32 [N] each, from the custom call; with
    ``keep_logits``, first the logits ``hidden @ Wᵀ`` [M, V] in the head's dtype (M:
    ``logits_rows``, N if None; the rows past N zero), the statistics then those of the
    rounded logits (the target logit unrounded); with ``exp_offsets`` [N] too, that first
    result is ``exp((hidden @ Wᵀ − offset) / T)`` instead (``head.relative_probs``), the
    statistics those of the unrounded logits."""
    _check_served(hidden, weight, weight_layout)
    n_rows = hidden.shape[0]
    has_bias = bias is not None
    bias32 = _f32_or_empty(bias)
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    results = (row, row, row)
    if keep_logits:
        vocab = geometry.vocab_size(weight, weight_layout)
        rows = n_rows if logits_rows is None else logits_rows
        results = (jax.ShapeDtypeStruct((rows, vocab), hidden.dtype),) + results
    target = TARGET if not keep_logits else KEPT_TARGET if exp_offsets is None else KEPT_EXP_TARGET
    call = jax.ffi.ffi_call(target, results, vmap_method="sequential")
    extra = () if exp_offsets is None else (exp_offsets.astype(jnp.float32),)
    return call(
        hidden,
        weight,
        bias32,
        targets.astype(jnp.int32),
        row_valid.astype(jnp.bool_),
        *extra,
        weight_dv=weight_layout == "dv",
        has_bias=has_bias,
        temperature=np.float32(temperature),
        splits=np.int32(config.forward_splits()),
    )


def backward_chunk(n_rows: int, vocab: int, config: Config = DEFAULT_CONFIG) -> int:
    """The backward call's ``chunk`` attribute: columns per chunk, a multiple of
    :data:`TILE_COLS` (``config.batch_invariant``: a function of V alone)."""
    if config.batch_invariant:
        columns = head_grad.invariant_chunk_columns(vocab, TILE_COLS, INVARIANT_CHUNK_COLUMNS)
    else:
        limits = dict(min_columns=MIN_CHUNK_COLUMNS, logits_fraction=LOGITS_FRACTION)
        columns = head_grad.chunk_columns(n_rows, vocab, config.chunk_bytes, TILE_COLS, **limits)
    return -(-columns // TILE_COLS) * TILE_COLS


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
    """The ``linear_logprobs_backward`` primitive (``logprob_core``'s backward part): one
    custom call over all chunks of ``config.chunk_bytes``. ``targets`` and ``g_logp`` [N, K]:
    K ids per row (``head_ids.split_targets``), whose one-hot terms a kernel adds to each
    chunk's G before its GEMMs. ``floor`` [N] | None: a truncated softmax's per-row floor on
    ``z = (hidden @ Wᵀ + b) / T`` (``lse`` and ``entropy`` the kept set's): the grad kernel takes
    p = 0 where ``z < floor`` (the one-hot terms stay); None passes an empty operand, and the call runs
    the kernel without a floor. The row bound s needs no floor: masking p only shrinks |dz|."""
    _check_served(hidden, weight, weight_layout)
    targets, g_logp, ids, g_ids = head_ids.split_targets(targets, g_logp)
    config = config or DEFAULT_CONFIG
    n_rows, depth = hidden.shape
    vocab = geometry.vocab_size(weight, weight_layout)
    chunk = backward_chunk(n_rows, vocab, config)
    # weight=None: the kernels take each chunk's max |W| on the way (no pass over W here)
    scaled = head_grad.Scaled.of(hidden, None, lse, entropy, g_logp, g_ent, temperature, g_ids)
    if ids is None:
        ids, id_coef = jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    else:
        id_coef = (g_ids / (scaled.s * temperature)[:, None]).astype(jnp.float32)
    rows = scaled.rows
    split_k = not config.batch_invariant
    hidden_tiles = config.hidden_tiles_code()
    workspace = extension.sm90.backward_workspace_bytes(
        n_rows,
        vocab,
        depth,
        chunk,
        weight_layout == "dv",
        hidden.dtype == jnp.bfloat16,
        split_k,
        hidden_tiles,
    )
    scalars = jnp.stack([scaled.d_w_scale, jnp.float32(1)]).astype(jnp.float32)
    call = jax.ffi.ffi_call(
        BACKWARD_TARGET,
        (
            jax.ShapeDtypeStruct((n_rows, depth), jnp.float32),
            jax.ShapeDtypeStruct(weight.shape, weight.dtype),
            jax.ShapeDtypeStruct((vocab,) if bias is not None else (0,), jnp.float32),
            jax.ShapeDtypeStruct((workspace,), jnp.uint8),
        ),
        vmap_method="sequential",
    )
    acc, d_weight, d_bias, _ = call(
        hidden,
        weight,
        _f32_or_empty(bias),
        targets.astype(jnp.int32),
        rows.lse,
        rows.alpha,
        rows.beta,
        _f32_or_empty(rows.gamma),
        scaled.h16,
        scaled.s,
        scalars,
        ids.astype(jnp.int32),
        id_coef,
        _f32_or_empty(floor),
        weight_dv=weight_layout == "dv",
        has_bias=bias is not None,
        has_entropy=rows.gamma is not None,
        temperature=np.float32(rows.temperature),
        chunk=np.int64(chunk),
        weight_copy=np.int64(config.weight_copy_code()),
        split_k=split_k,
        hidden_tiles=np.int64(hidden_tiles),
    )
    return (
        scaled.finish(acc),
        d_weight,
        None if bias is None else d_bias.astype(bias.dtype),
    )


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
    """The row statistics of ``logprob_core`` from the custom call's finalized outputs: with
    ``m = lse`` the sum of exponentials is 1, ``a = −entropy`` and ``z_target − m = logp``."""
    logp, entropy, lse = _forward_call(
        hidden,
        weight,
        bias,
        targets,
        row_valid,
        weight_layout,
        temperature,
        config or DEFAULT_CONFIG,
    )
    return lse, jnp.ones_like(lse), (-entropy if with_entropy else None), logp


KEPT_LOGITS_MIN_ROWS = 512
"""Automatic choice takes :func:`kept_logits` for calls of at least this many rows (the
call's, before any split): below it the call's fixed costs outweigh what the kernel saves over
XLA's logits (docs/performance.md, "Constants and the measurements behind them")."""


def kept_logits(plan, hidden, weight, bias, t_local, row_valid, *, with_entropy, **options):
    """The ``kept_logits`` primitive (``memory="fast"``'s forward, as
    ``rounded_logits.local_stats``) from one custom call: the kernel writes the logits rounded
    to the head's dtype as it folds them, so no pass reads them back for the statistics; at
    ``plan.logits_rows`` rows where row skipping runs it on the first rows (the rest zero).
    ``options``: ``weight_layout``, ``temperature`` and ``exp_offsets`` (the relative form,
    ``head.relative_probs``, where given)."""
    options.update(keep_logits=True, logits_rows=plan.logits_rows)
    z, logp, entropy, lse = _forward_call(hidden, weight, bias, t_local, row_valid, **options)
    stats = (lse, jnp.ones_like(lse)) + ((-entropy,) if with_entropy else ())
    return stats, logp, z


PARTS = Parts(linear_stats, backward=None)  # the backward: dispatch's choice (Choice.backward)

OPS = {
    "linear_logprobs": PARTS,
    "linear_logprobs_backward": linear_backward,
    "kept_logits": kept_logits,
}

INVARIANT_OPS = {
    "linear_logprobs": Parts(
        functools.partial(linear_stats, config=INVARIANT_CONFIG), backward=None
    ),
    "linear_logprobs_backward": functools.partial(linear_backward, config=INVARIANT_CONFIG),
}
"""The same under :data:`INVARIANT_CONFIG` (the backward resolved for a batch-invariant call
is a batch-invariant one too): each row's results bitwise independent of the other rows."""
