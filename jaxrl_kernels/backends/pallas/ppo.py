"""Pallas kernels for the PPO loss over [B, T] and for group-normalised advantages.

``ppo_loss`` forward: each program walks a contiguous run of sequences in
[rows, T] tiles, evaluates ``rl_math.ppo_per_token`` on every tile and keeps,
per sequence, the masked sums Σ_t m·loss and Σ_t m; per program it reduces

    sum = Σ m·loss,  count = Σ m,
    seq_sum = Σ_b [Σ_t m·loss / Σ_t m]   (over sequences with a valid token),
    seq_count = #sequences with a valid token,
    Σ m·part  for every metric part (ratio, clipped, approx_kl, ...),

and writes those few floats. The programs' rows are then added in program
order (deterministic, no atomics) and turned into the loss of the chosen
aggregation (``rl_math.aggregate``'s four modes) and the masked-mean metrics.
The per-sequence token counts are kept for the backward.

``ppo_loss`` backward: one program per [rows, T] tile computes the weight each
token has in the aggregation (``m / max(count, 1)``, ``m / (count_b ·
max(seq_count, 1))``, ``m / B`` or ``m / (B · max_len)``) and pulls the scalar
cotangent times that weight back through ``rl_math.ppo_per_token`` with
``jax.vjp`` (so the derivative is the reference's, branch for branch), writing
d logp and d entropy once. Nothing flows to old/rollout/ref log-probs,
advantages or the mask.

``group_advantages``: one program per group scans the rewards for its members
(count, mean, then the centred sum of squares) and writes
``(r - mean) / (std + eps)`` (or ``r - mean``) to them, 0 for a group of one.
Its gradient (rarely wanted) is the reference's, from ``jax.vjp`` of
``rl_math.group_advantages`` on the [B] rewards.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl_kernels import rl_math, sharding
from jaxrl_kernels.backends.pallas import common

TILE_ELEMENTS = 2048
"""Tokens per [rows, T] tile: 8 per thread at 8 warps for each of up to 7 inputs."""

MAX_FORWARD_PROGRAMS = 256
"""The forward's programs (about two per H100 SM); each adds whole sequences."""

_FIELDS = rl_math.PPOInputs._fields
_TOTALS = ("sum", "count", "seq_sum", "seq_count")
_VEC = 16  # partial sums per program, padded to a power of two


class Plan(NamedTuple):
    block_rows: int
    block_t: int
    chunks_per_program: int  # forward: row tiles per program
    num_warps: int


