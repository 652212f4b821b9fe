"""memory="fast" (logits kept for the backward, 3 GEMMs): its settings side by side, one process.

Question: which fast-mode settings (``benchmarks/studies/variants/fast_mode.py``: kept dtype,
one- or two-pass lse, vocabulary blocks in the backward, float16 gradient) gives the fastest
forward+backward at what memory and accuracy, against the same run's lean path (automatic
backend) and the plain bf16-logits jnp code.

The problem is the side-by-side one (``side_by_side.shared``): bf16 h [N, D], W [V, D],
L = Σ g·logp; errors against its float64 gradients (``side_by_side.exact``, run first in its own
process). Each variant: ``jax.jit(jax.grad(L, (h, w)))``, XLA's temp size, then the median of
synchronised calls by the host clock, in ``--rounds`` rounds whose order rotates. At the second
size (N=8192, D=4096) no exact gradients are computed (errors left empty).

    PYTHONPATH=$PWD python3 -m benchmarks.studies.bench_fast_mode            # GPU, about 3 min
    PYTHONPATH=$PWD python3 -m benchmarks.studies.bench_fast_mode --smoke    # any device, seconds

Results: ``bench_fast_mode.{json,md}`` in out/bench (``--out``, ``--update-results``:
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

from benchmarks import output

COLUMNS = [
    "variant",
    "layout",
    "N",
    "D",
    "V",
    "fwdbwd_ms",
    "spread_ms",
    "temp_mib",
    "err_dh",
    "err_dW",
    "note",
    "error",
]

VARIANTS = {  # name -> (variants.fast_mode.Config kwargs, layouts)
    "fast default": ({}, ("vd", "dv")),
    "fast kept bfloat16": ({"kept": "bfloat16"}, ("vd", "dv")),
    "fast one-pass lse": ({"lse": "one_pass"}, ("vd",)),
    "fast 8 vocab blocks": ({"vocab_blocks": 8}, ("vd",)),
    "fast float16 gradient": ({"grad": "float16"}, ("vd", "dv")),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    from benchmarks.side_by_side import shared
    from benchmarks.workers import failure, run_worker

    size = "smoke" if args.smoke else "full"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_fast_"))
    data_path = tmp / "inputs.npz"
    code, tail = run_worker(
        "benchmarks.side_by_side.exact",
        ["--out", str(data_path), "--size", size] + (["--chunk", "384"] if args.smoke else []),
        sys.executable,
        300,
    )
    if code != 0:
        raise SystemExit("exact gradients: " + failure(code, tail, 300))

    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk
    from benchmarks import common
    from benchmarks.side_by_side.jax_worker import jnp_bf16_materialised, rel_err
    from benchmarks.studies.variants import fast_mode

    data = shared.load_inputs(data_path)
    h = jnp.asarray(data["h_bits"].view(jnp.bfloat16))
    w = jnp.asarray(data["w_bits"].view(jnp.bfloat16))
    t = jnp.asarray(data["t"])
    g = jnp.asarray(data["g"])
    exact = (jnp.asarray(data["exact_dh"]), jnp.asarray(data["exact_dw"]))
    n, d, v = (int(x) for x in data["size"])
    del data

    def fast(config):
        def logp(h, w, t, layout):
            return fast_mode.fast_linear_logprobs(
                h,
                w,
                None,
                t,
                jnp.ones(t.shape, bool),
                weight_layout=layout,
                temperature=1.0,
                return_entropy=False,
                config=config,
            )[0]

        return logp

    def lean(h, w, t, layout):
        return jk.linear_logprobs(h, w, t, weight_layout=layout)

    def plain(h, w, t, layout):
        assert layout == "vd"
        return jnp_bf16_materialised(h, w, t)

    cases = [
        ("lean (automatic backend)", lean, "vd", ""),
        ("lean (automatic backend)", lean, "dv", ""),
        ("jnp bf16 logits", plain, "vd", "bf16 logits, float32 log_softmax"),
    ]
    for name, (kw, layouts) in VARIANTS.items():
        config = fast_mode.Config(**kw)
        cases += [(name, fast(config), lay, str(config)) for lay in layouts]

    def build(logp, layout, h, w, t, g):
        def loss(h, w):
            return jnp.sum(g * logp(h, w, t, layout))

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    def measure(cases, h, w, t, g, exact, sizes):
        w_dv = jax.block_until_ready(jnp.asarray(w.T))
        rows, fns = [], []
        for name, logp, layout, note in cases:
            weight = w if layout == "vd" else w_dv
            row = {"variant": name, "layout": layout, **sizes, "note": note}
            try:
                fn = build(logp, layout, h, weight, t, g)
                row["temp_mib"] = (
                    fn.lower(h, weight).compile().memory_analysis().temp_size_in_bytes / 2**20
                )
                dh, dw = fn(h, weight)
                if exact is not None:
                    row["err_dh"] = float(rel_err(dh, exact[0]))
                    row["err_dW"] = float(rel_err(dw.T if layout == "dv" else dw, exact[1]))
                del dh, dw
                fns.append((row, fn, (h, weight)))
            except Exception as err:  # report it in the row, keep the others
                row["error"] = shared.error_text(err)
            rows.append(row)
            print("compiled:", row, flush=True)
        times = {id(r): [] for r, _, _ in fns}
        for row, fn, fargs in common.in_rotation(fns, args.rounds):
            common.warm_up(fn, *fargs, seconds=0.3 if not args.smoke else 0.0)
            times[id(row)].append(common.median_ms(fn, *fargs, warmup=1, runs=args.runs))
        for row, _, _ in fns:
            rounds = common.Timing(tuple(times[id(row)]))
            row["fwdbwd_ms"], row["spread_ms"] = rounds.median, rounds.spread
            print("timed:", row, flush=True)
        return rows

    start = time.time()
    rows = measure(cases, h, w, t, g, exact, {"N": n, "D": d, "V": v})
    if not args.smoke:
        del h, w
        key = jax.random.key(1)
        nb, db = 8192, 4096
        kh, kw, kt, kg = jax.random.split(key, 4)
        hb = jax.random.normal(kh, (nb, db), jnp.bfloat16)
        wb = (jax.random.normal(kw, (v, db), jnp.float32) * (shared.WEIGHT_STD / db**0.5)).astype(
            jnp.bfloat16
        )
        tb = jax.random.randint(kt, (nb,), 0, v)
        gb = jax.random.normal(kg, (nb,), jnp.float32)
        big = [
            c
            for c in cases
            if c[0]
            in ("lean (automatic backend)", "jnp bf16 logits", "fast default", "fast kept bfloat16")
        ]
        rows += measure(big, hb, wb, tb, gb, None, {"N": nb, "D": db, "V": v})
    print(f"total {time.time() - start:.0f} s")
    print(common.write_results("bench_fast_mode", rows, COLUMNS))


if __name__ == "__main__":
    main()
