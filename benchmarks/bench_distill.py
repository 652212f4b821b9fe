"""Distillation between two LM heads: ``linear_distill_loss`` against the materialised divergence.

Question: how long does a forward+backward of the per-token divergence take, with how much
extra memory, against (a) the plain jnp code that materialises both heads' logits (bf16
logits, float32 softmaxes, jax.grad), (b) the GEMMs our schedule needs, alone (the 1.15×
goal), and (c) Liger's ``fused_linear_jsd`` (torch, its own process) where it imports? Ours in both
memory modes: ``"lean"`` (the chunked backend) and ``"fast"`` (``jaxrl_kernels.engine.fused_distill``:
the gradient taken in the forward, ``3 S + T`` GEMMs like the materialised code).

Problem: N tokens, student h [N, D_s] and W [V, D_s], teacher h_t [N, D_t] and W_t [V, D_t],
bf16, L = loss (token_mean over N tokens), gradients to the student's h and W. GEMMs per
forward+backward (``backends/chunked/distill.py``): ``4 S + 2 T`` for either KL, ``5 S + 3 T``
for the JSD, with ``S = 2·N·V·D_s`` and ``T = 2·N·V·D_t`` flops. The "GEMMs alone, chunked"
rows run exactly those GEMMs over the same vocabulary chunks (bf16 forward operands, float16
backward ones, float32 accumulation) and nothing else; the "GEMMs each alone" rows add up
the four distinct GEMMs timed one at a time at full size (:func:`each_gemm_ms`), for the
lean schedule and for the ``3 S + T`` one: the GEMM time each schedule cannot go below.
Each row: XLA's temp size of the compiled ``jax.jit(jax.grad(L, (h, W)))`` ("extra memory":
neither inputs nor outputs; with ``--peak`` also the device's peak bytes in use less inputs
and gradients, one process per row, compiled without GEMM autotuning, whose trial buffers
would set the peak before the run), then the median of synchronised calls by the host
clock, in ``--rounds`` rounds whose order rotates.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_distill            # GPU: N=4096, D_s=2048,
                                                                   # D_t=4096, V=151936
    PYTHONPATH=$PWD python3 -m benchmarks.bench_distill --small    # any device, seconds

Results: ``bench_distill.{json,md}`` in out/bench (``--out``, ``--update-results``:
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time

from benchmarks import output

COLUMNS = [
    "variant",
    "divergence",
    "N",
    "D_s",
    "D_t",
    "V",
    "fwdbwd_ms",
    "spread_ms",
    "fwd_ms",
    "temp_mib",
    "peak_extra_mib",
    "gemm_tflop",
    "tflops",
    "loss",
    "note",
    "error",
]
SIZES = {
    "full": dict(N=4096, D_s=2048, D_t=4096, V=151936),
    "small": dict(N=64, D_s=32, D_t=64, V=1000),
}
DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")
LOGIT_STD = 2.0  # std of every logit: W ~ N(0, (LOGIT_STD² / D)) against h ~ N(0, 1)


def gemm_count(divergence: str) -> tuple[int, int]:
    """(student GEMMs, teacher GEMMs) per forward+backward of our chunked schedule."""
    return (5, 3) if divergence == "jsd" else (4, 2)


def inputs(size: dict, seed: int = 0):
    import functools

    import jax
    import jax.numpy as jnp

    n, ds, dt, v = size["N"], size["D_s"], size["D_t"], size["V"]
    keys = jax.random.split(jax.random.key(seed), 4)

    def draw(key, shape, std=1.0):
        """Drawn in row blocks into a bf16 array (donated, written in place): the device
        holds the array and one block's 32-bit draw. A whole-array draw passes through
        32-bit [V, D] temporaries, which set the --peak rows' peak before the program runs
        (3015 MiB on an H100 at the default size); drawing on the host takes minutes."""
        rows, cols = math.prod(shape[:-1]), shape[-1]
        block = min(rows, 8192)

        @functools.partial(jax.jit, donate_argnums=0)
        def fill(out):
            def body(i, out):
                x = jax.random.normal(jax.random.fold_in(key, i), (block, cols), jnp.float32)
                start = jnp.minimum(i * block, rows - block)
                return jax.lax.dynamic_update_slice_in_dim(
                    out, (x * std).astype(jnp.bfloat16), start, axis=0
                )

            return jax.lax.fori_loop(0, -(-rows // block), body, out)

        return fill(jnp.zeros((rows, cols), jnp.bfloat16)).reshape(shape)

    h, w = draw(keys[0], (1, n, ds)), draw(keys[1], (v, ds), LOGIT_STD / ds**0.5)
    th, tw = draw(keys[2], (1, n, dt)), draw(keys[3], (v, dt), LOGIT_STD / dt**0.5)
    return h, w, th, tw, jnp.ones((1, n), jnp.float32)


def materialised(divergence: str, beta: float = 0.5):
    """The plain jnp code: bf16 logits [N, V] of both heads, float32 log-softmaxes."""
    import jax
    import jax.numpy as jnp

    def loss(h, w, th, tw, mask):
        zs = (h @ w.T).astype(jnp.float32)  # bf16 GEMM output, upcast
        zt = jax.lax.stop_gradient((th @ tw.T).astype(jnp.float32))
        ls, lt = jax.nn.log_softmax(zs, -1), jax.nn.log_softmax(zt, -1)
        ps, pt = jnp.exp(ls), jnp.exp(lt)
        if divergence == "reverse_kl":
            d = jnp.sum(ps * (ls - lt), -1)
        elif divergence == "forward_kl":
            d = jnp.sum(pt * (lt - ls), -1)
        else:
            lm = jnp.logaddexp(jnp.log(beta) + lt, jnp.log1p(-beta) + ls)
            d = jnp.sum(beta * pt * (lt - lm) + (1 - beta) * ps * (ls - lm), -1)
        return jnp.sum(d * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss


def ours(divergence: str, memory: str = "lean", backend: str = "chunked"):
    import jaxrl_kernels as jk

    route = dict(backend=backend) if memory == "lean" else dict(memory=memory)
    config = jk.DistillLoss(divergence=divergence)

    def loss(h, w, th, tw, mask):
        return jk.linear_distill_loss(h, w, th, tw, mask, config=config, **route)[0]

    return loss


def cases_for(divergence: str, size: dict) -> list[tuple]:
    """(variant, divergence, loss, note, GEMM flops) of every timed row of one divergence."""
    d = divergence
    n_s, n_t = gemm_count(d)
    flop = 2 * size["N"] * size["V"] * (n_s * size["D_s"] + n_t * size["D_t"])
    flop_3s_t = 2 * size["N"] * size["V"] * (3 * size["D_s"] + size["D_t"])
    return [
        (
            "ours (fast)",
            d,
            ours(d, "fast"),
            "memory='fast': the gradient taken in the forward, 3 S + T GEMMs",
            flop_3s_t,
        ),
        ("ours (chunked)", d, ours(d), "", flop),
        (
            "ours (ffi)",
            d,
            ours(d, backend="ffi"),
            "SM90 kernels: both heads' 128x128 tiles in registers, the row statistics and "
            "the float16 logit gradient in-kernel; XLA's backward GEMMs",
            flop,
        ),
        (
            "ours (pallas)",
            d,
            ours(d, backend="pallas"),
            "Mosaic GPU kernels: both heads' tiles and dz in-kernel, XLA's backward "
            "GEMMs; the chunked schedule",
            flop,
        ),
        (
            "jnp materialised",
            d,
            materialised(d),
            "bf16 logits [N, V] of both heads, float32 log-softmaxes, jax.grad; 3 S + T GEMMs",
            flop_3s_t,
        ),
        (
            "GEMMs alone, chunked",
            d,
            gemms_only(d),
            f"the schedule's {n_s} S + {n_t} T GEMMs, same chunks",
            flop,
        ),
    ]


def variant_loss(variant: str, divergence: str, size: dict | None = None):
    """The loss of one row of :func:`cases_for`."""
    [loss] = [c[2] for c in cases_for(divergence, size or SIZES["small"]) if c[0] == variant]
    return loss


def gemms_only(divergence: str):
    """The schedule's GEMMs over the chunked backend's vocabulary chunks and nothing else (see
    the module docstring)."""
    import jax
    import jax.numpy as jnp

    from jaxrl_kernels.head import vocab_chunks

    n_s, n_t = gemm_count(divergence)
    passes = n_t  # forward passes over the teacher: 1 (KL) or 2 (JSD), plus the recompute

    def dot(a, b, contract, out=jnp.float32):
        return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=out)

    @jax.custom_vjp
    def loss(h, w, th, tw, mask):
        return fwd(h, w, th, tw, mask)[0]

    def sizes(n, v):
        size = vocab_chunks.DISTILL_CHUNK_BYTES // (4 * n)
        size = min(v, max(128, size - size % 128))
        return size, -(-v // size)

    def forward_pass(h, w, th, tw):
        """Both heads' chunk logits, each tile passed on as the loop state (written, never
        read back: a loop iteration XLA cannot drop)."""
        n, v = h.shape[0], w.shape[0]
        size, count = sizes(n, v)
        out = jnp.float32

        def body(c, tiles):
            start = jnp.minimum(c * size, v - size)
            ws = jax.lax.dynamic_slice_in_dim(w, start, size, 0)
            wt = jax.lax.dynamic_slice_in_dim(tw, start, size, 0)
            return dot(h, ws, ((1,), (1,)), out), dot(th, wt, ((1,), (1,)), out)

        zero = jnp.zeros((n, size), out)
        zs, zt = jax.lax.fori_loop(0, count, body, (zero, zero))
        return zs[:, 0].astype(jnp.float32) + zt[:, 0].astype(jnp.float32)

    def fwd(h, w, th, tw, mask):
        h2, th2 = h[0], th[0]
        acc = sum(forward_pass(h2, w, th2, tw) for _ in range(passes - 1))
        return jnp.sum(acc) * 0.0, (h, w, th, tw)

    def bwd(res, g):
        h, w, th, tw = res
        h2, th2 = h[0], th[0]
        n, v = h2.shape[0], w.shape[0]
        size, count = sizes(n, v)
        h16 = h2.astype(jnp.float16)

        def body(c, carry):
            dh, dw = carry
            start = jnp.minimum(c * size, v - size)
            ws = jax.lax.dynamic_slice_in_dim(w, start, size, 0)
            wt = jax.lax.dynamic_slice_in_dim(tw, start, size, 0)
            out = jnp.float32
            zs = dot(h2, ws, ((1,), (1,)), out)
            zt = dot(th2, wt, ((1,), (1,)), out)
            dz = (zs.astype(jnp.float32) - zt.astype(jnp.float32)).astype(jnp.float16)
            dh = dh + dot(dz, ws.astype(jnp.float16), ((1,), (0,)))
            dw_c = dot(dz, h16, ((0,), (0,)), jnp.bfloat16)
            return dh, jax.lax.dynamic_update_slice_in_dim(dw, dw_c, start, 0)

        dh, dw = jax.lax.fori_loop(
            0, count, body, (jnp.zeros(h2.shape, jnp.float32), jnp.zeros_like(w))
        )
        return (g * dh).astype(h.dtype)[None], (g * dw).astype(w.dtype), None, None, None

    loss.defvjp(fwd, bwd)
    return loss


def each_gemm_ms(size: dict, runs: int) -> dict[str, float]:
    """Each distinct GEMM of the schedules alone at full size, as XLA runs it (cuBLAS), its
    output written in full: the student's and the teacher's logits ``S_fwd``, ``T_fwd``
    ([N, D] × [D, V], bf16 out), the student's ``d_hidden`` (float16 [N, V] × [V, D_s],
    float32 out) and ``d_weight`` (float16 [V, N] × [N, D_s], bf16 out). Their sums over a
    schedule are the GEMM time it cannot go below: the 1.15× goal's reference."""
    import jax
    import jax.numpy as jnp

    from benchmarks import common

    h, w, th, tw, _ = inputs(size)
    h, th = h[0], th[0]

    def dot(a, b, contract, out):
        return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=out)

    logits = jax.jit(lambda a, b: dot(a, b, ((1,), (1,)), jnp.bfloat16))
    g16 = logits(h, w).astype(jnp.float16)
    w16, h16 = w.astype(jnp.float16), h.astype(jnp.float16)
    gemms = {
        "S_fwd": (logits, (h, w)),
        "T_fwd": (logits, (th, tw)),
        "S_dh": (jax.jit(lambda g, b: dot(g, b, ((1,), (0,)), jnp.float32)), (g16, w16)),
        "S_dw": (jax.jit(lambda g, b: dot(g, b, ((0,), (0,)), jnp.bfloat16)), (g16, h16)),
    }
    out = {}
    for name, (fn, args) in gemms.items():
        common.warm_up(fn, *args, seconds=0.3)
        out[name] = common.median_ms(fn, *args, warmup=2, runs=runs)
        print(f"GEMM {name}: {out[name]:.3f} ms", flush=True)
    return out


