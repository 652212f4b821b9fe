"""The launch plan and the Pallas kernels of ``ppo_loss`` (the op that runs them: ``ppo.py``;
``group_advantages``' kernel: ``group_kernels.py``).

Every kernel maps [B, T] tokens to values that cross no sequence or T-range,
so that a device holding part of T runs the same kernels on its part:

* :func:`forward_sums` (the forward's kernel): per sequence, the masked sums Σ_t m·v of
  ``ppo_math.forward_summands`` over the tokens of the input: Σ m, the policy term (or, for
  ``ratio_level="sequence"``, what it is linear in), Σ m·(logp - old_logp) and
  Σ m·(old_logp - rollout_logp) where the sequence-level options need them, and every metric
  part. One pass, whatever the options. It runs on a grid of (row tile, T split): each program
  adds its ``t_tiles_per_program`` [rows, T] tiles in order and writes [rows, K] partial sums;
  the splits' partials are then added in split order (deterministic, no atomics).
* :func:`token_summands` (the packed forward's kernel): the same masked summands m·v, written
  per token ([B, T] each) instead of added per row. On packed rows a row holds several
  sequences (``segment_math``), so the sums per sequence are taken over segment ids in jnp
  (``segment_math.segment_sums``, deterministic); the kernel stays token-local.
* :func:`token_grads` (the backward's kernel): given per-sequence coefficients c_b and the [B]
  sequence terms, each token's d logp (and d entropy) is the pull-back of c_b·m through
  ``ppo_math.ppo_per_token`` with ``jax.vjp``, so the derivative is the reference's branch for
  branch. On packed rows the coefficients and terms come per token ([B, T]: each token its
  segment's), which the kernel reads as it reads the tokens.
:class:`PPOLaunch` is the launch configuration of the token kernels for one [B, T] shape,
:func:`make_launch` the heuristic that picks it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl_kernels import sharding
from jaxrl_kernels.backends.pallas import common
from jaxrl_kernels.formulas import ppo_math

TILE_ELEMENTS = 2048
"""Tokens per [rows, T] tile: 8 per thread at 8 warps for each of up to 7 inputs."""

MIN_SUM_PROGRAMS = 264
"""The sum kernels split T until they have about this many programs (two per H100 SM)."""

_FIELDS = ppo_math.PPOInputs._fields
_SEQ_FIELDS = ppo_math.SequenceTerms._fields


class PPOLaunch(NamedTuple):
    """Launch configuration of the kernels for one [B, T] shape."""

    block_rows: int
    block_t: int
    t_tiles_per_program: int  # sum kernels: the T tiles one program adds
    num_warps: int


def make_launch(
    batch: int, seq_len: int, *, block_t: int | None = None, min_programs: int = MIN_SUM_PROGRAMS
) -> PPOLaunch:
    """The heuristic: a ``TILE_ELEMENTS`` tile as wide as T allows (≤ 1024); the sum
    kernels split T into ranges of whole tiles until there are ~``min_programs`` programs."""
    if block_t is None:
        block_t = min(pl.next_power_of_2(seq_len), 1024)
    block_rows = max(1, min(pl.next_power_of_2(batch), TILE_ELEMENTS // block_t))
    row_tiles, t_tiles = pl.cdiv(batch, block_rows), pl.cdiv(seq_len, block_t)
    splits = min(t_tiles, max(1, pl.cdiv(min_programs, row_tiles)))
    num_warps = max(1, min(8, block_rows * block_t // 256))
    return PPOLaunch(block_rows, block_t, pl.cdiv(t_tiles, splits), num_warps)


def _tile_index(i, j, plan: PPOLaunch, batch: int, seq_len: int):
    rows = i * plan.block_rows + jnp.arange(plan.block_rows, dtype=jnp.int32)
    cols = j * plan.block_t + jnp.arange(plan.block_t, dtype=jnp.int32)
    row_ok = rows < batch
    return rows, cols, row_ok, row_ok[:, None] & (cols < seq_len)[None, :]


def _load_tokens(refs, names, rows, cols, ok) -> ppo_math.PPOInputs:
    """A [rows, cols] tile of every token input (0 outside the arrays)."""
    tile = {}
    for name, ref in zip(names, refs):
        val = plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=ok, other=0)
        tile[name] = val.astype(jnp.float32)
    return ppo_math.PPOInputs(**tile)


def _load_per_sequence(ref, rows, cols, row_ok, ok):
    """A per-sequence input's values for a tile (0 outside the arrays): its [rows] entries, or,
    given per token ([B, T]: packed rows, each token its segment's), its [rows, cols] tile."""
    if len(ref.shape) == 2:
        return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=ok, other=0.0)
    return plgpu.load(ref.at[rows], mask=row_ok, other=0.0)


