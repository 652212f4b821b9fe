"""Draw the inputs and compute the exact gradients of L = Σ_i g_i · logp_i in float64.

On the default device, with ``jax_enable_x64``, from the bf16 inputs upcast to float64. The
vocabulary is walked in chunks of C rows of W, so no float64 [N, V] buffer is ever whole:

- pass 1: lse_i = log Σ_v exp(z_iv), z = h Wᵀ, by a running (max, Σexp) over the chunks;
- pass 2: per chunk, dz = g_i (onehot(t_i) − exp(z − lse_i)); d_hidden += dz W_c and
  d_weight[c] = dzᵀ h.

Writes one .npz (see ``shared.load_inputs``): the inputs as bf16 bit patterns and the exact
gradients rounded to float32 (a relative rounding of 6e-8, far below the errors measured).

    python -m benchmarks.side_by_side.exact --out /tmp/x.npz --size smoke --chunk 384
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.side_by_side import shared

F64 = jnp.float64


@jax.jit
def _chunk_stats(h, w_c):
    z = h @ w_c.T
    m = jnp.max(z, axis=1)
    return m, jnp.sum(jnp.exp(z - m[:, None]), axis=1)


@jax.jit
def _combine(m, s, m_c, s_c):
    m_new = jnp.maximum(m, m_c)
    return m_new, s * jnp.exp(m - m_new) + s_c * jnp.exp(m_c - m_new)


@jax.jit
def _chunk_grads(h, w_c, lse, g, t_local):
    z = h @ w_c.T
    p = jnp.exp(z - lse[:, None])
    onehot = (jnp.arange(w_c.shape[0])[None, :] == t_local[:, None]).astype(F64)
    dz = g[:, None] * (onehot - p)
    return dz @ w_c, dz.T @ h


def exact_grads(h, w, t, g, chunk):
    """(d_hidden, d_weight as float32, logp) of Σ g·logp from float64 h [N, D], W [V, D],
    g [N], walking W in chunks of ``chunk`` rows (needs x64 enabled)."""
    n, v = h.shape[0], w.shape[0]
    starts = range(0, v, chunk)
    m = jnp.full((n,), -jnp.inf, F64)
    s = jnp.zeros((n,), F64)
    for c0 in starts:
        m, s = _combine(m, s, *_chunk_stats(h, w[c0 : c0 + chunk]))
    lse = m + jnp.log(s)
    dh = jnp.zeros(h.shape, F64)
    dw_parts = []
    target_logit = jnp.zeros((n,), F64)
    for c0 in starts:
        w_c = w[c0 : c0 + chunk]
        dh_c, dw_c = _chunk_grads(h, w_c, lse, g, t - c0)
        dh = dh + dh_c
        dw_parts.append(dw_c.astype(jnp.float32))
        inside = (t >= c0) & (t < c0 + w_c.shape[0])
        rows = jnp.clip(t - c0, 0, w_c.shape[0] - 1)
        target_logit = target_logit + jnp.where(inside, jnp.sum(h * w_c[rows], axis=1), 0.0)
    return dh, jnp.concatenate(dw_parts, axis=0), target_logit - lse


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the .npz to write")
    parser.add_argument("--size", default="full", choices=sorted(shared.SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="vocabulary rows per chunk (default: a 256 MiB float64 [N, C] block)",
    )
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)  # this process only
    n, d, v = shared.SIZES[args.size]
    chunk = args.chunk or max(1, min(v, 2**28 // (8 * n)))
    start = time.perf_counter()
    raw = shared.draw_inputs(n, d, v, args.seed)
    bits = {"h": shared.bf16_bits(raw["h"]), "w": shared.bf16_bits(raw["w"])}
    del raw["h"], raw["w"]
    print(
        f"exact: drew inputs N={n} D={d} V={v} in {time.perf_counter() - start:.1f} s", flush=True
    )
    h = jnp.asarray(shared.bf16_to_f32(bits["h"])).astype(F64)
    w = jnp.asarray(shared.bf16_to_f32(bits["w"])).astype(F64)
    t = jnp.asarray(raw["t"])
    g = jnp.asarray(raw["g"]).astype(F64)
    dh, dw, logp = exact_grads(h, w, t, g, chunk)
    dh = np.asarray(dh.astype(jnp.float32))
    dw = np.asarray(dw)
    loss = float(jnp.sum(g * logp))
    # the summed cross-entropy Σ −logp (g = −1), for the peers that only return a sum (QuACK)
    dh_sum, dw_sum, _ = exact_grads(h, w, t, -jnp.ones_like(g), chunk)
    dh_sum = np.asarray(dh_sum.astype(jnp.float32))
    dw_sum = np.asarray(dw_sum)
    print(
        f"exact: float64 gradients on {jax.devices()[0]} in chunks of {chunk} "
        f"({time.perf_counter() - start:.1f} s); L = {loss:.6g}",
        flush=True,
    )
    np.savez(
        args.out,
        h_bits=bits["h"],
        w_bits=bits["w"],
        t=raw["t"],
        g=raw["g"],
        exact_dh=dh,
        exact_dw=dw,
        exact_loss=np.float64(loss),
        exact_dh_sum=dh_sum,
        exact_dw_sum=dw_sum,
        size=np.array([n, d, v], np.int64),
        seed=np.int64(args.seed),
        chunk=np.int64(chunk),
        device=np.str_(str(jax.devices()[0])),
    )
    print(f"exact: wrote {args.out} ({time.perf_counter() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
