"""The keywords the config values replaced, accepted for one minor version with a warning.

Before 0.2 the ops took their options as keywords (``clip_high=``, ``top_k=``,
``group_size=``, ...). They now take one validated value per concern (``config=``,
``sampler=``, ``groups=``); the old keywords still arrive, through the op's ``**deprecated``,
and :func:`take` builds the value they describe, with one ``DeprecationWarning`` per call.
They are removed in :data:`REMOVED_IN`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax

REMOVED_IN = "0.3"

# The warning names the user's line: the first frame outside this package and jax (whose
# frames sit between a user's function and the op when jax.jit or jax.grad traces it). A fixed
# stacklevel cannot: the ops reach take() through helpers of different depths, and a warning
# attributed to a library file is hidden by Python's default filters.
_NOT_THE_CALLER = (
    os.path.dirname(os.path.dirname(__file__)) + os.sep,
    os.path.dirname(jax.__file__) + os.sep,
)


@dataclasses.dataclass(frozen=True)
class Keywords:
    """Old keywords that build the value of one new parameter.

    Attributes:
      param: the op's parameter that takes the value (``"config"``, ``"sampler"``, ...).
      cls: the value's type (``PolicyLoss``, ``Sampler``, ...).
      fields: each old keyword -> the attribute it sets.
    """

    param: str
    cls: type
    fields: Mapping[str, str]


def typed(param: str, value: Any, cls: type) -> Any:
    """``value`` if it is a ``cls`` or None, else ``TypeError``."""
    if value is not None and not isinstance(value, cls):
        raise TypeError(
            f"{param}: expected a jaxrl_kernels.{cls.__name__} or None, got {type(value).__name__}"
        )
    return value


def take(
    op: str, deprecated: Mapping[str, Any], given: Mapping[str, Any], groups: Sequence[Keywords]
) -> dict[str, Any]:
    """The value of each ``Keywords.param``: the one ``given``, or one built from the old
    keywords in ``deprecated`` (then a ``DeprecationWarning``; with both, ``ValueError``).

    An unknown keyword is the ``TypeError`` Python gives a call with an unexpected keyword.
    """
    known = {name: group for group in groups for name in group.fields}
    for name in deprecated:
        if name not in known:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
    values, used = {}, []
    for group in groups:
        value = typed(group.param, given.get(group.param), group.cls)
        old = {name: v for name, v in deprecated.items() if known[name] is group}
        if old and value is not None:
            name = next(iter(old))
            raise ValueError(
                f"{name}: given with {group.param}=; set it in the "
                f"{group.cls.__name__} instead (dataclasses.replace("
                f"{group.param}, {group.fields[name]}=...))"
            )
        if old:
            value = group.cls(**{group.fields[name]: v for name, v in old.items()})
            shown = ", ".join(f"{group.fields[name]}=..." for name in old)
            used.append(
                (
                    ", ".join(f"{name}=" for name in old),
                    f"{group.param}=jk.{group.cls.__name__}({shown})",
                )
            )
        values[group.param] = value
    if used:
        warnings.warn(
            f"{op}: the keywords {', '.join(k for k, _ in used)} are deprecated and will be "
            f"removed in jaxrl_kernels {REMOVED_IN}; pass {', '.join(v for _, v in used)}",
            DeprecationWarning,
            skip_file_prefixes=_NOT_THE_CALLER,
        )
    return values
