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
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.sharding import _jax_internals, collectives
from jaxrl_kernels.sharding.placement import (
    Axes,
    Placement,
    axes_of_entry,
    grad_spec,
    padded,
    placement_from_specs,
    spec_entry,
)
from jaxrl_kernels.sharding.vma import cast_varying, varying_axes

try:
    from jax.experimental.custom_partitioning import custom_partitioning
except ImportError:  # pragma: no cover - every supported jax has it
    custom_partitioning = None


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
    return _reshard(x, mesh, P())


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
    differentiated.
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
        _note(record, plan)
        return _finishing(local_fn, roles, grads_of, None)(plan, *operands)
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None):
        plan = Placement(
            row_axes=((),) * n_rows,
            manual=True,
            how="inside shard_map: this device's arrays, no vocab_axis",
        )
        _note(record, plan)
        return _finishing(local_fn, roles, grads_of, None)(plan, *operands)
    mesh = _mesh_of(operands)
    if _is_explicit(mesh):
        return _run_shard_map(
            local_fn, operands, roles, out_roles, grads_of, mesh, differentiable, record
        )
    batched = any(_jax_internals.is_vmapped(x) for x in operands if x is not None)
    if differentiable or batched or custom_partitioning is None:
        plan = Placement.single(n_rows)
        if mesh is not None and not batched:
            plan = dataclasses.replace(plan, how="Auto mesh axes: partitioned by XLA (jnp)")
            if differentiable:
                operands = pin_grad_shardings(*operands)
        _note(record, plan)
        return _finishing(local_fn, roles, grads_of, None)(plan, *operands)
    _note(
        record,
        Placement(
            row_axes=((),) * n_rows,
            how="Auto mesh axes (or none): custom_partitioning plans at compile "
            "time; rows stay where they live, a vocabulary-sharded operand is "
            "used in place",
        ),
    )
    return _run_custom_partitioning(local_fn, operands, roles, out_roles, grads_of)


def keep_grad_sharding(x):
    """``x``, whose cotangent is placed as ``x`` is: under Auto mesh axes XLA's partitioner
    places the gradients of plain jnp as it sees fit (the D-split of an FSDP weight or of
    tensor-parallel hidden states may be dropped); a ``custom_partitioning`` identity on the
    cotangent, told at compile time where ``x`` lives, puts it there."""
    if (
        x is None
        or custom_partitioning is None
        or not x.ndim
        or not jnp.issubdtype(x.dtype, jnp.floating)
    ):
        return x

    @jax.custom_vjp
    def identity(x):
        return x

    def bwd(x, g):
        @custom_partitioning
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


def _note(record, plan: Placement) -> None:
    if record is not None:
        record(plan)


def _finishing(local_fn, roles, grads_of, wants):
    """``local_fn`` with its None outputs dropped and its cotangent outputs finished
    (:meth:`Placement.finish_cotangent`, towards ``wants[operand position]`` where given)."""

    def fn(plan, *operands):
        outs = [y for y in local_fn(plan, *operands) if y is not None]
        for i, j in enumerate(grads_of):
            if j is not None:
                outs[i] = collectives.finish_cotangent(
                    plan, outs[i], operands[j], roles[j], None if wants is None else wants[j]
                )
        return tuple(outs)

    return fn


def _present(operands, roles):
    keep = [i for i, x in enumerate(operands) if x is not None]
    return keep, [operands[i] for i in keep], [roles[i] for i in keep]


def _with_absent(local_fn, keep, n):
    """local_fn over the present operands only, None passed where an operand is absent."""

    def fn(plan, *present):
        full = [None] * n
        for i, x in zip(keep, present):
            full[i] = x
        return local_fn(plan, *full)

    return fn


def _reshard(x, mesh, spec: P):
    if padded(jax.typeof(x).sharding.spec, x.ndim) == padded(spec, x.ndim):
        return x
    target = NamedSharding(mesh, spec)
    return jax.reshard(x, target) if hasattr(jax, "reshard") else jax.sharding.reshard(x, target)


def _grad_wants(plan, roles, grads_of, specs) -> dict:
    """{operand position: the layout its cotangent leaves the per-device function in}."""
    return {j: grad_spec(plan, roles[j], specs[j]) for j in grads_of if j is not None}


