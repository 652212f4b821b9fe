"""Running an op where its data lives: rows stay on their devices, the vocabulary is used in place.

Every op describes each dimension of each operand by a *role*, one character per dimension:

* ``r`` a row dimension (tokens, sequences). Rows sharded over mesh axes are computed on the
  devices that hold them; row dimension *i* of every operand is the same dimension.
* ``v`` the vocabulary. A vocabulary sharded over mesh axes is used in place
  (vocabulary-parallel): each device works on its slice ``[i·V_local, (i+1)·V_local)`` and only
  per-row statistics cross devices (see ``softmax_math.combine_vocab_shards``).
* ``-`` anything else (the hidden size D, a metric axis): gathered if it is sharded, as XLA
  gathers an FSDP weight.

From the operands' shardings a :class:`Placement` says which mesh axes split each row dimension and
which split the vocabulary. The per-shard function ``local_fn(plan, *operands)`` is the same
everywhere; :func:`run` only chooses how to enter it:

* inside a user's ``jax.shard_map`` -- called directly on that device's arrays
  (``plan.manual``), with collectives over ``vocab_axis=`` where it is given;
* operands typed with ``Explicit`` mesh axes -- ``jax.shard_map`` over the planned specs;
* otherwise (``Auto`` axes under ``jax.jit``, or no mesh) --
  ``jax.experimental.custom_partitioning``: XLA's partitioner hands the actual shardings to
  :func:`_partition`, which plans and runs ``local_fn`` per device; on one device the call is
  lowered inline.

Cotangents (``run(..., grads_of=...)``): an operand that a device used whole while the work
was split over other mesh axes (a replicated weight under batch-sharded rows, the hidden states
under a vocabulary-sharded weight) receives the sum of the per-device cotangents, and every
cotangent comes back sharded exactly like its operand (:meth:`Placement.finish_cotangent`). A ``-``
dimension the operand shards (an FSDP weight's D, hidden states' D over a tensor-parallel axis)
was gathered for the work; its cotangent is reduce-scattered back over those axes where they are
among the axes summed over (``psum_scatter``), else sliced (each device holds it whole).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.sharding import _jax_internals, partitioned
from jaxrl_kernels.sharding.placement import (
    Axes,
    Placement,
    axes_of_entry,
)
from jaxrl_kernels.sharding.vma import cast_varying, varying_axes


def _untyped(x):
    """``x`` as a value that varies over no manual axis, for a kernel traced with the check
    off (a binary op gets no varying axes there). The Pallas interpreter evaluates a kernel on
    its operands' types when the program is lowered; operands typed as varying trip its loops
    and its mixing of them with constants."""
    if not varying_axes(x):
        return x
    return jnp.logical_and(x, True) if x.dtype == jnp.bool_ else x * jnp.ones((), x.dtype)


def kernel_region(fn: Callable[..., Any], *operands) -> Any:
    """Call a Pallas / FFI kernel wrapper inside a ``shard_map`` that checks varying axes.

    Kernels declare their outputs without vma types, so they are traced with the check off, on
    operands that vary over no axis, and their outputs are marked as varying over every manual
    axis an operand varies over (a kernel's output depends on all of its inputs)."""
    leaves = [
        x
        for x in jax.tree.leaves(operands)
        if isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)
    ]
    axes = frozenset().union(*(varying_axes(x) for x in leaves)) if leaves else frozenset()
    if not getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None):
        return fn(*operands)
    with _jax_internals.vma_check_off():
        operands = jax.tree.map(
            lambda x: _untyped(x) if isinstance(x, (jax.Array, jax.core.Tracer)) else x, operands
        )
        out = fn(*operands)
    return jax.tree.map(lambda y: None if y is None else cast_varying(y, axes), out)


# -- where are we? --------------------------------------------------------------------------


def _mesh_of(operands) -> Any:
    """The (abstract) mesh the operands' types name, else the one in context, else None."""
    for x in operands:
        if x is None:
            continue
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _is_explicit(mesh) -> bool:
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    return (
        mesh is not None
        and explicit is not None
        and any(t == explicit for t in getattr(mesh, "axis_types", ()))
    )


def replicated(x):
    """``x`` replicated on every device of an Explicit mesh (a no-op otherwise): for small
    per-sequence inputs (rewards [B]) whose computation crosses any row split."""
    mesh = _mesh_of([x])
    if not _is_explicit(mesh) or all(e is None for e in jax.typeof(x).sharding.spec):
        return x
    return partitioned.reshard(x, mesh, P())


def check_vocab_axis(vocab_axis, what: str = "vocab_axis") -> Axes:
    """Validate a ``vocab_axis`` argument: a mesh axis name (or tuple of names) of the
    ``jax.shard_map`` we are inside."""
    axes = axes_of_entry(vocab_axis)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(
            f"{what}: expected a mesh axis name (str) or a tuple of them, got {vocab_axis!r}"
        )
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()) or ())
    if mesh.empty or not manual:
        raise ValueError(
            f"{what}={vocab_axis!r} is only valid inside jax.shard_map, where it "
            "names the mesh axis that splits the vocabulary; outside shard_map "
            "pass sharded arrays to jax.jit instead"
        )
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{what}={vocab_axis!r}: {missing[0]!r} is not an axis of the mesh "
            f"here (axes: {', '.join(mesh.axis_names)})"
        )
    not_manual = [a for a in axes if a not in manual]
    if not_manual:
        raise ValueError(
            f"{what}={vocab_axis!r}: axis {not_manual[0]!r} is not a manual axis "
            "of the enclosing shard_map"
        )
    return axes


# -- entering the per-shard function ----------------------------------------------------------


