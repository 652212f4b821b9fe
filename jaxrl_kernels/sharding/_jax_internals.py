"""The two pieces of jax's internals the package needs, in one place (jax has no public API for
either); ``tests/sharding/test_jax_internals.py`` checks that both still do their job.

``vma_check_off()``
    A context in which values traced inside ``shard_map`` carry no varying-manual-axes (vma)
    types: the switch ``shard_map`` itself flips while it traces. ``sharding.kernel_region``
    traces a Pallas or FFI kernel wrapper in it, since kernels declare their outputs without
    vma types (jax's own Pallas ops do the same).
``is_vmapped(x)``
    Whether ``x`` is a value being traced by ``jax.vmap``. ``sharding.run`` then avoids
    ``custom_partitioning``, which has no batching rule.

Nothing else in the package imports from ``jax._src``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax._src import config as _config

try:
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover - every supported jax has it
    _BatchTracer = ()


@contextlib.contextmanager
def vma_check_off() -> Iterator[None]:
    """Trace without vma types (what ``shard_map(check_vma=False)`` does for its body)."""
    with _config._check_vma(False):
        yield


def is_vmapped(x) -> bool:
    """True for a tracer of ``jax.vmap``."""
    return isinstance(x, _BatchTracer)
