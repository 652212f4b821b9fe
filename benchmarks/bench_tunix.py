"""One tunix GRPO actor step at Qwen3-0.6B size: tunix's "grpo" loss vs our "jaxrl_grpo".

The step is tunix's own actor-trainer step body (``PeftTrainer._train_step``: nnx.value_and_grad
of the policy loss, optax global norm, optimizer update; AdamW) on a random-init bf16 Qwen3 built
from ``ModelConfig.qwen3_0p6b()`` by tunix's ``create_dummy_model``, with prompt 256 +
completion 2048 tokens per sequence, GRPOConfig defaults (beta 0.04, KL "kl",
"sequence-mean-token-mean") and reference / old log-probs given. It is jitted with the model and
optimizer state donated. Remat is DECODER by default (``--remat``): without it the attention
probabilities ([B, H, L, L] per layer, tunix's Qwen3 has no flash attention off TPU) dominate
memory for both losses.

Each loss runs in its own subprocess, so that ``peak_bytes_in_use`` belongs to it alone:

* step time (median of ``--steps`` steps after a warm-up) and peak device memory at the same
  micro-batch for both (``--time-batch``, 2), tokens/s = micro-batch * (prompt + completion) / step;
* the largest micro-batch that runs: XLA's buffer assignment at micro-batches 1 and 2
  (argument + output + temp - aliased bytes) is extrapolated linearly to the device's
  ``bytes_limit``; that micro-batch is run, then the search moves by running steps (bisection
  between the largest that ran and the smallest that ran out of memory, RESOURCE_EXHAUSTED) until
  they are adjacent, ``--max-batch`` is reached or ``--budget-s`` is spent. A result marked
  "exact" had its successor fail; otherwise it is a lower bound.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_tunix               # GPU, ~4 min on an H100
    PYTHONPATH=$PWD python3 -m benchmarks.bench_tunix --smoke       # CPU: tiny model, chunked
                                                                    # backend, 96 MiB emulated limit

Results: ``bench_tunix.{json,md}`` (``bench_tunix_smoke.*`` with ``--smoke``) in out/bench
(``--out``, ``--update-results``: benchmarks/README.md); the markdown table is also printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

from benchmarks import output

LOSSES = ("grpo", "jaxrl_grpo")
PAD_ID, EOS_ID = 0, 1
RESULT = "RESULT "
COLUMNS = ["loss", "micro_batch", "what", "step_ms", "tokens_per_s", "peak_gib", "xla_gib"]


# -- the worker: one loss, in its own process ----------------------------------------------

def qwen3_config(args):
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3

    remat = getattr(qwen3.RematConfig, args.remat.upper())
    if args.smoke:
        return qwen3.ModelConfig(num_layers=2, vocab_size=32771, embed_dim=64, hidden_dim=128,
                                 num_heads=4, head_dim=16, num_kv_heads=2, rope_theta=10_000,
                                 norm_eps=1e-6, use_tied_embedding=True, remat_config=remat,
                                 dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    config = qwen3.ModelConfig.qwen3_0p6b()
    config.remat_config = remat
    config.dtype = config.param_dtype = jnp.bfloat16
    return config


class Step:
    """tunix's actor train step for one loss, as a donated jax.jit over (model, optimizer)."""

    def __init__(self, args):
        import jax
        import optax
        from flax import nnx
        from tunix.models import dummy_model_creator
        from tunix.models.qwen3 import model as qwen3
        from tunix.rl import function_registry
        from tunix.rl import trainer as rl_trainer
        from tunix.rl.grpo import grpo_learner
        from tunix.sft import peft_trainer

        import jaxrl_kernels.integrations.tunix  # noqa: F401  (registers jaxrl_grpo)

        self.args, self.jax, self.nnx = args, jax, nnx
        self.config = qwen3_config(args)
        self.vocab = self.config.vocab_size
        self.algo = grpo_learner.GRPOConfig(num_generations=2)
        self.algo.temperature = 1.0  # what GRPOLearner copies from the rollout config
        self.example_type = grpo_learner.TrainExample
        loss_fn = function_registry.get_policy_loss_fn(args.worker)
        extra = {"backend": args.backend} if args.backend and args.worker != "grpo" else {}

        def build():
            model = dummy_model_creator.create_dummy_model(
                qwen3.Qwen3, self.config, dtype=self.config.param_dtype, scale=0.02)
            trainer = rl_trainer.Trainer(
                model, optax.adamw(1e-6), peft_trainer.TrainingConfig(eval_every_n_steps=10**9),
                custom_checkpoint_metadata_fn=dict)
            trainer.with_loss_fn(lambda model, train_example, algo_config: loss_fn(
                model, train_example, algo_config=algo_config, pad_id=PAD_ID, eos_id=EOS_ID,
                **extra), has_aux=True)
            trainer.with_gen_model_input_fn(
                lambda x: {"train_example": x, "algo_config": self.algo})
            return trainer

        self.build = build
        self.reset()

    def reset(self):
        """A fresh model and optimizer (after a failed run may have consumed donated buffers)."""
        trainer = self.build()
        self.graphdef, self.state = self.nnx.split((trainer.model, trainer.optimizer))
        graphdef = self.graphdef

        def step(state, example):
            model, optimizer = self.nnx.merge(graphdef, state)
            loss, _, grad_norm = trainer._train_step(model, optimizer, example)
            return loss, grad_norm, self.nnx.state((model, optimizer))

        self.jitted = self.jax.jit(step, donate_argnums=0)

    def example(self, batch):
        import jax.numpy as jnp
        import numpy as np

        rng = np.random.default_rng(batch)
        p, c = self.args.prompt, self.args.completion

        def logp():
            return jnp.asarray(-3.0 + 0.3 * rng.standard_normal((batch, c)), jnp.float32)

        return self.example_type(
            prompt_ids=jnp.asarray(rng.integers(2, self.vocab, (batch, p)), jnp.int32),
            prompt_mask=jnp.ones((batch, p), jnp.int32),
            completion_ids=jnp.asarray(rng.integers(2, self.vocab, (batch, c)), jnp.int32),
            completion_mask=jnp.ones((batch, c), jnp.int32),
            advantages=jnp.asarray(rng.standard_normal(batch), jnp.float32),
            ref_per_token_logps=logp(), old_per_token_logps=logp())

    def compile(self, batch):
        """(compiled, XLA's bytes: arguments + outputs + temp - aliased, compile seconds)."""
        start = time.perf_counter()
        compiled = self.jitted.lower(self.state, self.example(batch)).compile()
        m = compiled.memory_analysis()
        need = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
        return compiled, need, time.perf_counter() - start

    def run(self, compiled, batch, steps):
        """Median step ms over ``steps`` runs after one warm-up."""
        example = self.example(batch)
        times = []
        for i in range(steps + 1):
            start = time.perf_counter()
            loss, grad_norm, self.state = compiled(self.state, example)
            self.jax.block_until_ready((loss, grad_norm, self.state))
            if i:
                times.append(time.perf_counter() - start)
        if not bool(self.jax.numpy.isfinite(loss)):
            raise FloatingPointError(f"loss is {float(loss)} at micro-batch {batch}")
        return 1e3 * sorted(times)[len(times) // 2]


def out_of_memory(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory",
                                   "OOM"))


def peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def worker(args):
    import jax

    started = time.perf_counter()
    gib = 2.0**-30
    tokens = args.prompt + args.completion
    step = Step(args)
    _, limit = peak_bytes()
    limit = limit if limit is not None else args.memory_limit_mib * 2**20
    report = {"loss": args.worker, "bytes_limit_gib": limit * gib, "rows": [], "compile_s": []}

    needs = {}  # micro-batch -> XLA's bytes for the step
    failures = {}  # micro-batch -> why it does not fit

    def attempt(batch, what):
        """Compile at ``batch`` and, when XLA's buffers fit the limit, run; a row or None."""
        compiled, need, seconds = step.compile(batch)
        needs[batch] = need
        report["compile_s"].append(round(seconds, 1))
        if need > limit:
            failures[batch] = f"XLA's buffers {need * gib:.2f} GiB exceed the limit"
            print(f"{args.worker}: micro-batch {batch}: {failures[batch]}", flush=True)
            return None
        try:
            ms = step.run(compiled, batch, args.steps)
        except Exception as err:  # noqa: BLE001
            if not out_of_memory(err):
                raise
            failures[batch] = "ran out of memory (RESOURCE_EXHAUSTED)"
            print(f"{args.worker}: micro-batch {batch} {failures[batch]}", flush=True)
            step.reset()  # the failed run may have consumed the donated state
            return None
        peak, _ = peak_bytes()
        row = {"loss": args.worker, "micro_batch": batch, "what": what, "step_ms": ms,
               "tokens_per_s": batch * tokens / (ms * 1e-3),
               "peak_gib": None if peak is None else peak * gib, "xla_gib": need * gib}
        print(f"{args.worker}: {row}", flush=True)
        return row

    def next_candidate(lo, hi):
        """Where the line through two compiled points (bracketing the limit when some do)
        crosses the limit, kept inside (lo, hi)."""
        points = sorted(needs.items())
        above = [i for i, (_, n) in enumerate(points) if n > limit]
        i = max(above[0], 1) if above else len(points) - 1
        (b0, n0), (b1, n1) = points[i - 1], points[i]
        slope = (n1 - n0) / (b1 - b0)
        guess = b0 + int((limit - n0) // slope) if slope > 0 else args.max_batch
        upper = args.max_batch if hi is None else hi - 1
        return min(max(guess, lo + 1), upper)

    _, needs[1], seconds = step.compile(1)  # with the timed micro-batch: the first line
    report["compile_s"].append(round(seconds, 1))
    timed = attempt(args.time_batch, "same micro-batch")
    if timed is None:
        raise SystemExit(f"{args.worker}: micro-batch {args.time_batch} does not fit")
    report["rows"].append(timed)

    lo, hi, best = args.time_batch, None, timed
    while lo < args.max_batch and (hi is None or hi - lo > 1):
        if time.perf_counter() - started > args.budget_s:
            report["stopped"] = f"budget of {args.budget_s} s spent"
            break
        candidate = next_candidate(lo, hi)
        row = attempt(candidate, "largest that runs")
        if row is None:
            hi = candidate
        else:
            lo, best = candidate, row
    report["largest"] = lo
    report["exact"] = hi == lo + 1
    report["next"] = None if hi is None else {"micro_batch": hi, "why": failures[hi]}
    report["xla_gib"] = {b: n * gib for b, n in sorted(needs.items())}
    if best is not timed:
        report["rows"].append(best)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(RESULT + json.dumps(report), flush=True)


# -- the driver ------------------------------------------------------------------------------

def versions():
    from importlib import metadata

    out = {}
    for name in ("google-tunix", "flax", "optax", "jax", "jaxlib"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def backend_line(args):
    """jaxrl_kernels' automatic choice for the loss's log-prob call, as explain() states it."""
    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    config = qwen3_config(args)
    n = args.time_batch * args.completion
    s = jax.ShapeDtypeStruct
    text = jk.explain("linear_logprobs", s((n, config.embed_dim), jnp.bfloat16),
                      s((config.vocab_size, config.embed_dim), jnp.bfloat16),
                      s((n,), jnp.int32), return_entropy=True)
    return text.splitlines()[0]


def markdown(meta, reports):
    by_loss = {r["loss"]: r for r in reports}
    lines = [f"bench_tunix: {meta['device']}, {meta['date']}, jax {meta['jax']}, "
             f"tunix {meta['versions']['google-tunix']}, flax {meta['versions']['flax']}, "
             f"commit {meta['commit']}",
             "",
             f"Qwen3 {meta['model']}, bf16, remat {meta['remat']}, one GRPO actor step (forward, "
             f"loss, backward, AdamW), prompt {meta['prompt']} + completion {meta['completion']} "
             f"tokens; ours: {meta['jaxrl_backend']}.",
             "",
             "| loss | micro-batch | | step (ms) | tokens/s | peak memory (GiB) "
             "| XLA buffers (GiB) |",
             "|---|---|---|---|---|---|---|"]
    for report in reports:
        for row in report["rows"]:
            peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
            lines.append(f"| `{row['loss']}` | {row['micro_batch']} | {row['what']} | "
                         f"{row['step_ms']:.0f} | {row['tokens_per_s']:,.0f} | {peak} | "
                         f"{row['xla_gib']:.2f} |")
    lines.append("")
    for report in reports:
        if report["exact"]:
            how = f"exact: {report['largest'] + 1} {report['next']['why']}"
        else:
            why = report.get("stopped") or f"search cap {meta['max_batch']}"
            how = f"a lower bound: {why}"
        lines.append(f"- `{report['loss']}`: largest micro-batch {report['largest']} ({how}); "
                     f"limit {report['bytes_limit_gib']:.1f} GiB; compiles "
                     f"{report['compile_s']} s; {report['seconds']} s in all.")
    if set(by_loss) == set(LOSSES):
        ours, theirs = by_loss["jaxrl_grpo"], by_loss["grpo"]
        speed = theirs["rows"][0]["step_ms"] / ours["rows"][0]["step_ms"]
        lines.append(f"- micro-batch ratio {ours['largest'] / theirs['largest']:.2f}x; "
                     f"step-time speed-up at micro-batch {meta['time_batch']}: {speed:.2f}x.")
    return "\n".join(lines) + "\n"


def driver(args):
    from benchmarks import common

    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    reports = []
    for loss in args.losses:
        cmd = [sys.executable, "-m", "benchmarks.bench_tunix", "--worker", loss] + args.passthrough
        print("==", " ".join(cmd), flush=True)
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                 timeout=args.budget_s + 300)
        except subprocess.TimeoutExpired as err:
            print(f"{loss}: worker timed out\n{(err.stdout or '')[-3000:]}", flush=True)
            continue
        sys.stdout.write("".join(l + "\n" for l in run.stdout.splitlines()
                                 if not l.startswith(RESULT)))
        found = [l[len(RESULT):] for l in run.stdout.splitlines() if l.startswith(RESULT)]
        if run.returncode or not found:
            print(f"{loss}: worker failed ({run.returncode})\n{run.stderr[-4000:]}", flush=True)
            continue
        reports.append(json.loads(found[-1]))
    meta = common.metadata() | {
        "versions": versions(), "model": "tiny (smoke)" if args.smoke else "0.6B dimensions",
        "remat": args.remat, "prompt": args.prompt, "completion": args.completion,
        "time_batch": args.time_batch, "max_batch": args.max_batch,
        "jaxrl_backend": args.backend or backend_line(args)}
    table = markdown(meta, reports)
    name = "bench_tunix_smoke" if args.smoke else "bench_tunix"
    path = common.results_dir()
    (path / f"{name}.json").write_text(json.dumps({"meta": meta, "reports": reports}, indent=1))
    (path / f"{name}.md").write_text(table)
    print(table)
    return 0 if len(reports) == len(args.losses) else 1


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths, for CPU")
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--completion", type=int)
    parser.add_argument("--remat", default="decoder", choices=("none", "block", "decoder"))
    parser.add_argument("--time-batch", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds per loss, from its start, after which no new micro-batch "
                             "is tried")
    parser.add_argument("--backend",
                        help="jaxrl_kernels backend for jaxrl_grpo (default: automatic)")
    parser.add_argument("--memory-limit-mib", type=float, default=96.0,
                        help="the memory limit where the device reports none (CPU)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke and not args.backend:
        args.backend = "chunked"  # CPU's automatic choice materialises [N, V] at this size
    args.prompt = args.prompt or (8 if args.smoke else 256)
    args.completion = args.completion or (32 if args.smoke else 2048)
    if args.time_batch < 2:
        parser.error("--time-batch must be at least 2 (the memory estimate fits batches 1 and it)")
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    for flag in ("--losses",):
        if flag in args.passthrough:  # the driver's own list, not the worker's
            i = args.passthrough.index(flag)
            j = i + 1
            while j < len(args.passthrough) and not args.passthrough[j].startswith("--"):
                j += 1
            del args.passthrough[i:j]
    return args


def main(argv=None):
    args = parse(argv)
    if args.worker:
        try:
            worker(args)
        except Exception:
            traceback.print_exc()
            return 1
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
