"""The ways into a per-device function over a mesh: ``shard_map`` for Explicit mesh axes,
``custom_partitioning`` for Auto ones, and what both do around it (absent operands, the
cotangents summed back and laid out like their operands).

``entry.run`` chooses between them (and the direct call inside a user's ``shard_map``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_kernels.sharding import collectives, vocab_pieces
from jaxrl_kernels.sharding.placement import (
    Placement,
    axes_of_entry,
    grad_spec,
    padded,
    placement_from_specs,
    spec_entry,
)

try:
    from jax.experimental.custom_partitioning import custom_partitioning
except ImportError:  # pragma: no cover - every supported jax has it
    custom_partitioning = None


def note(record, plan: Placement) -> None:
    if record is not None:
        record(plan)


def finishing(local_fn, roles, grads_of, wants, pieces: int = 1):
    """``local_fn`` with its None outputs dropped and its cotangent outputs finished
    (:meth:`Placement.finish_cotangent`, towards ``wants[operand position]`` where given);
    ``pieces`` > 1: in vocabulary pieces where the plan sums a head's cotangent across
    devices (:mod:`.vocab_pieces`)."""

    def fn(plan, *operands):
        split = vocab_pieces.plan_pieces(plan, operands, roles, grads_of, wants, pieces)
        if split is not None:
            return vocab_pieces.run(local_fn, plan, operands, roles, grads_of, wants, split)
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


def reshard(x, mesh, spec: P):
    if padded(jax.typeof(x).sharding.spec, x.ndim) == padded(spec, x.ndim):
        return x
    target = NamedSharding(mesh, spec)
    return jax.reshard(x, target) if hasattr(jax, "reshard") else jax.sharding.reshard(x, target)


def _grad_wants(plan, roles, grads_of, specs) -> dict:
    """{operand position: the layout its cotangent leaves the per-device function in}."""
    return {j: grad_spec(plan, roles[j], specs[j]) for j in grads_of if j is not None}


def run_shard_map(
    local_fn, operands, roles, out_roles, grads_of, mesh, differentiable, record, pieces=1
):
    keep, present, present_roles = _present(operands, roles)
    specs = [None if x is None else jax.typeof(x).sharding.spec for x in operands]
    plan = placement_from_specs(
        [specs[i] for i in keep], present_roles, how="Explicit mesh axes: shard_map"
    )
    note(record, plan)
    wants = _grad_wants(plan, roles, grads_of, specs)
    fn = _with_absent(finishing(local_fn, roles, grads_of, wants, pieces), keep, len(operands))
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
    present = [reshard(x, mesh, s) for x, s in zip(present, in_specs)]
    mapped = jax.shard_map(
        functools.partial(fn, plan),
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=out_specs,
        check_vma=differentiable,
    )
    outs = mapped(*present)
    # A cotangent whose operand splits a row dimension otherwise than the plan: moved here.
    return tuple(y if j is None else reshard(y, mesh, specs[j]) for y, j in zip(outs, grads_of))


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


def run_custom_partitioning(local_fn, operands, roles, out_roles, grads_of, pieces=1):
    keep, present, present_roles = _present(operands, roles)
    n_rows = max(r.count("r") for r in present_roles)
    position = {i: k for k, i in enumerate(keep)}

    @custom_partitioning
    def call(*args):
        fn = _with_absent(finishing(local_fn, roles, grads_of, None), keep, len(operands))
        return fn(Placement.single(n_rows), *args)

    def partition(mesh, arg_shapes, result_shape):
        specs = [None] * len(operands)
        for i, a in zip(keep, arg_shapes):
            specs[i] = getattr(a.sharding, "spec", None)
        plan = placement_from_specs(
            [specs[i] for i in keep], present_roles, how="Auto mesh axes: custom_partitioning"
        )
        wants = _grad_wants(plan, roles, grads_of, specs)
        fn = _with_absent(finishing(local_fn, roles, grads_of, wants, pieces), keep, len(operands))
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
