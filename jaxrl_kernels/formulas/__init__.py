"""The formulas: elementwise math and reductions over the last axis, in float32, shared by the
kernels (on tiles) and the jnp backends (on arrays)."""
