"""The lean backward's chunks: where its time goes, and what the chunk width and the weight
copy's placement do.

Question: at N = 256 … 4096 tokens (``--sizes full``) and 8192 … 16384 (``--sizes large``),
how much of lean's forward + backward (``linear_grpo_loss``, bf16, the ffi kernels) is spent
in each kind of kernel, and how does that change when the backward's vocabulary chunks are
``columns`` wide rather than the default's width (``ffi.linear.backward_chunk``), and with
the float16 weight copy in the grad kernel or apart (``ffi.linear.Config.weight_copy``:
``copy``)? And at the row counts of a padded batch's row-skipping branches where d_hidden's
unsplit GEMM fills its last wave of tiles worst (``--sizes branches``): K split by the
automatic rule (``tiles`` ``auto``: ``hidden_plan`` in csrc/sm90_gemm_hidden.cu splits K
there) against unsplit tiles 256 or 128 columns wide (``ffi.linear.Config.hidden_tiles``:
``wide``, the rule before it split there, or ``narrow``). Each row is
``jax.jit(jax.value_and_grad(loss, (hidden, weight)))`` on the inputs of
``benchmarks.studies.bench_fast_loss``, timed as ``bench_tokens`` times it (median of
``--runs`` synchronised calls, rotated rounds), next to the plain jnp bf16 code and the three
GEMMs of the same run; the per-kernel columns are the mean device time per call of one
profiler trace of 3 calls, by kernel:

- ``fwd``: the forward kernel (logits' statistics); ``grad``: the backward's grad kernel
  (recomputed logits → their gradient G, and the float16 weight copy when it is in the
  kernel); ``copy``: the weight copy's own kernel; ``absmax``: the first chunk's max |W|;
- ``gemm_dh``: d_hidden's CUTLASS GEMM (``gemm_dh_splitk`` when it splits K); ``gemm_dw``:
  d_weight's; ``other``: the rest (XLA's fusions, memsets);
- ``chunk``: the backward's chunk width in columns, ``chunks`` their number.

    python -m benchmarks.studies.bench_lean_chunks --runs 10     # GPU (Hopper: the ffi kernels)
    python -m benchmarks.studies.bench_lean_chunks --runs 10 --sizes large
    python -m benchmarks.studies.bench_lean_chunks --runs 10 --sizes branches
"""

from __future__ import annotations

import contextlib

COLUMNS = [
    "impl",
    "copy",
    "columns",
    "tiles",
    "N",
    "D",
    "V",
    "chunk",
    "chunks",
    "fwdbwd_ms",
    "x_jnp",
    "temp_mib",
    "fwd",
    "grad",
    "copy_ms",
    "absmax",
    "gemm_dh",
    "gemm_dh_splitk",
    "gemm_dw",
    "other",
]
SIZES = {
    "full": [(n, 2048, 131072) for n in (256, 512, 1024, 2048, 4096)] + [(512, 4096, 131072)],
    "large": [(8192, 4096, 131072), (16384, 4096, 131072)],
    # 160 wide tiles at 2560 x 2048 fill 61 % of two waves of 132, 320 narrow ones 81 % of
    # three, K in 4 parts 97 % of five; 3072 x 2048 and 1536 x 4096 alike; 4096 x 2048 (97 %
    # wide, unsplit) is the control. The fourth entry asks for the TILES rows.
    "branches": [
        (n, d, 131072, "tiles") for n, d in ((2560, 2048), (3072, 2048), (1536, 4096), (4096, 2048))
    ],
    "small": [(64, 32, 1000)],
}
VARIANTS = (
    ("auto", 0),
    ("in_kernel", 0),
    ("apart", 0),
    ("auto", 8192),
    ("auto", 16384),
    ("auto", 32768),
)
"""(weight copy, columns) of the lean rows up to :data:`LARGE_N` rows."""
LARGE_N = 4096
LARGE_VARIANTS = (("auto", 0), ("auto", 2048), ("auto", 4096), ("auto", 16384))
"""(weight copy, columns) of the lean rows above :data:`LARGE_N` rows. There a byte budget
alone would narrow the chunk (64 MiB of float16 is 2048 columns at 16384 rows), and
d_hidden's GEMM reads and writes its float32 accumulator ``[N, D]`` once per chunk, so
narrow chunks add traffic that no GEMM hides: 2048 and 4096 are what the budget alone gives
at 16384 and 8192 rows (``ffi.linear.MIN_CHUNK_COLUMNS`` keeps the default wider)."""
TILES = ("auto", "wide", "narrow")
"""d_hidden's tile widths of the ``branches`` rows (the default chunks and weight copy)."""


