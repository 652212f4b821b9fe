"""Two runs on the same inputs give bitwise-identical outputs and gradients (docs/api.md "Numerics").

Every op at small sizes, jitted with its gradient and eagerly: test_transforms.py's
``test_jit_grad_value_and_grad`` runs each twice (sharing its compiled function). Here, sizes
where a vocabulary-chunked implementation walks several chunks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from tests.conftest import assert_bitwise, pallas_slow


def twice(f, *args):
    """f compiled once and run twice."""
    jf = jax.jit(f)
    first = jf(*args)
    assert_bitwise(first, jf(*args), "jit")
    return first


# Sizes where a vocabulary-chunked implementation walks several chunks.
@pytest.mark.parametrize(
    "n,v,d,layout", [pallas_slow(2048, 1000, 16, "vd"), pallas_slow(64, 32003, 8, "dv")]
)
def test_bitwise_repeatable_large(backend, rng, n, v, d, layout):
    h = jnp.asarray(rng.standard_normal((n, d)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((v, d) if layout == "vd" else (d, v)).astype(np.float32))
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    g = jnp.asarray(rng.standard_normal(n).astype(np.float32))

    def f(h, w):
        lp, ent = jk.linear_logprobs(
            h, w, t, weight_layout=layout, return_entropy=True, backend=backend
        )
        return jnp.sum(g * (lp + 0.1 * ent))

    twice(jax.value_and_grad(f, argnums=(0, 1)), h, w)
    logits = h @ (w.T if layout == "vd" else w)
    twice(
        jax.value_and_grad(lambda l: jnp.sum(g * jk.token_logprobs(l, t, backend=backend))), logits
    )
