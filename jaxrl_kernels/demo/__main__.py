"""Command line: ``python -m jaxrl_kernels.demo [--algo grpo] [--out DIR] ...``."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxrl_kernels.demo.algos import ALGOS

_HELP = {
    "algo": "RL algorithm",
    "digits": "digits per operand of the addition task",
    "held_out": "number of operand pairs held out for evaluation",
    "d_model": "model width",
    "layers": "transformer layers",
    "heads": "attention heads",
    "warmup_steps": "supervised warm-start steps (kept short on purpose)",
    "warmup_batch": "warm-start batch size",
    "warmup_lr": "warm-start learning rate",
    "steps": "RL steps",
    "batch_size": "prompts per RL step",
    "group_size": "answers sampled per prompt",
    "lr": "RL learning rate (adamw, global-norm clipping 1.0)",
    "lr_warmup": "RL steps over which the learning rate ramps up from 0",
    "temperature": "sampling temperature (the losses score the same tempered policy)",
    "kl_coef": "KL coefficient to the frozen warm-start policy (grpo, ppo)",
    "clip_low": "PPO/GRPO ratio clip below 1",
    "clip_high": "PPO/GRPO ratio clip above 1",
    "dual_clip": "PPO dual clip constant (> 1)",
    "tis_cap": "PPO truncated importance sampling cap against the sampler's log-probs",
    "ppo_epochs": "PPO passes over each rollout batch",
    "ppo_minibatches": "PPO minibatches per pass",
    "eval_every": "held-out evaluation every N RL steps",
    "seed": "random seed",
    "backend": "jaxrl_kernels backend for every op (default: automatic)",
    "out": "write log.json, curves.png and checkpoint.msgpack here",
    "resume": "continue RL from a checkpoint.msgpack written by --out",
}


def parse_args(argv=None):
    from jaxrl_kernels.demo.train import Config

    parser = argparse.ArgumentParser(
        prog="python -m jaxrl_kernels.demo",
        description="Warm-start a small Flax transformer on addition, then fine-tune it with "
                    "RL using jaxrl_kernels' fused ops; prints held-out accuracy before/after.")
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        if field.name == "tie_embeddings":
            parser.add_argument("--untied-head", dest="tie_embeddings", action="store_false",
                                help="separate [D, V] LM head (layout 'dv') instead of the "
                                     "tied [V, D] embedding (layout 'vd')")
            continue
        kind = {bool: bool, int: int, float: float}.get(type(default), str)
        kwargs = {"default": default, "help": f"{_HELP.get(field.name, '')} (default: {default})"}
        if field.name == "algo":
            kwargs["choices"] = ALGOS
        if field.name == "backend":
            kwargs["choices"] = ("reference", "chunked", "pallas", "ffi")
        parser.add_argument(flag, type=kind, **kwargs)
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar")
    args = vars(parser.parse_args(argv))
    progress = args.pop("progress")
    return Config(**args), progress


def main(argv=None) -> int:
    cfg, progress = parse_args(argv)
    import jaxrl_kernels as jrk
    from jaxrl_kernels.demo.train import run

    with jrk.use_backend(cfg.backend):
        run(cfg, progress=progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
