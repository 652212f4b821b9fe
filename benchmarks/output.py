"""Where the benchmark scripts write their result files; no jax here, so that a driver
process that only launches workers can use it.

By default a scratch directory, ``out/bench`` under the working directory, so that running a
benchmark never overwrites the committed results. ``--out DIR`` (or ``BENCH_RESULTS=DIR``)
chooses another; ``--update-results`` writes ``benchmarks/results/`` (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import pathlib

RESULTS = pathlib.Path(__file__).parent / "results"
"""The committed results (benchmarks/results/README.md indexes them)."""
SCRATCH = pathlib.Path("out") / "bench"
"""Where results go by default, relative to the working directory."""


class _OutDir(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        os.environ["BENCH_RESULTS"] = str(values)  # also seen by worker processes
        setattr(namespace, self.dest, values)


class _UpdateResults(argparse.Action):
    def __init__(self, **kwargs):
        super().__init__(nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        os.environ["BENCH_RESULTS"] = str(RESULTS)
        setattr(namespace, self.dest, True)


def output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` and ``--update-results``: where :func:`write_results` writes."""
    group = parser.add_argument_group("results")
    group.add_argument(
        "--out",
        metavar="DIR",
        action=_OutDir,
        help=f"write the result files here [BENCH_RESULTS, else {SCRATCH}]",
    )
    group.add_argument(
        "--update-results",
        action=_UpdateResults,
        default=False,
        help="write them to benchmarks/results/, the committed results",
    )


def results_dir() -> pathlib.Path:
    """``--out`` / ``BENCH_RESULTS``, else ``$OUT`` (set by some batch job runners), else the
    scratch directory ``out/bench``. ``--update-results`` means benchmarks/results."""
    out = os.environ.get("BENCH_RESULTS") or os.environ.get("OUT")
    path = pathlib.Path(out) if out else SCRATCH
    path.mkdir(parents=True, exist_ok=True)
    return path
