"""Command line: ``python -m jaxrl_kernels.demo [--algo grpo] [--out DIR] [--resume DIR] ...``.

One flag per field of :class:`~jaxrl_kernels.demo.train.Config`, its help text taken
from the field. Every mistake the command line can catch (a bad value, an impossible
model, a missing or foreign checkpoint, a flag that contradicts the checkpoint being
resumed, a backend that cannot run here) ends the program with one line on stderr
and exit status 2, before anything is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import jax
import jax.numpy as jnp

import jaxrl_kernels as jk
from jaxrl_kernels.demo import checkpoint, train
from jaxrl_kernels.dispatch import BACKENDS

PROG = "python -m jaxrl_kernels.demo"
BACKEND_ENV = "JAXRL_KERNELS_BACKEND"  # the backend override of every op (docs/api.md)
RL_GROUP = "RL algorithm and loss"  # the title of RLConfig's fields, which name no group


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line on stderr, not the usage block."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        argument_default=argparse.SUPPRESS,
        description="Warm-start a small Flax transformer on addition, then fine-tune it with "
        "RL through jaxrl_kernels' fused ops; prints held-out accuracy before and "
        "after. --algo distill then distils a smaller student from that model. "
        "Defaults are in brackets.",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for field in dataclasses.fields(train.Config):
        title = field.metadata.get("group", RL_GROUP)
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title]
        helptext, default = field.metadata["help"], field.default
        if field.name == "tie_embeddings":
            group.add_argument(
                "--untied-head",
                dest="tie_embeddings",
                action="store_false",
                help="a separate [D, V] LM head (layout 'dv') instead of the tied "
                "[V, D] token embedding (layout 'vd')",
            )
            continue
        if field.name == "pack":
            group.add_argument("--pack", action="store_true", help=helptext)
            continue
        kind = field.metadata.get("type") or {int: int, float: float}.get(type(default), str)
        kwargs = {
            "help": helptext if default is None else f"{helptext} [{default}]",
            "metavar": field.metadata.get("metavar") or {int: "N", float: "X"}.get(kind),
        }
        if "choices" in field.metadata:
            kwargs["choices"] = field.metadata["choices"]
            kwargs["metavar"] = "{" + ",".join(field.metadata["choices"]) + "}"
        group.add_argument(train.flag(field.name), type=kind, **kwargs)
    run_group = groups["run"]
    run_group.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    return parser


def parse_args(argv=None):
    """``(Config, progress)`` from the command line; exits with one line on any mistake."""
    parser = _parser()
    given = vars(parser.parse_args(argv))
    progress = given.pop("progress", True)
    env = os.environ.get(BACKEND_ENV)
    if env and env not in BACKENDS:
        parser.error(
            f"environment variable {BACKEND_ENV}={env!r} is not a backend; "
            f"valid: {', '.join(BACKENDS)}"
        )
    try:
        if "resume" in given:
            cfg = train.resume_config(given.pop("resume"), **given)
        else:
            cfg = train.Config(**given)
    except checkpoint.CheckpointError as err:
        parser.error(f"--resume: {err}")
    except ValueError as err:
        parser.error(_with_flag(str(err)))
    ops = {"linear_logprobs": ""}
    if cfg.algo == "distill":
        for op in _distill_ops(cfg):
            ops[op] = f" for --algo distill ({op})"
    for op, what in ops.items():
        if cfg.backend is not None and cfg.backend not in jk.available_backends(op):
            parser.error(
                f"--backend {cfg.backend}: cannot run here{what}; available: "
                f"{', '.join(jk.available_backends(op))}"
            )
    if cfg.algo == "distill" and cfg.backend is not None:
        for op in _distill_ops(cfg):
            why = _distill_refusal(cfg.backend, op)
            if why:
                parser.error(
                    f"--backend {cfg.backend}: cannot run --algo distill's float32 "
                    f"heads ({op}): {why}"
                )
    return cfg, progress


def _distill_ops(cfg: train.Config) -> tuple[str, ...]:
    """The ops ``--algo distill`` runs on its backend: ``linear_distill_loss`` (the loss, or
    with a served teacher the divergence reported), and with one ``linear_topk_logprobs``
    (the teacher's reply) and ``linear_topk_distill_loss`` (the loss)."""
    served = ("linear_topk_logprobs", "linear_topk_distill_loss") if cfg.teacher_topk else ()
    return ("linear_distill_loss",) + served


def _distill_refusal(backend: str, op: str = "linear_distill_loss") -> str | None:
    """Why ``backend`` cannot run ``op`` as the demo's distillation calls it (float32 heads),
    traced abstractly; None if it can."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    h, w, mask = f32(1, 2, 8), f32(16, 8), f32(1, 2)
    ids = jax.ShapeDtypeStruct((1, 2, 4), jnp.int32)
    calls = {
        "linear_distill_loss": (
            lambda *a: jk.linear_distill_loss(*a, backend=backend),
            (h, w, h, w, mask),
        ),
        "linear_topk_logprobs": (
            lambda *a: jk.linear_topk_logprobs(*a, 4, backend=backend),
            (h, w),
        ),
        "linear_topk_distill_loss": (
            lambda *a: jk.linear_topk_distill_loss(*a, backend=backend),
            (h, w, ids, f32(1, 2, 4), mask),
        ),
    }
    fn, args = calls[op]
    try:
        jax.eval_shape(fn, *args)
    except NotImplementedError as err:
        return str(err).split(": ", 2)[-1].splitlines()[0]
    return None


def _with_flag(message: str) -> str:
    """``"d_model: expected ..."`` -> ``"--d-model: expected ..."`` (the name the user typed)."""
    match = re.match(r"(\w+): ", message)
    if match and match.group(1) in {f.name for f in dataclasses.fields(train.Config)}:
        return train.flag(match.group(1)) + message[match.end() - 2 :]
    return message


def main(argv=None) -> int:
    cfg, progress = parse_args(argv)
    try:
        with jk.use_backend(cfg.backend):
            train.run(cfg, progress=progress)
    except NotImplementedError as err:  # an explicit backend that cannot serve these inputs
        print(f"{PROG}: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