def make_plan(batch: int, seq_len: int, *, block_t: int | None = None,
              max_programs: int = MAX_FORWARD_PROGRAMS) -> Plan:
    """The heuristic: a ``TILE_ELEMENTS`` tile as wide as T allows (≤ 1024), and
    the row tiles spread over at most ``max_programs`` forward programs."""
    if block_t is None:
        block_t = min(pl.next_power_of_2(seq_len), 1024)
    block_rows = max(1, min(pl.next_power_of_2(batch), TILE_ELEMENTS // block_t))
    chunks = pl.cdiv(batch, block_rows)
    num_warps = max(1, min(8, block_rows * block_t // 256))
    return Plan(block_rows, block_t, pl.cdiv(chunks, max_programs), num_warps)


def declines(primitive: str, problem) -> str | None:
    return None


def _part_names(names, cfg) -> tuple[str, ...]:
    """The metric parts ``rl_math.ppo_per_token`` returns for these inputs, in order."""
    dummy = {n: jax.ShapeDtypeStruct((1, 1), jnp.float32) for n in names}
    shapes = jax.eval_shape(
        lambda d: rl_math.ppo_per_token(rl_math.PPOInputs(**d), cfg)[1], dummy)
    return tuple(shapes)


def _load_tile(refs, names, rows, cols, ok):
    tile = {}
    for name, ref in zip(names, refs):
        val = plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=ok, other=0)
        tile[name] = val.astype(jnp.float32)
    return rl_math.PPOInputs(**tile)


def _tile_index(i, j, plan: Plan, batch: int, seq_len: int):
    rows = i * plan.block_rows + jnp.arange(plan.block_rows, dtype=jnp.int32)
    cols = j * plan.block_t + jnp.arange(plan.block_t, dtype=jnp.int32)
    row_ok = rows < batch
    return rows, cols, row_ok, row_ok[:, None] & (cols < seq_len)[None, :]


# -- ppo_loss forward -------------------------------------------------------------------------

def _forward_kernel(*refs, names, parts, cfg, plan: Plan, batch: int, seq_len: int):
    in_refs = refs[:len(names)]
    partial_ref, counts_ref = refs[len(names):]
    keys = _TOTALS + parts
    n_t = pl.cdiv(seq_len, plan.block_t)
    zeros_rows = jnp.zeros((plan.block_rows,), jnp.float32)
    first_chunk = pl.program_id(0) * plan.chunks_per_program  # (read outside the loops)

    def chunk(c, acc):
        i = first_chunk + c

        def tile(j, row_acc):
            rows, cols, _, ok = _tile_index(i, j, plan, batch, seq_len)
            x = _load_tile(in_refs, names, rows, cols, ok)
            per_token, vals = rl_math.ppo_per_token(x, cfg)
            m = x.mask
            out = {"sum": row_acc["sum"] + jnp.sum(m * per_token, axis=1),
                   "count": row_acc["count"] + jnp.sum(m, axis=1)}
            for k in parts:
                out[k] = row_acc[k] + jnp.sum(m * vals[k].astype(jnp.float32), axis=1)
            return out

        init = {k: zeros_rows for k in ("sum", "count") + parts}
        row_acc = lax.fori_loop(0, n_t, tile, init)
        rows, _, row_ok, _ = _tile_index(i, 0, plan, batch, seq_len)
        plgpu.store(counts_ref.at[rows], row_acc["count"], mask=row_ok)
        has = row_acc["count"] > 0
        per_seq = jnp.where(has, row_acc["sum"] / jnp.where(has, row_acc["count"], 1.0), 0.0)
        new = {"seq_sum": acc["seq_sum"] + jnp.sum(per_seq),
               "seq_count": acc["seq_count"] + jnp.sum(has.astype(jnp.float32))}
        for k in ("sum", "count") + parts:
            new[k] = acc[k] + jnp.sum(row_acc[k])
        return new

    acc = lax.fori_loop(0, plan.chunks_per_program, chunk,
                        {k: jnp.float32(0.0) for k in keys})
    slot = jnp.arange(_VEC, dtype=jnp.int32)
    vec = jnp.zeros((_VEC,), jnp.float32)
    for idx, k in enumerate(keys):
        vec = jnp.where(slot == idx, acc[k], vec)
    partial_ref[...] = vec


def _finalize(totals: dict, cfg: rl_math.PPOConfig, batch: int, seq_len: int, parts):
    """Loss and metrics from the summed totals, as ``rl_math.ppo_loss`` defines them."""
    mode = rl_math.canonical_mode(cfg.loss_agg_mode)
    count = jnp.maximum(totals["count"], 1.0)
    if mode == "token_mean":
        loss = totals["sum"] / count
    elif mode == "seq_mean_token_mean":
        loss = totals["seq_sum"] / jnp.maximum(totals["seq_count"], 1.0)
    elif mode == "seq_mean_token_sum":
        loss = totals["sum"] / batch
    else:
        length = seq_len if cfg.max_len is None else cfg.max_len
        loss = totals["sum"] / (batch * length)
    metrics = {rl_math.METRIC_NAMES[k]: totals[k] / count for k in parts}
    return loss, metrics


def _forward(arrays, names, cfg, plan: Plan):
    batch, seq_len = arrays[0].shape
    parts = _part_names(names, cfg)
    n_programs = pl.cdiv(pl.cdiv(batch, plan.block_rows), plan.chunks_per_program)
    kernel = functools.partial(_forward_kernel, names=names, parts=parts, cfg=cfg, plan=plan,
                               batch=batch, seq_len=seq_len)
    partials, counts = pl.pallas_call(
        kernel,
        grid=(n_programs,),
        in_specs=[pl.BlockSpec()] * len(arrays),
        out_specs=[pl.BlockSpec((None, _VEC), lambda g: (g, 0)), pl.BlockSpec()],
        out_shape=[jax.ShapeDtypeStruct((n_programs, _VEC), jnp.float32),
                   jax.ShapeDtypeStruct((batch,), jnp.float32)],
        compiler_params=common.compiler_params(plan.num_warps, 2),
        interpret=common.interpret(),
        name="ppo_loss_fwd",
    )(*arrays)
    summed = partials[0]
    for g in range(1, n_programs):  # program order: bitwise reproducible
        summed = summed + partials[g]
    totals = {k: summed[idx] for idx, k in enumerate(_TOTALS + parts)}
    loss, metrics = _finalize(totals, cfg, batch, seq_len, parts)
    return loss, metrics, (totals["count"], totals["seq_count"], counts)


# -- ppo_loss backward ------------------------------------------------------------------------

def _token_weight(m, row_count, count, seq_count, cfg, batch: int, seq_len: int):
    """∂ aggregate / ∂ per_token for each token of a tile."""
    mode = rl_math.canonical_mode(cfg.loss_agg_mode)
    if mode == "token_mean":
        return m / jnp.maximum(count, 1.0)
    if mode == "seq_mean_token_mean":
        has = row_count > 0
        per_row = jnp.where(has, 1.0 / jnp.where(has, row_count, 1.0), 0.0)
        return m * per_row[:, None] / jnp.maximum(seq_count, 1.0)
    if mode == "seq_mean_token_sum":
        return m / batch
    length = seq_len if cfg.max_len is None else cfg.max_len
    return m / (batch * length)


def _backward_kernel(*refs, names, cfg, plan: Plan, batch: int, seq_len: int):
    in_refs = refs[:len(names)]
    scalars_ref, counts_ref, dlogp_ref = refs[len(names):len(names) + 3]
    dent_ref = refs[len(names) + 3] if "entropy" in names else None
    rows, cols, row_ok, ok = _tile_index(pl.program_id(0), pl.program_id(1), plan, batch, seq_len)
    x = _load_tile(in_refs, names, rows, cols, ok)
    row_count = plgpu.load(counts_ref.at[rows], mask=row_ok, other=0.0)
    coef = scalars_ref[0] * _token_weight(x.mask, row_count, scalars_ref[1], scalars_ref[2], cfg,
                                          batch, seq_len)

    def per_token(logp, entropy):
        return rl_math.ppo_per_token(x._replace(logp=logp, entropy=entropy), cfg)[0]

    _, pull = jax.vjp(per_token, x.logp, x.entropy)
    d_logp, d_ent = pull(coef)
    plgpu.store(dlogp_ref.at[rows[:, None], cols[None, :]], d_logp, mask=ok)
    if dent_ref is not None:
        plgpu.store(dent_ref.at[rows[:, None], cols[None, :]], d_ent, mask=ok)


def _backward(arrays, names, cfg, plan: Plan, residuals, g_loss):
    batch, seq_len = arrays[0].shape
    count, seq_count, counts = residuals
    scalars = jnp.stack([jnp.asarray(g_loss, jnp.float32), count, seq_count,
                         jnp.float32(0.0)])
    n_out = 1 + ("entropy" in names)
    kernel = functools.partial(_backward_kernel, names=names, cfg=cfg, plan=plan, batch=batch,
                               seq_len=seq_len)
    any_spec = pl.BlockSpec()
    grads = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(batch, plan.block_rows), pl.cdiv(seq_len, plan.block_t)),
        in_specs=[any_spec] * (len(arrays) + 2),
        out_specs=[any_spec] * n_out,
        out_shape=[jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)] * n_out,
        compiler_params=common.compiler_params(plan.num_warps, 1),
        interpret=common.interpret(),
        name="ppo_loss_bwd",
    )(*arrays, scalars, counts)
    return grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _ppo_loss(arrays, names, cfg, plan):
    loss, metrics, _ = _forward(arrays, names, cfg, plan)
    return loss, metrics


