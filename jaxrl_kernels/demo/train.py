"""The demo's entry point: :func:`run` runs the configured algorithm end to end.

The RL algorithms run :func:`jaxrl_kernels.demo.loop.run` (warm start, RL, evaluation,
report, resumable from a checkpoint); ``--algo distill`` runs
:func:`jaxrl_kernels.demo.distill.run` (a teacher trained by that loop, then on-policy
distillation of a smaller student).

The configuration (:class:`Config`, :func:`flag`, :func:`resume_config`) is
:mod:`jaxrl_kernels.demo.config`'s, the loop's pieces (:class:`Demo`, :func:`peak_memory`) are
:mod:`jaxrl_kernels.demo.loop`'s and its report (:func:`format_table`, :func:`plot`,
:func:`write_outputs`, :func:`save_figure`) :mod:`jaxrl_kernels.demo.report`'s, re-exported
here.
"""

from __future__ import annotations

from typing import Any, TextIO

from jaxrl_kernels.demo import algos, distill, loop
from jaxrl_kernels.demo.config import Config, _check_resumable, flag, resume_config  # noqa: F401
from jaxrl_kernels.demo.loop import Demo, peak_memory  # noqa: F401
from jaxrl_kernels.demo.report import format_table, plot, save_figure, write_outputs  # noqa: F401


def run(cfg: Config, *, progress: bool = True, stream: TextIO | None = None) -> dict[str, Any]:
    """Run the demo end to end; returns the log (also written under ``cfg.out``).

    With ``cfg.resume`` (build such a config with :func:`resume_config`) the run continues
    the checkpoint's: its state, and its log, which the new steps extend. ``--algo distill``
    runs :func:`jaxrl_kernels.demo.distill.run`, every other algorithm
    :func:`jaxrl_kernels.demo.loop.run`.
    """
    if cfg.algo == algos.DISTILL:
        return distill.run(cfg, progress=progress, stream=stream)
    return loop.run(cfg, progress=progress, stream=stream)
