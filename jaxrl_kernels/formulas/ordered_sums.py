"""Sums over segment ids in a fixed order: the same bits on every run, on GPUs too.

A scatter-add of every element into its segment's slot (``jax.ops.segment_sum``) adds in the
order a GPU's atomics happen to run, so a sum of several addends can differ in its last bits
from one run to the next (docs/api.md "Determinism"). :func:`run_sums` sorts each row by
segment id (stable), sums each run of equal ids by a segmented scan along the row (a fixed
tree of additions), and adds only each run's total into ``[S]``: with a segment in one row,
one addend per slot, so no order is left to chance. The gradient is the spread,
``∂Sum_s/∂x_bt = [g_bt = s]`` (a gather).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


def explicit(x) -> bool:
    """``x`` lives on a mesh with an ``Explicit`` axis (where scatters and gathers must name
    their output's sharding)."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    axis_type = getattr(jax.sharding.AxisType, "Explicit", None)
    return mesh is not None and not mesh.empty and axis_type in getattr(mesh, "axis_types", ())


def _replicated(x) -> dict:
    """The ``out_sharding`` that replicates a result on ``x``'s own mesh under Explicit axes (a
    bare P() needs a mesh context, which a user's jit of Explicit-sharded arrays need not
    have)."""
    return {"out_sharding": jax.typeof(x).sharding.update(spec=P())} if explicit(x) else {}


def per_device_run_sums(x, ids, count):
    """:func:`run_sums` under Explicit axes: each device sums its own ``[B, T]`` block (a
    sort needs an unsplit axis, and gathering the tokens would cost more than the ``[K, S]``
    sums), then one all-reduce adds the blocks' sums: a sequence split between devices (a
    ``T`` split) gets one addend per device, in the collective's fixed order."""
    tokens = jax.typeof(x).sharding
    spec = tuple(tokens.spec) + (None,) * (3 - len(tokens.spec))
    ids = jax.reshard(ids, tokens.update(spec=P(*spec[1:])))
    axes = tuple(
        name
        for entry in spec
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    )

    def local(x, ids):
        out = run_sums(x, ids, count)
        return lax.psum(out, axes) if axes else out

    return jax.shard_map(local, mesh=tokens.mesh, in_specs=(P(*spec), P(*spec[1:])), out_specs=P())(
        x, ids
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def run_sums(x, ids, count):
    """``[K, S]`` sums of ``x [K, B, T]`` per segment: rows sorted by id, a segmented scan
    per row, each run's total added once at its last position."""
    key = jnp.where(ids < 0, count, ids)  # no sequence: sorted last, dropped below
    order = jnp.argsort(key, axis=-1, stable=True)
    key = jnp.take_along_axis(key, order, axis=-1)
    x = jnp.take_along_axis(x, jnp.broadcast_to(order, x.shape), axis=-1)
    change = key[:, 1:] != key[:, :-1]
    edge = jnp.ones_like(key[:, :1], bool)
    starts = jnp.broadcast_to(jnp.concatenate([edge, change], axis=-1), x.shape)

    def combine(a, b):  # (run starts here, sum since the run's start)
        return a[0] | b[0], jnp.where(b[0], b[1], a[1] + b[1])

    _, running = lax.associative_scan(combine, (starts, x), axis=-1)
    last = jnp.concatenate([change, edge], axis=-1) & (key < count)
    out = jnp.zeros((x.shape[0], count), jnp.float32)
    return out.at[:, jnp.where(last, key, count)].add(running, mode="drop", **_replicated(x))


def _run_sums_fwd(x, ids, count):
    return run_sums(x, ids, count), (ids, x)


def _run_sums_bwd(count, res, g):
    ids, x = res
    slots = jnp.where(ids < 0, count, ids)
    options = {"out_sharding": jax.typeof(x).sharding} if explicit(x) else {}
    return g.at[:, slots].get(mode="fill", fill_value=0, **options), None


run_sums.defvjp(_run_sums_fwd, _run_sums_bwd)


def group_sums(values, ids, count: int):
    """``[K, G]`` sums of each ``[B]`` row of ``values [K, B]`` per id in ``ids [B]``
    (``[0, G)``), in a fixed order; the rows are taken whole on every device (a sort runs
    along an unsplit axis; ``[B]`` per-sequence values are small)."""
    values, ids = (
        jax.reshard(x, jax.typeof(x).sharding.update(spec=P())) if explicit(x) else x
        for x in (values, ids)
    )
    return run_sums(values[:, None, :], ids[None, :], count)
