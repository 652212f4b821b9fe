"""The SM90 ffi forward beside the single GEMM, the materialised jnp path and Pallas.

bf16, N=4096, D=2048, V ∈ {32768, 50257, 131072} and N=8192, D=4096, V=151936:
forward of ``linear_logprobs`` on each backend, the one [N, D] x [D, V] product alone
(XLA, same run), and forward+backward with the ffi forward (chunked backward).
TFLOP/s counts the 2·N·D·V multiply-adds of the forward (6·N·D·V for forward+backward).
Times: median over trials of ``reps`` back-to-back calls then one block_until_ready, per
call (keeps the GPU busy, so host dispatch is hidden for millisecond kernels); the trials
of the backends alternate, so clock drift affects them alike.

    python3 -m benchmarks.studies.bench_ffi [--quick]

writes ffi.json / ffi.md to out/bench (``--out``, ``--update-results``: benchmarks/README.md)
and prints the table.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common, output
from jaxrl_kernels.backends import ffi
from jaxrl_kernels.backends.ffi import extension

SHAPES = [(4096, 2048, 32768), (4096, 2048, 50257), (4096, 2048, 131072), (8192, 4096, 151936)]


def per_call_ms(fns: dict, *, reps: int = 10, trials: int = 9, warmup: int = 2) -> dict:
    """Median ms per call of each ``name -> (fn, args)``; trials alternate between the
    functions so that clock drift hits them alike. A function that fails maps to None."""
    ok = {}
    for name, (fn, args) in fns.items():
        try:
            common.time_calls(fn, *args, warmup=warmup, runs=0)
            ok[name] = []
        except Exception as err:  # a backend that cannot run this shape is reported, not fatal
            print(f"  {name} skipped: {type(err).__name__}: {str(err)[:200]}")
    for _ in range(trials):
        for name in ok:
            fn, args = fns[name]
            ok[name] += common.time_calls(fn, *args, warmup=0, runs=1, calls=reps).samples
    return {name: (statistics.median(ok[name]) if name in ok else None) for name in fns}


def _safe(fn):
    try:
        return fn()
    except Exception as err:  # a backend that cannot run this shape is reported, not fatal
        print(f"  skipped: {type(err).__name__}: {str(err)[:200]}")
        return None


def bench_shape(n, d, v, *, with_pallas, with_ref, fwdbwd, reps):
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (v, d), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    t = jax.random.randint(k[2], (n,), 0, v, jnp.int32)
    flops = 2.0 * n * d * v
    row = {"N": n, "D": d, "V": v}

    gemm = jax.jit(lambda h, w: jax.lax.dot_general(h, w, (((1,), (1,)), ((), ()))))

    def fwd(backend):
        return jax.jit(
            lambda h, w, t: jk.linear_logprobs(h, w, t, return_entropy=True, backend=backend)
        )

    fns = {"gemm": (gemm, (h, w)), "ffi": (fwd("ffi"), (h, w, t))}
    if with_ref:
        fns["jnp"] = (fwd("reference"), (h, w, t))
    if with_pallas:
        fns["pallas"] = (fwd("pallas"), (h, w, t))
    times = per_call_ms(fns, reps=reps)
    for name, ms in times.items():
        row[f"{name}_ms"] = ms
    row["ffi_over_gemm"] = row["ffi_ms"] / row["gemm_ms"]
    row["ffi_tflops"] = flops / (row["ffi_ms"] * 1e-3) / 1e12
    row["gemm_tflops"] = flops / (row["gemm_ms"] * 1e-3) / 1e12
    if extension.sm90 is not None:
        plan = extension.sm90.plan(n, v, jax.devices()[0].core_count)
        row["ffi_splits"] = plan["splits"]
        row["ffi_scratch_mib"] = plan["partials_bytes"] / 2**20
    if with_ref:
        row["jnp_temp_mib"] = _safe(lambda: common.temp_mib(fns["jnp"][0], h, w, t))
    if fwdbwd:
        loss = lambda h, w: jnp.sum(jk.linear_logprobs(h, w, t, backend="ffi"))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        ms = per_call_ms({"grad": (grad, (h, w))}, reps=3, trials=3)["grad"]
        row["ffi_fwdbwd_ms"] = ms
        if ms:
            row["ffi_fwdbwd_tflops"] = 3 * flops / (ms * 1e-3) / 1e12
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    output.output_arguments(ap)
    ap.add_argument("--quick", action="store_true", help="first shape only, no fwd+bwd")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    why = ffi.unavailable_reason()
    if why:
        raise SystemExit(f"bench_ffi: ffi unavailable: {why}")
    with_pallas = "pallas" in jk.available_backends("linear_logprobs")
    print(
        f"bench_ffi: {jax.devices()[0].device_kind}, pallas {'on' if with_pallas else 'off'}, "
        f"{extension.sm90.build_info()}"
    )
    rows = []
    for n, d, v in SHAPES[:1] if args.quick else SHAPES:
        row = bench_shape(
            n, d, v, with_pallas=with_pallas, with_ref=True, fwdbwd=not args.quick, reps=args.reps
        )
        print(row, flush=True)
        rows.append(row)
    cols = [
        "N",
        "D",
        "V",
        "gemm_ms",
        "ffi_ms",
        "ffi_over_gemm",
        "ffi_tflops",
        "gemm_tflops",
        "jnp_ms",
        "pallas_ms",
        "ffi_fwdbwd_ms",
        "ffi_fwdbwd_tflops",
        "ffi_splits",
        "ffi_scratch_mib",
        "jnp_temp_mib",
    ]
    print(common.write_results("ffi", rows, cols))


if __name__ == "__main__":
    main()