def _run_shard_map(local_fn, operands, roles, out_roles, grads_of, mesh, differentiable, record):
    keep, present, present_roles = _present(operands, roles)
    specs = [None if x is None else jax.typeof(x).sharding.spec for x in operands]
    plan = placement_from_specs(
        [specs[i] for i in keep], present_roles, how="Explicit mesh axes: shard_map"
    )
    _note(record, plan)
    wants = _grad_wants(plan, roles, grads_of, specs)
    fn = _with_absent(_finishing(local_fn, roles, grads_of, wants), keep, len(operands))
    in_specs = [plan.spec(r) for r in present_roles]
    if differentiable:
        # jax differentiates the body: a dimension the plan keeps whole but the operand splits
        # over axes the work is split over enters split and is all-gathered inside, so that
        # the transpose of that all-gather, a reduce-scatter, sums the cotangent over those
        # axes and leaves it split like the operand. (Over other axes the gather happens
        # outside: the cotangent is the same on every device there, the gather's transpose a
        # slice.)
        entered = [
            _entry_spec(plan, r, specs[i]) if jnp.issubdtype(x.dtype, jnp.floating) else s
            for i, x, r, s in zip(keep, present, present_roles, in_specs)
        ]
        fn = _gathering(fn, in_specs, entered)
        in_specs = entered
    out_specs = tuple(plan.spec(r) if j is None else wants[j] for r, j in zip(out_roles, grads_of))
    present = [_reshard(x, mesh, s) for x, s in zip(present, in_specs)]
    mapped = jax.shard_map(
        functools.partial(fn, plan),
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        check_vma=differentiable,
    )
    outs = mapped(*present)
    # A cotangent whose operand splits a row dimension otherwise than the plan: moved here.
    return tuple(y if j is None else _reshard(y, mesh, specs[j]) for y, j in zip(outs, grads_of))


def _entry_spec(plan: Placement, roles: str, operand_spec) -> P:
    """``grad_spec`` where the extra splits are over axes the work is split over, else the
    plan's layout."""
    have = padded(plan.spec(roles), len(roles))
    want = padded(grad_spec(plan, roles, operand_spec), len(roles))
    return P(
        *(
            w if h is None and set(axes_of_entry(w)) <= plan.work_axes else h
            for h, w in zip(have, want)
        )
    )


def _gathering(fn, have, entered):
    """``fn`` on operands all-gathered from the ``entered`` layouts to the ``have`` ones."""

    def gathered(plan, *operands):
        full = []
        for x, h, e in zip(operands, have, entered):
            for dim, (hd, ed) in enumerate(zip(padded(h, x.ndim), padded(e, x.ndim))):
                if hd != ed:
                    x = lax.all_gather(x, spec_entry(axes_of_entry(ed)), axis=dim, tiled=True)
            full.append(x)
        return fn(plan, *full)

    return gathered


def _sharding_rule(
    roles: Sequence[str], out_roles: Sequence[str], grads_of: Sequence[int | None]
) -> tuple[str, dict]:
    """The Shardy rule: row dims and the vocabulary are shared factors, every other dimension a
    factor of its own that must be replicated, except that a cotangent shares every factor
    of its operand (it leaves sharded like the operand); factors no result carries are
    reductions."""
    names = iter(f"x{i}" for i in range(10_000))

    def factors(role: str) -> list[str]:
        out, row = [], 0
        for c in role:
            if c == "r":
                out.append(f"r{row}")
                row += 1
            elif c == "v":
                out.append("v")
            else:
                out.append(next(names))
        return out

    ins = [factors(r) for r in roles]
    outs = [factors(r) if j is None else ins[j] for r, j in zip(out_roles, grads_of)]
    in_set, out_set = {f for fs in ins for f in fs}, {f for fs in outs for f in fs}
    own = sorted(f for f in in_set | out_set if f.startswith("x"))
    rule = ", ".join(" ".join(fs) for fs in ins) + " -> " + ", ".join(" ".join(fs) for fs in outs)
    extra = {
        "reduction_factors": tuple(sorted(in_set - out_set - set(own))),
        "need_replication_factors": tuple(f for f in own if f in in_set - out_set),
    }
    return rule, {k: v for k, v in extra.items() if v}


def _run_custom_partitioning(local_fn, operands, roles, out_roles, grads_of):
    keep, present, present_roles = _present(operands, roles)
    n_rows = max(r.count("r") for r in present_roles)
    position = {i: k for k, i in enumerate(keep)}

    @custom_partitioning
    def call(*args):
        fn = _with_absent(_finishing(local_fn, roles, grads_of, None), keep, len(operands))
        return fn(Placement.single(n_rows), *args)

    def partition(mesh, arg_shapes, result_shape):
        specs = [None] * len(operands)
        for i, a in zip(keep, arg_shapes):
            specs[i] = getattr(a.sharding, "spec", None)
        plan = placement_from_specs(
            [specs[i] for i in keep], present_roles, how="Auto mesh axes: custom_partitioning"
        )
        wants = _grad_wants(plan, roles, grads_of, specs)
        fn = _with_absent(_finishing(local_fn, roles, grads_of, wants), keep, len(operands))
        arg_shardings = tuple(NamedSharding(mesh, plan.spec(r)) for r in present_roles)
        out_shardings = tuple(
            NamedSharding(mesh, plan.spec(r) if j is None else wants[j])
            for r, j in zip(out_roles, grads_of)
        )
        return mesh, functools.partial(fn, plan), out_shardings, arg_shardings

    rule, factor_kinds = _sharding_rule(
        present_roles, out_roles, [None if j is None else position[j] for j in grads_of]
    )
    call.def_partition(partition, sharding_rule=rule, **factor_kinds)
    return call(*present)
