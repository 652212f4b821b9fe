"""The two private jax pieces the package relies on (``jaxrl_kernels.sharding._jax_internals``) still do
their job, and no other module of the package imports ``jax._src``."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxrl_kernels
from jaxrl_kernels.sharding import _jax_internals, vma

PACKAGE = pathlib.Path(jaxrl_kernels.__file__).parent


def test_is_vmapped_only_under_vmap():
    seen = []

    def f(x):
        seen.append(_jax_internals.is_vmapped(x))
        return x

    jax.vmap(f)(jnp.ones((2, 3)))
    f(jnp.ones(3))
    jax.jit(f)(jnp.ones(3))
    jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))
    assert seen == [True, False, False, False]


def test_vma_check_off_traces_without_varying_axes():
    """Inside a checking shard_map a product of a varying value varies; in the context it does
    not (what ``sharding.kernel_region`` relies on to trace a kernel)."""
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = {}

    def body(x):
        seen["checked"] = vma.varying_axes(x * jnp.ones((), x.dtype))
        with _jax_internals.vma_check_off():
            seen["off"] = vma.varying_axes(x * jnp.ones((), x.dtype))
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=True))(
        jnp.ones(4)
    )
    assert seen == {"checked": frozenset({"x"}), "off": frozenset()}


def test_no_other_module_imports_jax_private():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "_jax_internals.py" and "jax._src" in path.read_text()
    ]
    assert offenders == []