def gemm_rows(size: dict, divergences: list[str], ms: dict[str, float]) -> list[dict]:
    """Rows of the schedules' GEMM time from :func:`each_gemm_ms`: the lean one (``n_s − 2``
    student and ``n_t`` teacher logit GEMMs, d_hidden, d_weight) and the ``3 S + T`` one of
    the fast mode and the materialised code."""
    rows = []
    for d in divergences:
        n_s, n_t = gemm_count(d)
        passes = n_t - 1  # forward passes (1, or 2 for the JSD); the backward recomputes once
        lean = (n_s - 2) * ms["S_fwd"] + n_t * ms["T_fwd"] + ms["S_dh"] + ms["S_dw"]
        fast = ms["S_fwd"] + ms["T_fwd"] + ms["S_dh"] + ms["S_dw"]
        for name, total, fwd, count in (
            (
                "GEMMs each alone, lean schedule",
                lean,
                passes * (ms["S_fwd"] + ms["T_fwd"]),
                (n_s, n_t),
            ),
            ("GEMMs each alone, 3 S + T", fast, ms["S_fwd"] + ms["T_fwd"], (3, 1)),
        ):
            flop = 2 * size["N"] * size["V"] * (count[0] * size["D_s"] + count[1] * size["D_t"])
            rows.append(
                {
                    "variant": name,
                    "divergence": d,
                    **size,
                    "fwdbwd_ms": total,
                    "fwd_ms": fwd,
                    "gemm_tflop": flop / 1e12,
                    "tflops": flop / 1e12 / (total * 1e-3),
                    "note": f"sum of full-size cuBLAS GEMMs timed alone: {count[0]} S + "
                    f"{count[1]} T",
                }
            )
    return rows


