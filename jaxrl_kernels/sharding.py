"""Running an op where its data lives: rows stay on their devices, the vocabulary is used in place.

Every op describes each dimension of each operand by a *role*, one character per dimension:

* ``r`` a row dimension (tokens, sequences). Rows sharded over mesh axes are computed on the
  devices that hold them; row dimension *i* of every operand is the same dimension.
* ``v`` the vocabulary. A vocabulary sharded over mesh axes is used in place
  (vocabulary-parallel): each device works on its slice ``[i·V_local, (i+1)·V_local)`` and only
  per-row statistics cross devices (see ``rl_math.combine_vocab_shards``).
* ``-`` anything else (the hidden size D, a metric axis): gathered if it is sharded, as XLA
  gathers an FSDP weight.

From the operands' shardings a :class:`Plan` says which mesh axes split each row dimension and
which split the vocabulary. The per-shard function ``local_fn(plan, *operands)`` is the same
everywhere; :func:`run` only chooses how to enter it:

* inside a user's ``jax.shard_map`` -- called directly on that device's arrays
  (``plan.manual``), with collectives over ``vocab_axis=`` where it is given;
* operands typed with ``Explicit`` mesh axes -- ``jax.shard_map`` over the planned specs;
* otherwise (``Auto`` axes under ``jax.jit``, or no mesh) --
  ``jax.experimental.custom_partitioning``: XLA's partitioner hands the actual shardings to
  :func:`_partition`, which plans and runs ``local_fn`` per device; on one device the call is
  lowered inline.

Cotangents: an operand that a device used whole while the work was split over other mesh axes
(a replicated weight under batch-sharded rows, the hidden states under a vocabulary-sharded
weight) receives the sum of the per-device cotangents: :meth:`Plan.reduce_cotangent`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

try:
    from jax.experimental.custom_partitioning import custom_partitioning
except ImportError:  # pragma: no cover - every supported jax has it
    custom_partitioning = None

try:  # the tracer type of jax.vmap; custom_partitioning has no batching rule
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover
    _BatchTracer = ()

Axes = tuple[str, ...]


def _axes(entry) -> Axes:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: Axes):
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which mesh axes split the rows (per row dimension) and the vocabulary of one call."""

    row_axes: tuple[Axes, ...]
    vocab_axes: Axes = ()
    manual: bool = False  # inside a user's shard_map: cotangent sums follow the vma types
    how: str = "one device"

    @staticmethod
    def single(n_row_dims: int) -> "Plan":
        return Plan(row_axes=((),) * n_row_dims)

    @property
    def work_axes(self) -> frozenset[str]:
        """Every mesh axis the work is split over."""
        return frozenset(a for axes in self.row_axes for a in axes) | frozenset(self.vocab_axes)

    def spec(self, roles: str) -> P:
        """The PartitionSpec of an operand with these roles under this plan."""
        entries, row = [], 0
        for role in roles:
            if role == "r":
                entries.append(_entry(self.row_axes[row]))
                row += 1
            elif role == "v":
                entries.append(_entry(self.vocab_axes))
            else:
                entries.append(None)
        return P(*entries)

    def axes_of(self, roles: str) -> frozenset[str]:
        return frozenset(a for e in self.spec(roles) for a in _axes(e))

    def vocab_offset(self, local_vocab: int):
        """First global vocabulary id of this device's slice."""
        if not self.vocab_axes:
            return jnp.int32(0)
        return lax.axis_index(self.vocab_axes).astype(jnp.int32) * local_vocab

    def output_cotangent(self, g, vocab_operand):
        """The cotangent of an output that is replicated over the vocabulary axes.

        In a user's ``shard_map(check_vma=False)`` jax hands each device a share of it (the
        shares sum to the cotangent, as for the transpose of a psum); with varying-axes types
        (``check_vma=True``, or any plan of ours) it arrives whole."""
        if (g is None or not self.manual or not self.vocab_axes
                or frozenset(self.vocab_axes) <= varying_axes(vocab_operand)):
            return g
        return lax.psum(g, self.vocab_axes)

    def reduce_cotangent(self, d_operand, operand, roles: str):
        """Sum a per-device cotangent over the axes the work was split over but the operand is
        not: a replicated operand's gradient is the sum of every device's share."""
        if d_operand is None:
            return None
        if self.manual:
            axes = varying_axes(d_operand) - varying_axes(operand)
            if not has_vma(d_operand) and "v" not in roles:
                axes = frozenset(self.vocab_axes)  # check_vma=False: only what we know
        else:
            axes = self.work_axes - self.axes_of(roles)
        return lax.psum(d_operand, tuple(sorted(axes))) if axes else d_operand

    def describe(self) -> str:
        rows = ", ".join(f"dim {i}: {list(a)}" for i, a in enumerate(self.row_axes) if a)
        parts = [f"rows split over {rows}" if rows else "rows not split",
                 f"vocabulary split over {list(self.vocab_axes)} (vocabulary-parallel)"
                 if self.vocab_axes else "vocabulary whole on each device"]
        return f"{self.how}: " + "; ".join(parts)