def _present(fields: dict, order) -> tuple[tuple[str, ...], tuple[jax.Array, ...]]:
    names = tuple(n for n in order if fields.get(n) is not None)
    return names, tuple(fields[n] for n in names)


# -- kind (a): [B, T] tokens -> per-sequence sums [B, K] ---------------------------------------


def _sum_keys(summands, names) -> tuple[str, ...]:
    """The keys ``summands(tokens)`` returns for these inputs, in order."""
    tokens = {n: jax.ShapeDtypeStruct((1, 1), jnp.float32) for n in names}
    return tuple(jax.eval_shape(lambda t: summands(ppo_math.PPOInputs(**t)), tokens))


def _row_sums_kernel(
    *refs, summands, keys, names, plan: PPOLaunch, batch: int, seq_len: int, width: int
):
    tok_refs, out_ref = refs[: len(names)], refs[len(names)]
    i, split = pl.program_id(0), pl.program_id(1)
    rows = _tile_index(i, 0, plan, batch, seq_len)[0]

    def tile(j, acc):
        _, cols, _, ok = _tile_index(i, split * plan.t_tiles_per_program + j, plan, batch, seq_len)
        x = _load_tokens(tok_refs, names, rows, cols, ok)
        values = summands(x)
        return {k: acc[k] + jnp.sum(x.mask * values[k].astype(jnp.float32), axis=1) for k in keys}

    zeros = jnp.zeros((plan.block_rows,), jnp.float32)
    acc = lax.fori_loop(0, plan.t_tiles_per_program, tile, {k: zeros for k in keys})
    slot = jnp.arange(width, dtype=jnp.int32)[None, :]
    out = jnp.zeros((plan.block_rows, width), jnp.float32)
    for idx, k in enumerate(keys):
        out = jnp.where(slot == idx, acc[k][:, None], out)
    out_ref[...] = out


def _row_sums(summands, name: str, tokens: dict, plan: PPOLaunch) -> dict:
    """{key: [B]} masked per-sequence sums Σ_t m·v of ``summands(tokens)``."""
    names, arrays = _present(tokens, _FIELDS)
    keys = _sum_keys(summands, names)
    batch, seq_len = arrays[0].shape
    row_tiles = pl.cdiv(batch, plan.block_rows)
    splits = pl.cdiv(pl.cdiv(seq_len, plan.block_t), plan.t_tiles_per_program)
    width = pl.next_power_of_2(len(keys))
    kernel = functools.partial(
        _row_sums_kernel,
        summands=summands,
        keys=keys,
        names=names,
        plan=plan,
        batch=batch,
        seq_len=seq_len,
        width=width,
    )
    partials = pl.pallas_call(
        kernel,
        grid=(row_tiles, splits),
        in_specs=[pl.BlockSpec()] * len(arrays),
        out_specs=pl.BlockSpec((None, plan.block_rows, width), lambda i, s: (s, i, 0)),
        out_shape=jax.ShapeDtypeStruct((splits, row_tiles * plan.block_rows, width), jnp.float32),
        compiler_params=common.compiler_params(plan.num_warps, 2),
        interpret=common.interpret(),
        name=name,
    )(*arrays)
    total = partials[0]
    for s in range(1, splits):  # split order: bitwise reproducible
        total = total + partials[s]
    return {k: total[:batch, idx] for idx, k in enumerate(keys)}