@contextlib.contextmanager
def lean_variant(copy: str, columns: int, tiles: str = "auto"):
    """While tracing: the ffi backward's weight copy ``copy``, chunks of ``columns`` columns
    (at most V; 0: the default's) and d_hidden's tiles ``tiles``."""
    import dataclasses

    from jaxrl_kernels.backends.ffi import linear as ffi_linear
    from jaxrl_kernels.head import head_grad

    original, config = head_grad.chunk_columns, ffi_linear.DEFAULT_CONFIG

    def pinned(n_rows, vocab, chunk_bytes, align, *rest, **options):
        if not columns:
            return original(n_rows, vocab, chunk_bytes, align, *rest, **options)
        return min(vocab, columns - columns % align)

    head_grad.chunk_columns = pinned
    ffi_linear.DEFAULT_CONFIG = dataclasses.replace(config, weight_copy=copy, hidden_tiles=tiles)
    try:
        yield
    finally:
        head_grad.chunk_columns, ffi_linear.DEFAULT_CONFIG = original, config


def measure(size, runs, rounds, small):
    import jax

    from benchmarks import common
    from benchmarks.bench_tokens import inputs, losses, three_gemms
    from jaxrl_kernels.backends.ffi import linear as ffi_linear

    n, d, v, *tiled = size
    args = inputs(n, d, v)
    loss = losses()
    steps = []
    for impl in ("jnp bf16", "3 GEMMs"):
        fn = (
            jax.jit(three_gemms)
            if impl == "3 GEMMs"
            else jax.jit(jax.value_and_grad(loss[impl], argnums=(0, 1)))
        )
        steps.append(
            (
                {"impl": impl, "copy": "", "columns": "", "tiles": "", "N": n, "D": d, "V": v},
                fn.lower(*args).compile(),
            )
        )
    if tiled:
        variants = [("auto", 0, tiles) for tiles in TILES]
    else:
        variants = [(*pair, "auto") for pair in (LARGE_VARIANTS if n > LARGE_N else VARIANTS)]
    for copy, columns, tiles in variants:
        with lean_variant(copy, columns, tiles):
            chunk = ffi_linear.backward_chunk(n, v)
            compiled = (
                jax.jit(jax.value_and_grad(loss["ours lean"], argnums=(0, 1)))
                .lower(*args)
                .compile()
            )
        row = {
            "impl": "ours lean",
            "copy": copy,
            "columns": columns,
            "tiles": tiles,
            "N": n,
            "D": d,
            "V": v,
            "chunk": chunk,
            "chunks": -(-v // chunk),
            "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        }
        steps.append((row, compiled))
    common.rotated_ms(steps, args, runs=runs, rounds=rounds, warm_seconds=0.0 if small else 0.3)
    jnp_ms = steps[0][0]["fwdbwd_ms"]
    rows = []
    for row, fn in steps:
        row["x_jnp"] = row["fwdbwd_ms"] / jnp_ms
        if row["impl"] == "ours lean" and not small:
            row.update(common.kernel_ms(fn, args, common.KERNELS))
        print(row, flush=True)
        rows.append(row)
    del args, steps
    if not small:
        jax.clear_caches()
    return rows


def main(argv=None):
    from benchmarks import common

    return common.sized_main(
        argv,
        description=__doc__.split("\n")[0],
        sizes=SIZES,
        name="bench_lean_chunks",
        columns=COLUMNS,
        measure=measure,
        rounds=3,
    )


if __name__ == "__main__":
    main()