def plan_from_specs(specs: Sequence[P | None], roles: Sequence[str], *, how: str) -> Plan:
    """Rows follow the first operand that shards each row dimension; the vocabulary follows the
    first operand that shards it, minus any axis the rows already use."""
    n_rows = max((r.count("r") for r in roles), default=0)
    row_axes: list[Axes] = [()] * n_rows
    used: set[str] = set()
    for i in range(n_rows):
        for spec, role in zip(specs, roles):
            if spec is None or role.count("r") <= i:
                continue
            dim = [k for k, c in enumerate(role) if c == "r"][i]
            axes = tuple(a for a in _axes(spec[dim] if dim < len(spec) else None)
                         if a not in used)
            if axes:
                row_axes[i] = axes
                used.update(axes)
                break
    vocab: Axes = ()
    for spec, role in zip(specs, roles):
        if spec is None or "v" not in role:
            continue
        dim = role.index("v")
        axes = tuple(a for a in _axes(spec[dim] if dim < len(spec) else None) if a not in used)
        if axes:
            vocab = axes
            break
    return Plan(row_axes=tuple(row_axes), vocab_axes=vocab, how=how)


# -- the types jax gives values inside shard_map (vma: the manual axes a value varies over) ----

def has_vma(x) -> bool:
    aval = jax.typeof(x)
    return hasattr(aval, "vma") or hasattr(aval, "manual_axis_type")


def varying_axes(x) -> frozenset[str]:
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _cast_varying(x, axes: frozenset[str]):
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # jax < 0.12


def zeros_like(x):
    """Zeros of ``x``'s shape, dtype and varying manual axes (a cotangent for it)."""
    return _cast_varying(jnp.zeros(x.shape, x.dtype), varying_axes(x))


def kernel_region(fn: Callable[..., Any], *operands) -> Any:
    """Call a Pallas / FFI kernel wrapper inside a ``shard_map`` that checks varying axes.

    Kernels declare their outputs without vma types, so they are traced with the check off and
    their outputs marked as varying over every manual axis an operand varies over (a kernel's
    output depends on all of its inputs)."""
    leaves = [x for x in jax.tree.leaves(operands) if isinstance(x, jax.Array)
              or isinstance(x, jax.core.Tracer)]
    axes = frozenset().union(*(varying_axes(x) for x in leaves)) if leaves else frozenset()
    if not axes:
        return fn(*operands)
    from jax._src import config as _config  # the switch shard_map itself sets while tracing

    with _config._check_vma(False):
        out = fn(*operands)
    return jax.tree.map(lambda y: None if y is None else _cast_varying(y, axes), out)


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
    return mesh is not None and explicit is not None and any(
        t == explicit for t in getattr(mesh, "axis_types", ()))


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
    axes = _axes(vocab_axis)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"{what}: expected a mesh axis name (str) or a tuple of them, "
                         f"got {vocab_axis!r}")
    mesh = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()) or ())
    if mesh.empty or not manual:
        raise ValueError(f"{what}={vocab_axis!r} is only valid inside jax.shard_map, where it "
                         "names the mesh axis that splits the vocabulary; outside shard_map "
                         "pass sharded arrays to jax.jit instead")
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"{what}={vocab_axis!r}: {missing[0]!r} is not an axis of the mesh "
                         f"here (axes: {', '.join(mesh.axis_names)})")
    not_manual = [a for a in axes if a not in manual]
    if not_manual:
        raise ValueError(f"{what}={vocab_axis!r}: axis {not_manual[0]!r} is not a manual axis "
                         "of the enclosing shard_map")
    return axes


# -- entering the per-shard function ----------------------------------------------------------

