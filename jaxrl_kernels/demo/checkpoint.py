"""Save and restore the RL state with ``flax.serialization`` (msgpack).

The state is the pytree ``{"params", "opt_state", "ref_params", "step"}``;
restoring needs a template of the same structure (a freshly initialised state),
and gives back exactly the saved arrays, so the next step after a restore is
the step the uninterrupted run would have taken.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp
from flax import serialization


def save(path: str, state) -> None:
    """Write ``state`` to ``path`` atomically (a crash never leaves half a file)."""
    data = serialization.to_bytes(jax.device_get(state))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def restore(path: str, template):
    """Read a state saved by :func:`save` into the structure of ``template``."""
    with open(path, "rb") as f:
        restored = serialization.from_bytes(jax.device_get(template), f.read())
    return jax.tree.map(lambda t, x: jnp.asarray(x, dtype=jnp.asarray(t).dtype), template, restored)
