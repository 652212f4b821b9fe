"""The Pallas kernel of ``group_advantages`` (the op: ``ppo.py``).

:func:`group_advantages_call`: one program per group scans the [B] rewards for its members
(count, mean, then the centred sum of squares) and writes ``(r - mean) / (std + eps)`` (or
``r - mean``) to them, 0 for a group of one. A program adds its members in index order: no
atomics, the same bits on every run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrl_kernels import sharding
from jaxrl_kernels.backends.pallas import common


def _group_kernel(
    rewards_ref, seg_ref, adv_ref, *, normalize_std: bool, std_ddof: int, eps: float, block: int
):
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


def group_advantages_call(rewards, segment_ids, num_groups, normalize_std, std_ddof, eps, block):
    """adv [N] of the rewards, scanned ``block`` at a time by each group's program."""
    (n,) = rewards.shape
    kernel = functools.partial(
        _group_kernel, normalize_std=normalize_std, std_ddof=std_ddof, eps=eps, block=block
    )
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
    (adv,) = sharding.run(
        lambda plan, r, ids: (sharding.kernel_region(call, r, ids),),
        (rewards, segment_ids),
        ("-", "-"),
        ("-",),
    )
    return adv
