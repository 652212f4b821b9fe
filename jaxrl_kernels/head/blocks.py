"""Equal blocks over an axis of ``n`` items, for loops that must keep every block one static size.

A loop over ``ceil(n / size)`` blocks of ``size`` items pulls its last block back to end at
``n`` (``start = min(c·size, n − size)``), so every slice has the same shape; the items of that
last block that an earlier block already covered (``index < c·size``) are not *fresh*, and
the loop leaves what the earlier block wrote for them::

    spans = blocks(n, size)
    def body(c, carry):
        start, fresh = spans.start(c), spans.fresh(c)
        ...   # work on items [start, start + size); write only where fresh
    jax.lax.fori_loop(0, spans.count, body, init)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Blocks:
    """``n`` items in ``count`` blocks of ``size`` (``1 <= size <= n``; see the module
    docstring)."""

    n: int
    size: int

    @property
    def count(self) -> int:
        return -(-self.n // self.size)

    def start(self, c):
        """The first item of block ``c`` (a traced or static int)."""
        return jnp.minimum(c * self.size, self.n - self.size)

    def fresh(self, c):
        """``[size]`` bool: which items of block ``c`` no earlier block covered."""
        return self.start(c) + jnp.arange(self.size) >= c * self.size

    def collect(self, ys, n: int):
        """Items ``[0, n)`` (``n <= self.n``) from per-block outputs ``ys`` (a pytree of
        ``[count, size, ...]``), each item from the block where it is fresh."""
        items = jnp.arange(n)  # traced (no constant array: custom_partitioning takes none)
        which = jnp.minimum(items // self.size, self.count - 1)
        at = items - self.start(which)
        return jax.tree.map(lambda y: y[which, at], ys)


def blocks(n: int, size: int) -> Blocks:
    """``n`` items (``n >= 1``) in blocks of ``size``, clamped to ``[1, n]``."""
    return Blocks(int(n), max(1, min(int(size), int(n))))


def equal_blocks(n: int, max_size: int) -> Blocks:
    """The fewest blocks of at most ``max_size`` items covering ``n``, of as equal a size as
    one static size allows (the last one overlaps its predecessor by less than ``count``
    items)."""
    count = -(-n // max(1, min(int(max_size), n)))
    return blocks(n, -(-n // count))


def map_blocks(fn, xs, size: int):
    """``fn`` on blocks of ``size`` rows of the arrays ``xs`` (each [N, ...], N shared): its
    output [size, ...] per block, put together as [N, ...]. Every call has the same shapes
    whatever N is (:func:`blocks`: the last block pulled back; fewer than ``size`` rows are
    padded with zeros), and each call sits between optimization barriers, so an XLA GEMM in
    ``fn`` rounds each row the same way whatever N and the other rows are (XLA picks a GEMM's
    blocking and split by its shape). For work with no gradient: jax would differentiate the
    slices into whole-size updates."""
    n = xs[0].shape[0]
    if n < size:
        xs = [jnp.pad(x, [(0, size - n)] + [(0, 0)] * (x.ndim - 1)) for x in xs]
    spans = blocks(max(n, size), size)

    def block(c):  # behind barriers: one block (a loop XLA inlines) compiles as each of several
        barrier = jax.lax.optimization_barrier
        return barrier(
            fn(*barrier(tuple(jax.lax.dynamic_slice_in_dim(x, spans.start(c), size) for x in xs)))
        )

    return spans.collect(jax.lax.map(block, jnp.arange(spans.count)), n)
