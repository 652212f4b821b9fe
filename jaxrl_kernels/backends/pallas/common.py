"""What every Pallas kernel module shares: interpret mode and compiler params."""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pltriton


def interpret() -> bool:
    """Run kernels in Pallas interpret mode unless we are on a GPU."""
    return jax.default_backend() != "gpu"


def compiler_params(num_warps: int, num_stages: int) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
