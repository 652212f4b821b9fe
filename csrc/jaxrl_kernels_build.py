"""The PEP 517 build backend: scikit-build-core, after deciding whether to build the CUDA extension.

``JAXRL_KERNELS_BUILD_CUDA`` (environment variable):

* ``AUTO`` (default): build ``jaxrl_kernels._sm90`` only where it can run, i.e. where
  ``nvidia-smi --query-gpu=compute_cap`` reports a GPU of compute capability 9.x (Hopper);
* ``ON``: build it on any machine (CI does, so that the C++ is compiled on every run);
* ``OFF``: never build it.

When nothing is built, the install runs no CMake and installs none of the extension's build
requirements (jaxlib and nvidia-cutlass for headers, pybind11): a CPU install is pure Python and
quick. Either way one line on stderr says what is built and why; ``pip install -v`` shows it,
and CMake's own lines while it builds (``csrc/CMakeLists.txt``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from scikit_build_core import build as _skbuild

ENV_VAR = "JAXRL_KERNELS_BUILD_CUDA"
ON = {"ON", "1", "TRUE", "YES", "Y"}
OFF = {"OFF", "0", "FALSE", "NO", "N"}
CUDA_BUILD_REQUIRES = [
    "pybind11>=2.12",
    # Headers only: XLA FFI from jaxlib, CUTLASS/CuTe from nvidia-cutlass.
    "jaxlib>=0.11.2,<0.13",
    "nvidia-cutlass==4.2.0.0; sys_platform == 'linux'",
]


def _compute_capabilities() -> list[str] | None:
    """The compute capabilities nvidia-smi reports, or None when it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def decide() -> tuple[bool, str]:
    """(build the extension?, why)."""
    raw = os.environ.get(ENV_VAR, "AUTO").strip() or "AUTO"
    mode = raw.upper()
    if mode in OFF:
        return False, f"{ENV_VAR}={raw}"
    if mode in ON:
        return True, f"{ENV_VAR}={raw}"
    if mode != "AUTO":
        raise ValueError(f"{ENV_VAR}: expected AUTO, ON or OFF, got {raw!r}")
    caps = _compute_capabilities()
    if caps is None:
        return False, (
            "no NVIDIA GPU is visible (no working nvidia-smi), and the extension runs "
            f"only on Hopper GPUs; {ENV_VAR}=ON builds it anyway"
        )
    if not any(c.startswith("9.") for c in caps):
        return False, (
            f"no Hopper GPU is visible (compute capability {', '.join(caps) or '?'}; "
            f"the extension needs 9.x); {ENV_VAR}=ON builds it anyway"
        )
    return True, f"a GPU of compute capability {', '.join(caps)} is visible"


def _settings(config_settings):
    """scikit-build-core's config settings for this decision; prints the decision once."""
    build, why = decide()
    settings = dict(config_settings or {})
    if build:
        print(
            f"jaxrl_kernels: building the CUDA extension ({why}); this takes minutes",
            file=sys.stderr,
        )
    else:
        print(
            f"jaxrl_kernels: not building the CUDA extension: {why}. Pure-Python install.",
            file=sys.stderr,
        )
        settings.setdefault("wheel.cmake", "false")
    return build, settings


def get_requires_for_build_wheel(config_settings=None):
    build, settings = _settings(config_settings)
    return _skbuild.get_requires_for_build_wheel(settings) + (CUDA_BUILD_REQUIRES if build else [])


def get_requires_for_build_editable(config_settings=None):
    build, settings = _settings(config_settings)
    return _skbuild.get_requires_for_build_editable(settings) + (
        CUDA_BUILD_REQUIRES if build else []
    )


def get_requires_for_build_sdist(config_settings=None):
    return _skbuild.get_requires_for_build_sdist(config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild.build_wheel(wheel_directory, _settings(config_settings)[1], metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild.build_editable(
        wheel_directory, _settings(config_settings)[1], metadata_directory
    )


def build_sdist(sdist_directory, config_settings=None):
    return _skbuild.build_sdist(sdist_directory, config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _skbuild.prepare_metadata_for_build_wheel(
        metadata_directory, _settings(config_settings)[1]
    )


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _skbuild.prepare_metadata_for_build_editable(
        metadata_directory, _settings(config_settings)[1]
    )