def _ppo_loss_fwd(arrays, names, cfg, plan):
    loss, metrics, residuals = _forward(arrays, names, cfg, plan)
    return (loss, metrics), (arrays, residuals)


def _ppo_loss_bwd(names, cfg, plan, res, cot):
    arrays, residuals = res
    grads = iter(_backward(arrays, names, cfg, plan, residuals, cot[0]))
    out = []
    for name in names:
        out.append(next(grads) if name in ("logp", "entropy") else None)
    return (tuple(out),)


_ppo_loss.defvjp(_ppo_loss_fwd, _ppo_loss_bwd)


def ppo_loss(ppo_inputs: rl_math.PPOInputs, config: rl_math.PPOConfig, *, plan: Plan | None = None):
    """Primitive ``ppo_loss``: ``(loss, metrics)`` as ``rl_math.ppo_loss`` defines them."""
    fields = ppo_inputs._asdict()
    if config.tis_cap is None:
        fields["rollout_logp"] = None  # unused without a cap, as in rl_math
    names = tuple(n for n in _FIELDS if fields[n] is not None)
    arrays = tuple(jnp.asarray(fields[n], jnp.float32) for n in names)
    batch, seq_len = arrays[0].shape
    if batch * seq_len == 0:  # no token: no kernel to launch; rl_math defines the empty values
        return rl_math.ppo_loss(ppo_inputs, config)
    plan = plan or make_plan(batch, seq_len)
    loss, metrics = _ppo_loss(arrays, names, config, plan)
    return loss, {k: lax.stop_gradient(v) for k, v in metrics.items()}


