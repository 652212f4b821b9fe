"""What the side-by-side workers agree on: sizes, the inputs file, the rows, the time budget.

NumPy only, so that the PyTorch worker never imports JAX (and the reverse).

The problem: per-token log-probabilities of a linear LM head, logp_i = z_i[t_i] − logsumexp(z_i)
with z_i = W h_i, and the loss L = Σ_i g_i · logp_i with a random cotangent g ~ N(0, 1), whose
gradients d_hidden = ∂L/∂h [N, D] and d_weight = ∂L/∂W [V, D] every implementation returns.
Inputs (bf16): h ~ N(0, 1), W ~ N(0, 1.5²/D) (logits of standard deviation 1.5), targets
uniform in [0, V).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time
from typing import Any

import numpy as np

SIZES = {"full": (4096, 2048, 131072), "large": (8192, 4096, 131072), "smoke": (64, 128, 1000)}
WEIGHT_STD = 1.5  # times 1/sqrt(D)

# The table's columns: the comparison's own, then what the row was run with and why it has no numbers.
COLUMNS = [
    "impl",
    "op",
    "mode",
    "layout",
    "N",
    "D",
    "V",
    "fwd_ms",
    "fwdbwd_ms",
    "fwdbwd_extra_mb",
    "err_dh",
    "err_dW",
    "bitwise_repeat",
    "fwd_device_ms",
    "fwdbwd_device_ms",
    "version",
    "note",
    "error",
]

# (impl, layout) of each framework, in table order: the driver fills in a row with the reason
# for every one a worker did not report (crash, time limit).
IMPLS = {
    "jax": [
        ("jaxrl_kernels", "vd"),
        ("jaxrl_kernels", "dv"),
        ("jaxrl_kernels memory=fast", "vd"),
        ("jaxrl_kernels memory=fast", "dv"),
        ("jaxrl_kernels linear_grpo_loss", "vd"),
        ("jaxrl_kernels linear_grpo_loss", "dv"),
        ("jaxrl_kernels linear_grpo_loss memory=fast", "vd"),
        ("jaxrl_kernels linear_grpo_loss memory=fast", "dv"),
        ("jaxrl_kernels linear_ppo_loss memory=fast", "vd"),
        ("jaxrl_kernels linear_ppo_loss memory=fast", "dv"),
        ("jaxrl_kernels linear_policy_gradient_loss memory=fast", "vd"),
        ("jaxrl_kernels linear_policy_gradient_loss memory=fast", "dv"),
        ("jaxrl_kernels[pallas]", "vd"),
        ("jaxrl_kernels[chunked]", "vd"),
        ("jnp_bf16_materialised", "vd"),
        ("jnp_f32_materialised", "vd"),
        ("tokamax (default)", "dv"),
        ("tokamax chunked_xla", "dv"),
    ],
    "torch": [
        ("torch_bf16_materialised", "vd"),
        ("torch_bf16_logits_f32_softmax", "vd"),
        ("quack_chunked", "vd"),
        ("quack_scaled_exp", "vd"),
        ("liger-kernel fused linear CE", "vd"),
        ("cut-cross-entropy filter_eps='high'", "vd"),
        ("cut-cross-entropy filter_eps=None", "vd"),
    ],
}


def selected(impls: str | None) -> dict[str, list[tuple[str, str]]]:
    """``IMPLS`` cut to the rows whose impl name (before any layout) is in the comma-separated
    ``impls`` (None: all)."""
    if not impls:
        return IMPLS
    wanted = set(impls.split(","))
    return {fw: [row for row in rows if row[0] in wanted] for fw, rows in IMPLS.items()}


def draw_inputs(n: int, d: int, v: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 draws of h [N, D], W [V, D], targets [N] and the cotangent g [N]."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((n, d), np.float32)
    w = rng.standard_normal((v, d), np.float32)
    w *= np.float32(WEIGHT_STD / math.sqrt(d))
    t = rng.integers(0, v, n).astype(np.int32)
    g = rng.standard_normal(n, np.float32)
    return {"h": h, "w": w, "t": t, "g": g}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → the uint16 bit patterns of bfloat16, rounded to nearest even (finite x)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns → float32 (exact)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def load_inputs(path: str | pathlib.Path) -> dict[str, Any]:
    """The inputs file written by ``exact``: bf16 bits of h and W, targets, g, and the exact
    d_hidden [N, D] / d_weight [V, D] (computed in float64, stored rounded to float32)."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


class Budget:
    """A deadline (Unix time) the worker checks before each implementation."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def left(self) -> float:
        return self.deadline - time.time()

    def spent(self) -> bool:
        return self.left() <= 0


def write_row(path: str | pathlib.Path, row: dict[str, Any]) -> None:
    """Append one row as a JSON line (so rows survive a worker that dies later)."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print("row:", json.dumps(row), flush=True)


def read_rows(path: str | pathlib.Path) -> list[dict[str, Any]]:
    p = pathlib.Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def error_text(err: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(err).split())
    return f"{type(err).__name__}: {msg[:limit]}"


def worker_args(description: str) -> argparse.Namespace:
    """The command line every framework worker takes from the driver."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, required=True)
    parser.add_argument("--smoke", action="store_true", help="two timed runs each")
    parser.add_argument("--impls", help="only these impl names, comma-separated")
    return parser.parse_args()