def peak_extra_mib(loss, args) -> float | None:
    """The device's peak bytes in use over one forward+backward, less the inputs and the
    gradients (in a fresh process: the allocator's peak is never reset). The program is
    compiled first, by a process that autotunes no GEMM (:func:`peak_in_subprocess`): the
    autotuner's trial buffers would otherwise set the peak before the program runs."""
    import jax

    from benchmarks import common

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    print("peak_after_compile_mib", common.peak_mib())
    grads = jax.block_until_ready(compiled(*args))
    peak = common.peak_mib()
    held = sum(x.nbytes for x in jax.tree.leaves((args, grads))) / 2**20
    return None if peak is None else peak - held


def peak_in_subprocess(variant: str, divergence: str, small: bool) -> float | None:
    """:func:`peak_extra_mib` of one variant, in its own process, without GEMM autotuning
    (``--xla_gpu_autotune_level=0``: cuBLAS's own choice of algorithm)."""
    import os
    import subprocess

    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_distill",
        "--peak-of",
        variant,
        "--divergences",
        divergence,
    ] + (["--small"] if small else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    print(
        f"peak of {variant} {divergence}:",
        " ".join(ln for ln in done.stdout.splitlines() if ln.startswith("peak_")),
        flush=True,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("peak_extra_mib ")]
    return float(lines[-1].split()[1]) if lines and lines[-1].split()[1] != "None" else None


def torch_rows(size: dict, timeout: int, runs: int) -> list[dict]:
    """Liger's ``fused_linear_jsd`` in its own process (``distill_torch_worker``)."""
    from benchmarks.workers import failure, run_worker

    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "rows.jsonl"
        code, tail = run_worker(
            "benchmarks.distill_torch_worker",
            ["--out", str(out), "--size", json.dumps(size), "--runs", str(runs)],
            sys.executable,
            timeout,
        )
        rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if code != 0 and not rows:
        rows = [
            {
                "variant": "liger fused_linear_jsd",
                "divergence": "jsd",
                **size,
                "error": failure(code, tail, timeout),
            }
        ]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--small", action="store_true", help="toy sizes, any device")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--divergences", default=",".join(DIVERGENCES))
    parser.add_argument("--no-torch", action="store_true", help="skip the Liger row")
    parser.add_argument(
        "--variants",
        default="",
        help="comma-separated prefixes of the variants to run (default: all)",
    )
    parser.add_argument(
        "--peak",
        action="store_true",
        help="also each row's device peak memory (one process per row)",
    )
    parser.add_argument("--peak-of", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import jax

    from benchmarks import common

    size = SIZES["small" if args.small else "full"]
    divergences = [d for d in args.divergences.split(",") if d]
    h, w, th, tw, mask = inputs(size)
    cases = [c for d in divergences for c in cases_for(d, size)]
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    cases = [c for c in cases if not wanted or any(c[0].startswith(v) for v in wanted)]
    if args.peak_of:
        [loss] = [c[2] for c in cases if c[0] == args.peak_of]
        print("peak_extra_mib", peak_extra_mib(loss, (h, w, th, tw, mask)))
        return

    rows, fns = [], []
    for name, d, loss, note, flops in cases:
        row = {"variant": name, "divergence": d, **size, "note": note, "gemm_tflop": flops / 1e12}
        try:
            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            forward = jax.jit(loss)
            row["temp_mib"] = (
                grad.lower(h, w, th, tw, mask).compile().memory_analysis().temp_size_in_bytes
                / 2**20
            )
            row["loss"] = float(forward(h, w, th, tw, mask))
            jax.block_until_ready(grad(h, w, th, tw, mask))
            fns.append((row, grad, forward))
        except Exception as err:  # report it in the row, keep the others
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        print("compiled:", row, flush=True)

    times = {id(r): [] for r, _, _ in fns}
    fwd_times = {id(r): [] for r, _, _ in fns}
    fargs = (h, w, th, tw, mask)
    start = time.time()
    for row, grad, forward in common.in_rotation(fns, args.rounds):
        common.warm_up(grad, *fargs, seconds=0.0 if args.small else 0.3)
        times[id(row)].append(common.median_ms(grad, *fargs, warmup=1, runs=args.runs))
        fwd_times[id(row)].append(common.median_ms(forward, *fargs, warmup=1, runs=args.runs))
    for row, _, _ in fns:
        rounds = common.Timing(tuple(times[id(row)]))
        row["fwdbwd_ms"], row["spread_ms"] = rounds.median, rounds.spread
        row["fwd_ms"] = common.Timing(tuple(fwd_times[id(row)])).median
        row["tflops"] = row["gemm_tflop"] / (row["fwdbwd_ms"] * 1e-3)
        print("timed:", row, flush=True)
    print(f"timing took {time.time() - start:.0f} s")
    if not wanted or any("GEMMs each alone".startswith(v) for v in wanted):
        rows += gemm_rows(size, divergences, each_gemm_ms(size, args.runs))
    del h, w, th, tw, fns
    if args.peak:
        for row in rows:
            if not row.get("error") and not row["variant"].startswith("GEMMs"):
                row["peak_extra_mib"] = peak_in_subprocess(
                    row["variant"], row["divergence"], args.small
                )
    if "jsd" in divergences and not args.no_torch:
        for row in torch_rows(size, timeout=300, runs=args.runs):
            n_s, n_t = gemm_count("jsd")
            row.setdefault(
                "gemm_tflop",
                2 * size["N"] * size["V"] * (n_s * size["D_s"] + n_t * size["D_t"]) / 1e12,
            )
            if row.get("fwdbwd_ms"):
                row["tflops"] = row["gemm_tflop"] / (row["fwdbwd_ms"] * 1e-3)
            rows.append(row)
    print(common.write_results("bench_distill", rows, COLUMNS))


if __name__ == "__main__":
    main()