# -- group_advantages -----------------------------------------------------------------------

GROUP_BLOCK = 1024
"""Rewards scanned per step by a group's program."""


def _group_kernel(rewards_ref, seg_ref, adv_ref, *, normalize_std: bool, std_ddof: int,
                  eps: float, block: int):
    n = rewards_ref.shape[0]
    group = pl.program_id(0)
    n_blocks = pl.cdiv(n, block)

    def members(j):
        idx = j * block + jnp.arange(block, dtype=jnp.int32)
        inside = idx < n
        seg = plgpu.load(seg_ref.at[idx], mask=inside, other=-1)
        r = plgpu.load(rewards_ref.at[idx], mask=inside, other=0.0).astype(jnp.float32)
        return idx, inside & (seg == group), r

    def count_sum(j, acc):
        _, mine, r = members(j)
        return acc[0] + jnp.sum(mine.astype(jnp.float32)), acc[1] + jnp.sum(jnp.where(mine, r, 0.0))

    count, total = lax.fori_loop(0, n_blocks, count_sum, (jnp.float32(0.0), jnp.float32(0.0)))
    mean = total / jnp.maximum(count, 1.0)
    scale = jnp.float32(1.0)
    if normalize_std:
        def sq_sum(j, acc):
            _, mine, r = members(j)
            c = r - mean
            return acc + jnp.sum(jnp.where(mine, c * c, 0.0))

        sq = lax.fori_loop(0, n_blocks, sq_sum, jnp.float32(0.0))
        var = sq / jnp.maximum(count - std_ddof, 1.0)
        scale = jnp.sqrt(var) + eps

    @pl.loop(0, n_blocks)
    def _(j):
        idx, mine, r = members(j)
        centred = r - mean
        if normalize_std:
            centred = centred / scale
        plgpu.store(adv_ref.at[idx], jnp.where(count > 1, centred, 0.0), mask=mine)


def _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    (n,) = rewards.shape
    block = min(pl.next_power_of_2(n), GROUP_BLOCK)
    kernel = functools.partial(_group_kernel, normalize_std=normalize_std, std_ddof=std_ddof,
                               eps=eps, block=block)
    any_spec = pl.BlockSpec()
    call = pl.pallas_call(
        kernel,
        grid=(num_groups,),
        in_specs=[any_spec, any_spec],
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
        compiler_params=common.compiler_params(max(1, min(4, block // 256)), 1),
        interpret=common.interpret(),
        name="group_advantages",
    )
    # Groups may straddle any split of B: every device runs the kernel on all [B] rewards.
    (adv,) = sharding.run(lambda plan, r, ids: (sharding.kernel_region(call, r, ids),),
                          (rewards, segment_ids), ("-", "-"), ("-",))
    return adv


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _group_advantages(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    return _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps)


def _group_fwd(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps):
    adv = _group_advantages_kernel(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps)
    return adv, (rewards, segment_ids)


def _group_bwd(num_groups, normalize_std, std_ddof, eps, res, g):
    rewards, segment_ids = res
    _, pull = jax.vjp(lambda r: rl_math.group_advantages(
        r, segment_ids, num_groups, normalize_std=normalize_std, std_ddof=std_ddof, eps=eps),
        rewards)
    return pull(g)[0], None


_group_advantages.defvjp(_group_fwd, _group_bwd)


def group_advantages(rewards, segment_ids, num_groups, *, normalize_std=True, std_ddof=0,
                     eps=1e-6):
    """Primitive ``group_advantages``: adv[B] (segment ids in ``[0, num_groups)``)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape[0] == 0 or num_groups == 0:
        return jnp.zeros(rewards.shape, jnp.float32)
    return _group_advantages(rewards, jnp.asarray(segment_ids, jnp.int32), int(num_groups),
                             bool(normalize_std), int(std_ddof), float(eps))


OPS = {"ppo_loss": ppo_loss, "group_advantages": group_advantages}
