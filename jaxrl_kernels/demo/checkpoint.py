"""Save and restore a run: its RL state, its configuration and its history, in one file.

The file is msgpack (``flax.serialization``) holding ``{"format", "config",
"history", "state"}``: ``config`` and ``history`` are JSON text (the run's
``Config`` fields and its log so far), ``state`` is the pytree ``{"params",
"opt_state", "ref_params", "step"}`` as a state dict. Restoring the state needs
a template of the same structure (a freshly initialised state) and gives back
exactly the saved arrays, so the next step after a restore is the step the
uninterrupted run would have taken.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
from flax import serialization

FORMAT = "jaxrl_kernels.demo checkpoint 2"
FILENAME = "checkpoint.msgpack"


class CheckpointError(ValueError):
    """A path that holds no usable checkpoint; the message is one line saying why."""


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a checkpoint file holds."""

    path: str
    config: dict[str, Any]
    history: dict[str, Any]
    state: dict[str, Any]  # a flax state dict; see :func:`restore`

    @property
    def step(self) -> int:
        """RL steps done when it was written."""
        return int(self.state["step"])


def resolve(path: str) -> str:
    """The checkpoint file for ``path``: the file itself, or ``FILENAME`` inside a directory."""
    if os.path.isdir(path):
        file = os.path.join(path, FILENAME)
        if not os.path.isfile(file):
            raise CheckpointError(
                f"{path} is a directory without a {FILENAME} (pass a run's "
                f"--out directory or its {FILENAME})"
            )
        return file
    if not os.path.exists(path):
        raise CheckpointError(f"{path} does not exist")
    return path


def save(path: str, state, *, config: dict[str, Any], history: dict[str, Any]) -> None:
    """Write the run to ``path`` atomically (a crash never leaves half a file)."""
    data = serialization.msgpack_serialize(
        {
            "format": FORMAT,
            "config": json.dumps(config),
            "history": json.dumps(history),
            "state": serialization.to_state_dict(jax.device_get(state)),
        }
    )
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load(path: str) -> Saved:
    """Read the checkpoint at ``path`` (a file, or a directory holding ``FILENAME``)."""
    file = resolve(path)
    try:
        with open(file, "rb") as f:
            raw = serialization.msgpack_restore(f.read())
    except OSError as err:
        raise CheckpointError(f"{file}: cannot be read ({err.strerror or err})") from err
    except Exception as err:  # msgpack raises several types for bytes that are not msgpack
        raise CheckpointError(f"{file} is not a checkpoint of this demo (not msgpack)") from err
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else None
        raise CheckpointError(
            f"{file} is not a checkpoint of this demo (format {found!r}, "
            f"expected {FORMAT!r}; checkpoints of older versions hold no "
            "configuration and cannot be resumed)"
        )
    try:
        return Saved(
            path=file,
            config=json.loads(raw["config"]),
            history=json.loads(raw["history"]),
            state=raw["state"],
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file} is damaged: {type(err).__name__}: {err}") from err


def restore(saved: Saved, template):
    """The saved RL state in the structure, and dtypes, of ``template``."""
    try:
        restored = serialization.from_state_dict(jax.device_get(template), saved.state)
    except (KeyError, ValueError) as err:
        raise CheckpointError(
            f"{saved.path}: its state does not fit this model ({type(err).__name__}: {err})"
        ) from err
    shapes = jax.tree.map(lambda t, x: jnp.shape(t) == jnp.shape(x), template, restored)
    if not all(jax.tree.leaves(shapes)):
        raise CheckpointError(f"{saved.path}: its arrays have other shapes than this model's")
    return jax.tree.map(lambda t, x: jnp.asarray(x, dtype=jnp.asarray(t).dtype), template, restored)
