"""The tunix and Flax comparisons hold two float32 programs to 1e-5 of each other. On a GPU,
XLA's default precision runs float32 matmuls as TF32 (10-bit mantissa), which moves both
sides' logits by ~1e-4 in different places (the model's forward is traced twice, and XLA may
pick different GEMM algorithms for each): their comparisons run at full float32 precision."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _full_float32_matmuls():
    if jax.default_backend() == "cpu":  # float32 matmuls are float32 there already
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