def run(local_fn: Callable[..., tuple], operands: Sequence[Any], roles: Sequence[str],
        out_roles: Sequence[str], *, vocab_axis=None, differentiable: bool = False,
        record: Callable[[Plan], None] | None = None) -> tuple:
    """``local_fn(plan, *operands)`` run where the operands live (see the module docstring).

    ``operands`` may hold None (an absent bias): its role is ignored and ``local_fn`` gets None;
    None outputs of ``local_fn`` are dropped (``out_roles`` lists the others).
    ``differentiable``: ``local_fn`` is plain jnp that jax differentiates itself (the reference
    backend): under Auto axes it is left to XLA's partitioner, and under Explicit axes its
    shard_map checks varying axes so that jax's autodiff sums cotangents right. Otherwise
    ``local_fn`` is one half (forward or backward) of a ``custom_vjp`` and is never
    differentiated.
    """
    n_rows = max(r.count("r") for r in roles)
    if vocab_axis is not None:
        axes = check_vocab_axis(vocab_axis)
        plan = Plan(row_axes=((),) * n_rows, vocab_axes=axes, manual=True,
                    how=f"inside shard_map, vocab_axis={vocab_axis!r}")
        _note(record, plan)
        return tuple(y for y in local_fn(plan, *operands) if y is not None)
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", None):
        plan = Plan(row_axes=((),) * n_rows, manual=True,
                    how="inside shard_map: this device's arrays, no vocab_axis")
        _note(record, plan)
        return tuple(y for y in local_fn(plan, *operands) if y is not None)
    mesh = _mesh_of(operands)
    if _is_explicit(mesh):
        return _run_shard_map(local_fn, operands, roles, out_roles, mesh, differentiable,
                              record)
    batched = any(isinstance(x, _BatchTracer) for x in operands if x is not None)
    if differentiable or batched or custom_partitioning is None:
        plan = Plan.single(n_rows)
        if mesh is not None and not batched:
            plan = dataclasses.replace(plan, how="Auto mesh axes: partitioned by XLA (jnp)")
        _note(record, plan)
        return tuple(y for y in local_fn(plan, *operands) if y is not None)
    _note(record, Plan(row_axes=((),) * n_rows,
                       how="Auto mesh axes (or none): custom_partitioning plans at compile "
                           "time; rows stay where they live, a vocabulary-sharded operand is "
                           "used in place"))
    return _run_custom_partitioning(local_fn, operands, roles, out_roles)


def _note(record, plan: Plan) -> None:
    if record is not None:
        record(plan)


def _present(operands, roles):
    keep = [i for i, x in enumerate(operands) if x is not None]
    return keep, [operands[i] for i in keep], [roles[i] for i in keep]


def _with_absent(local_fn, keep, n):
    """local_fn over the present operands only, None passed where an operand is absent; its
    None outputs are dropped."""
    def fn(plan, *present):
        full = [None] * n
        for i, x in zip(keep, present):
            full[i] = x
        return tuple(y for y in local_fn(plan, *full) if y is not None)
    return fn


def _reshard(x, mesh, spec: P):
    current = jax.typeof(x).sharding.spec
    if tuple(current) + (None,) * (x.ndim - len(current)) == tuple(spec) + (None,) * (
            x.ndim - len(spec)):
        return x
    target = NamedSharding(mesh, spec)
    return jax.reshard(x, target) if hasattr(jax, "reshard") else jax.sharding.reshard(x, target)


def _run_shard_map(local_fn, operands, roles, out_roles, mesh, differentiable, record):
    keep, present, present_roles = _present(operands, roles)
    specs = [jax.typeof(x).sharding.spec for x in present]
    plan = plan_from_specs(specs, present_roles, how="Explicit mesh axes: shard_map")
    _note(record, plan)
    fn = _with_absent(local_fn, keep, len(operands))
    in_specs = tuple(plan.spec(r) for r in present_roles)
    out_specs = tuple(plan.spec(r) for r in out_roles)
    present = [_reshard(x, mesh, s) for x, s in zip(present, in_specs)]
    mapped = jax.shard_map(functools.partial(fn, plan), mesh=mesh, in_specs=in_specs,
                           out_specs=out_specs, check_vma=differentiable)
    return mapped(*present)


def _sharding_rule(roles: Sequence[str], out_roles: Sequence[str]) -> tuple[str, dict]:
    """The Shardy rule: row dims and the vocabulary are shared factors, every other dimension a
    factor of its own that must be replicated; factors no result carries are reductions."""
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

    ins, outs = [factors(r) for r in roles], [factors(r) for r in out_roles]
    in_set, out_set = {f for fs in ins for f in fs}, {f for fs in outs for f in fs}
    own = sorted(f for f in in_set | out_set if f.startswith("x"))
    rule = ", ".join(" ".join(fs) for fs in ins) + " -> " + ", ".join(" ".join(fs) for fs in outs)
    extra = {"reduction_factors": tuple(sorted(in_set - out_set - set(own))),
             "need_replication_factors": tuple(f for f in own if f in in_set)}
    return rule, {k: v for k, v in extra.items() if v}


def _run_custom_partitioning(local_fn, operands, roles, out_roles):
    keep, present, present_roles = _present(operands, roles)
    fn = _with_absent(local_fn, keep, len(operands))
    n_rows = max(r.count("r") for r in present_roles)

    @custom_partitioning
    def call(*args):
        return fn(Plan.single(n_rows), *args)

    def partition(mesh, arg_shapes, result_shape):
        specs = [getattr(a.sharding, "spec", None) for a in arg_shapes]
        plan = plan_from_specs(specs, present_roles, how="Auto mesh axes: custom_partitioning")
        arg_shardings = tuple(NamedSharding(mesh, plan.spec(r)) for r in present_roles)
        out_shardings = tuple(NamedSharding(mesh, plan.spec(r)) for r in out_roles)
        return mesh, functools.partial(fn, plan), out_shardings, arg_shardings

    rule, factor_kinds = _sharding_rule(present_roles, out_roles)
    call.def_partition(partition, sharding_rule=rule, **factor_kinds)
    return call(*present)