def _token_summands_kernel(*refs, summands, keys, names, plan: PPOLaunch, batch: int, seq_len: int):
    tok_refs, out_refs = refs[: len(names)], refs[len(names) :]
    rows, cols, _, ok = _tile_index(pl.program_id(0), pl.program_id(1), plan, batch, seq_len)
    x = _load_tokens(tok_refs, names, rows, cols, ok)
    values = summands(x)
    for k, out_ref in zip(keys, out_refs):
        val = x.mask * values[k].astype(jnp.float32)
        plgpu.store(out_ref.at[rows[:, None], cols[None, :]], val, mask=ok)


def _token_summands(summands, tokens: dict, plan: PPOLaunch) -> dict:
    """{key: [B, T]} masked per-token summands m·v of ``summands(tokens)``."""
    names, arrays = _present(tokens, _FIELDS)
    keys = _sum_keys(summands, names)
    batch, seq_len = arrays[0].shape
    kernel = functools.partial(
        _token_summands_kernel,
        summands=summands,
        keys=keys,
        names=names,
        plan=plan,
        batch=batch,
        seq_len=seq_len,
    )
    any_spec = pl.BlockSpec()
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(batch, plan.block_rows), pl.cdiv(seq_len, plan.block_t)),
        in_specs=[any_spec] * len(arrays),
        out_specs=[any_spec] * len(keys),
        out_shape=[jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)] * len(keys),
        compiler_params=common.compiler_params(plan.num_warps, 1),
        interpret=common.interpret(),
        name="ppo_loss_fwd_tokens",
    )(*arrays)
    return dict(zip(keys, out))


def token_summands(tokens: dict, cfg: ppo_math.PPOConfig, plan: PPOLaunch | None) -> dict:
    """The packed forward's stage 1: {key: [B, T]} masked summands m·v of
    ``ppo_math.forward_summands``, per token and sharded like the tokens (``sharding.run``;
    the per-segment sums that follow are ``segment_math``'s). ``plan=None``: the heuristic,
    per device (its T splits are unused: one program per tile)."""
    names, arrays = _present(tokens, _FIELDS)
    summands = functools.partial(ppo_math.forward_summands, cfg=cfg)
    keys = _sum_keys(summands, names)

    def local(layout, *arrays):
        out = sharding.kernel_region(
            lambda *a: _token_summands(
                summands, dict(zip(names, a)), plan or make_launch(*a[0].shape)
            ),
            *arrays,
        )
        return tuple(out[k] for k in keys)

    out = sharding.run(local, arrays, ("rr",) * len(arrays), ("rr",) * len(keys))
    return dict(zip(keys, out))


def forward_sums(tokens: dict, cfg: ppo_math.PPOConfig, plan: PPOLaunch | None) -> dict:
    """Stage 1: {key: [B]} per-sequence sums of ``ppo_math.forward_summands``, where the tokens
    live (``sharding.run``): a device holding part of T adds its part, then the parts are
    summed over the mesh axes that split T. ``plan=None``: the heuristic, per device."""
    names, arrays = _present(tokens, _FIELDS)
    summands = functools.partial(ppo_math.forward_summands, cfg=cfg)
    keys = _sum_keys(summands, names)

    def local(layout, *arrays):
        sums = sharding.kernel_region(
            lambda *a: _row_sums(
                summands, "ppo_loss_fwd", dict(zip(names, a)), plan or make_launch(*a[0].shape)
            ),
            *arrays,
        )
        t_axes = layout.row_axes[1]
        return tuple(lax.psum(sums[k], t_axes) if t_axes else sums[k] for k in keys)

    sums = sharding.run(local, arrays, ("rr",) * len(arrays), ("r",) * len(keys))
    return dict(zip(keys, sums))


