"""What the sharding tests (tests/test_sharding.py, tests/test_sharding_grid.py) read off a
compiled step: the sizes of its collectives and the full PartitionSpec of an array."""

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