def global_vocab(local_vocab: int, vocab_axis) -> int:
    """The vocabulary size across a ``vocab_axis`` split (checks the axis)."""
    if vocab_axis is None:
        return local_vocab
    axes = check_vocab_axis(vocab_axis)
    return local_vocab * math.prod(jax.lax.axis_size(a) for a in axes)


def run(
    local_fn: Callable[..., tuple],
    operands: Sequence[Any],
    roles: Sequence[str],
    out_roles: Sequence[str],
    *,
    grads_of: Sequence[int | None] | None = None,
    vocab_axis=None,
    differentiable: bool = False,
    record: Callable[[Placement], None] | None = None,
    pieces: int = 1,
) -> tuple:
    """``local_fn(plan, *operands)`` run where the operands live (see the module docstring).

    ``operands`` may hold None (an absent bias): its role is ignored and ``local_fn`` gets None;
    None outputs of ``local_fn`` are dropped (``out_roles`` lists the others).
    ``grads_of``: for each output, the position of the operand whose cotangent it is, or None.
    ``local_fn`` returns this device's share of such a cotangent, laid out as the plan lays out
    the operand (``plan.spec(roles)``); ``run`` sums the shares and returns the cotangent
    sharded exactly like the operand (:meth:`Placement.finish_cotangent`), as ``custom_vjp`` needs.
    ``differentiable``: ``local_fn`` is plain jnp that jax differentiates itself (the reference
    backend): under Auto axes it is left to XLA's partitioner, and under Explicit axes its
    shard_map checks varying axes so that jax's autodiff sums cotangents right. Otherwise
    ``local_fn`` is one half (forward or backward) of a ``custom_vjp`` and is never
    differentiated. ``pieces``: a backward step run in that many vocabulary pieces where a
    vocabulary operand's cotangent is summed across devices (:mod:`.vocab_pieces`).
    """
    n_rows = max(r.count("r") for r in roles)
    grads_of = tuple(grads_of) if grads_of is not None else (None,) * len(out_roles)
    if vocab_axis is not None:
        axes = check_vocab_axis(vocab_axis)
        plan = Placement(
            row_axes=((),) * n_rows,
            vocab_axes=axes,
            manual=True,
            how=f"inside shard_map, vocab_axis={vocab_axis!r}",
        )
        partitioned.note(record, plan)
        return partitioned.finishing(local_fn, roles, grads_of, None, pieces)(plan, *operands)
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None):
        plan = Placement(
            row_axes=((),) * n_rows,
            manual=True,
            how="inside shard_map: this device's arrays, no vocab_axis",
        )
        partitioned.note(record, plan)
        return partitioned.finishing(local_fn, roles, grads_of, None, pieces)(plan, *operands)
    mesh = _mesh_of(operands)
    if _is_explicit(mesh):
        return partitioned.run_shard_map(
            local_fn, operands, roles, out_roles, grads_of, mesh, differentiable, record, pieces
        )
    batched = any(_jax_internals.is_vmapped(x) for x in operands if x is not None)
    if differentiable or batched or partitioned.custom_partitioning is None:
        plan = Placement.single(n_rows)
        if mesh is not None and not batched:
            plan = dataclasses.replace(plan, how="Auto mesh axes: partitioned by XLA (jnp)")
            if differentiable:
                operands = pin_grad_shardings(*operands)
        partitioned.note(record, plan)
        return partitioned.finishing(local_fn, roles, grads_of, None, pieces)(plan, *operands)
    partitioned.note(
        record,
        Placement(
            row_axes=((),) * n_rows,
            how="Auto mesh axes (or none): custom_partitioning plans at compile "
            "time; rows stay where they live, a vocabulary-sharded operand is "
            "used in place",
        ),
    )
    return partitioned.run_custom_partitioning(
        local_fn, operands, roles, out_roles, grads_of, pieces
    )


def keep_grad_sharding(x):
    """``x``, whose cotangent is placed as ``x`` is: under Auto mesh axes XLA's partitioner
    places the gradients of plain jnp as it sees fit (the D-split of an FSDP weight or of
    tensor-parallel hidden states may be dropped); a ``custom_partitioning`` identity on the
    cotangent, told at compile time where ``x`` lives, puts it there."""
    if (
        x is None
        or partitioned.custom_partitioning is None
        or not x.ndim
        or not jnp.issubdtype(x.dtype, jnp.floating)
    ):
        return x

    @jax.custom_vjp
    def identity(x):
        return x

    def bwd(x, g):
        @partitioned.custom_partitioning
        def placed(g, like):
            return g

        def partition(mesh, arg_shapes, result_shape):
            where = arg_shapes[1].sharding
            return mesh, lambda g, like: g, where, (where, where)

        ours, its = (" ".join(f"{c}{i}" for i in range(x.ndim)) for c in "gx")
        # the result shares its factors with x, not with g: x's sharding is what propagates
        placed.def_partition(partition, sharding_rule=f"{ours}, {its} -> {its}")
        return (placed(g, x),)

    identity.defvjp(lambda x: (x, x), bwd)
    return identity(x)


def pin_grad_shardings(*xs):
    """``xs`` with each cotangent placed as its operand is, under Auto mesh axes (a no-op
    under Explicit axes, where types carry shardings, inside ``shard_map``, under ``vmap``
    and with no mesh). For ops written in plain jnp that do not go through :func:`run`."""
    mesh = _mesh_of(xs)
    if (
        mesh is None
        or _is_explicit(mesh)
        or getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None)
        or any(_jax_internals.is_vmapped(x) for x in xs if x is not None)
    ):
        return xs
    return tuple(keep_grad_sharding(x) for x in xs)