# -- kind (c): per-sequence coefficients -> per-token gradients ------------------------------


def _grads_kernel(*refs, names, seq_names, cfg, plan: PPOLaunch, batch: int, seq_len: int):
    tok_refs = refs[: len(names)]
    seq_refs = refs[len(names) : len(names) + len(seq_names)]
    coef_ref, dlogp_ref = refs[len(names) + len(seq_names) : len(names) + len(seq_names) + 2]
    dent_ref = refs[-1] if "entropy" in names else None
    rows, cols, row_ok, ok = _tile_index(pl.program_id(0), pl.program_id(1), plan, batch, seq_len)
    x = _load_tokens(tok_refs, names, rows, cols, ok)
    per_seq = lambda ref: _load_per_sequence(ref, rows, cols, row_ok, ok)
    # ppo_math takes [rows] terms (broadcast over the row) and [rows, cols] ones as they are
    seq = ppo_math.SequenceTerms(**{n: per_seq(r) for n, r in zip(seq_names, seq_refs)})
    coef = per_seq(coef_ref)
    if coef.ndim == 1:
        coef = coef[:, None]

    def per_token(logp, entropy):
        return ppo_math.ppo_per_token(x._replace(logp=logp, entropy=entropy), cfg, seq)[0]

    _, pull = jax.vjp(per_token, x.logp, x.entropy)
    d_logp, d_ent = pull(coef * x.mask)
    plgpu.store(dlogp_ref.at[rows[:, None], cols[None, :]], d_logp, mask=ok)
    if dent_ref is not None:
        plgpu.store(dent_ref.at[rows[:, None], cols[None, :]], d_ent, mask=ok)


def token_grads(
    tokens: dict, seq: ppo_math.SequenceTerms, coef, cfg: ppo_math.PPOConfig, plan: PPOLaunch | None
):
    """Stage 3: d loss / d logp [B, T] (and d / d entropy) for d loss / d per_token_bt =
    coef_b · m_bt, where the tokens live (``sharding.run``). ``coef`` and the terms of ``seq``
    are [B] (one sequence per row) or [B, T] (packed rows: each token its segment's)."""
    names, arrays = _present(tokens, _FIELDS)
    seq_names, seq_arrays = _present(seq._asdict(), _SEQ_FIELDS)

    def local(layout, *args):
        return tuple(
            sharding.kernel_region(
                lambda *a: _token_grads(
                    a[: len(names)], names, a[len(names) : -1], seq_names, a[-1], cfg, plan
                ),
                *args,
            )
        )

    grads_of = (names.index("logp"),) + ((names.index("entropy"),) if "entropy" in names else ())
    per_seq_roles = tuple("r" * a.ndim for a in seq_arrays + (coef,))
    return sharding.run(
        local,
        arrays + seq_arrays + (coef,),
        ("rr",) * len(arrays) + per_seq_roles,
        ("rr",) * len(grads_of),
        grads_of=grads_of,
    )


def _token_grads(arrays, names, seq_arrays, seq_names, coef, cfg, plan):
    batch, seq_len = arrays[0].shape
    plan = plan or make_launch(batch, seq_len)
    n_out = 1 + ("entropy" in names)
    kernel = functools.partial(
        _grads_kernel,
        names=names,
        seq_names=seq_names,
        cfg=cfg,
        plan=plan,
        batch=batch,
        seq_len=seq_len,
    )
    any_spec = pl.BlockSpec()
    return tuple(
        pl.pallas_call(
            kernel,
            grid=(pl.cdiv(batch, plan.block_rows), pl.cdiv(seq_len, plan.block_t)),
            in_specs=[any_spec] * (len(arrays) + len(seq_arrays) + 1),
            out_specs=[any_spec] * n_out,
            out_shape=[jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)] * n_out,
            compiler_params=common.compiler_params(plan.num_warps, 1),
            interpret=common.interpret(),
            name="ppo_loss_bwd",
        )(*arrays, *seq_arrays, coef)
    )
