"""Where the work runs: entering a per-device function on sharded operands, and the collectives.

``entry`` enters an op's per-device function (inside a user's ``shard_map``, through
``shard_map`` for Explicit axes, through ``custom_partitioning`` for Auto axes) and is
re-exported here (``sharding.run``, ``sharding.kernel_region``, ...); ``placement`` is the
PartitionSpec algebra of a call (which mesh axes split rows and vocabulary);
``_jax_internals`` the two private jax pieces the package relies on.
"""

from jaxrl_kernels.sharding.entry import (
    check_vocab_axis,
    global_vocab,
    keep_grad_sharding,
    kernel_region,
    pin_grad_shardings,
    replicated,
    run,
)

__all__ = [
    "check_vocab_axis",
    "global_vocab",
    "keep_grad_sharding",
    "kernel_region",
    "pin_grad_shardings",
    "replicated",
    "run",
]
