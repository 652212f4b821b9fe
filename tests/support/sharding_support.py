"""What the sharding tests (tests/sharding/test_sharding.py, tests/sharding/test_sharding_grid.py)
read off a compiled step: the sizes of its collectives and the full PartitionSpec of an array; and
the two-device run of a head's loss that several op tests share (:func:`on_two_devices`)."""

from __future__ import annotations

import re

import numpy as np


def collective_sizes(hlo: str, name: str) -> list[int]:
    """Element counts of every result of a collective (``all-gather``, ``all-reduce``,
    ``reduce-scatter``) in a compiled HLO text, each element of a combined one's tuple."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(rf"= (.*?) {name}(?:-start)?\(", line)
        for t in re.finditer(r"\w+\[([\d,]*)\]", m.group(1)) if m else ():
            sizes.append(int(np.prod([int(d) for d in t.group(1).split(",") if d])))
    return sizes


def full_spec(x) -> tuple:
    """The PartitionSpec of ``x``'s sharding, one entry per dimension (None padded)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def on_two_devices(loss, hidden, weight, bias, *, kind: str, layout: str):
    """``jax.jit(jax.value_and_grad(loss, (0, 1, 2)))`` on two devices of a mesh with axis
    type ``kind`` ("Explicit" / "Auto"), the rows of ``hidden`` split (``layout="rows"``) or
    the vocabulary of ``weight`` ([V, D]) and ``bias`` (``"vocab"``); skipped with fewer
    devices."""
    import jax
    import pytest
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 2:
        pytest.skip("needs two devices")
    mesh = jax.make_mesh(
        (2,), ("x",), axis_types=(getattr(AxisType, kind),), devices=jax.devices()[:2]
    )
    rows, vocab_spec = (P("x"), P()) if layout == "rows" else (P(), P("x"))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(
            put(hidden, rows), put(weight, vocab_spec), put(bias, vocab_spec)
        )
