"""The CUDA extension ``jaxrl_kernels._sm90`` (``csrc/``) as the ffi backend sees it: loaded
once, its FFI targets registered with XLA for CUDA, and why it cannot run in this process.

:func:`uninitialized_like` is the one target every kernel module may use: a buffer that
nothing writes, for a loop carry the loop overwrites in full.
"""

from __future__ import annotations

import jax

UNINITIALIZED_TARGET = "jaxrl_kernels_uninitialized"  # csrc/ffi_uninitialized.cc

try:
    from jaxrl_kernels import _sm90 as sm90
except ImportError as err:  # not built (no Hopper GPU or nvcc at install time, or OFF)
    sm90 = None
    IMPORT_ERROR = f"{type(err).__name__}: {err}"
else:
    IMPORT_ERROR = None
    for _name, _capsule in sm90.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def unavailable_reason() -> str | None:
    """None only if the extension is loaded and the default device is a 9.x (Hopper) GPU."""
    if sm90 is None:
        return (
            "the CUDA extension jaxrl_kernels._sm90 is not built (pip builds it where a "
            "Hopper GPU and nvcc are found, or with JAXRL_KERNELS_BUILD_CUDA=ON: "
            f"docs/building.md): {IMPORT_ERROR}"
        )
    backend = jax.default_backend()
    if backend != "gpu":
        return f"platform is {backend!r}; ffi needs an NVIDIA GPU with compute capability 9.x"
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    if not cc.startswith("9."):
        return (
            f"device {getattr(dev, 'device_kind', dev)} has compute capability {cc or '?'}; "
            "the extension is built for sm_90a (Hopper) only"
        )
    return None


def uninitialized_like(x):
    """A buffer of x's shape and dtype that nothing writes (the custom call does no work), for
    a loop carry that the loop overwrites in full: d_weight, which would otherwise be
    zero-filled first (a pass over the weight's bytes)."""
    return jax.ffi.ffi_call(UNINITIALIZED_TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))()
