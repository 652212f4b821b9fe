"""tunix GRPO (or PPO) at Qwen3-0.6B size: tunix's own loss and log-probs vs jaxrl_kernels'.

A tunix GRPO micro-step has three device programs, each measured here as tunix runs it:

* the reference model's per-token log-probs and the old (rollout) policy's, one forward pass
  each: tunix's ``common.compute_per_token_logps`` (it builds [B, L, V] float32 logits) against
  jaxrl_kernels' ``integrations.tunix.compute_per_token_logps`` (what ``use_kernel_logprobs``
  serves an RLCluster with; no logits);
* the actor train step: tunix's own trainer step body (``PeftTrainer._train_step``:
  ``nnx.value_and_grad`` of the registered policy loss, optax global norm, AdamW update),
  jitted with the model and optimizer state donated, with the loss "grpo" against
  "jaxrl_grpo" ("ppo" / "jaxrl_ppo" with ``--algos ppo``).

The model: tunix's Qwen3 modules at ``ModelConfig.qwen3_0p6b()`` dimensions (28 layers, D 1024,
16 heads of 128, 8 KV heads, MLP 3072, tied embedding V = 151936), bfloat16 parameters and
compute, random init (tunix's ``create_dummy_model``, scale 0.02), each decoder layer
rematerialised (``RematConfig.DECODER``). ``--model scan`` (default) runs the 28 layers with
``nnx.scan`` over the same ``DecoderLayer`` modules, which gives the same numbers as tunix's
``Qwen3`` (a Python loop of 28 layers; ``--model tunix``) but compiles in a fraction of its time
(about 45 s per program on an H100 with jax 0.11.2), which is what lets the searches below fit
in minutes. tunix's Qwen3 has no flash attention off TPU: every layer builds its
[B, heads, L, L] attention scores in XLA.

Per loss, in a fresh process (so that peak memory is this loss's alone), prompt ``--prompt``
(256) tokens:

1. ``same micro-batch``: micro-batch ``--time-batch`` (4) at completion ``--completion`` (2048):
   median time of the train step and of one log-prob pass (``--steps`` runs after a warm-up),
   the step = train + 2 passes (reference, old policy), tokens/s = micro-batch x (prompt +
   completion) / step;
2. ``largest micro-batch``: micro-batches at that completion are compiled and *run* (a result
   is only ever a micro-batch whose train step and both passes ran); candidates come from a
   straight-line fit of XLA's buffer sizes (arguments + outputs + temporaries - aliased) to the
   device's ``bytes_limit``; a candidate whose buffers exceed the limit is not run and counts as
   not fitting; the search stops when the largest that ran and the smallest that did not are
   adjacent ("exact") or at ``--budget-s`` (100 s) x 0.55 from the worker's start (then a
   lower bound);
3. ``longest completion``: the same at micro-batch 1 over the completion length (multiples of
   ``--length-step``, 256), with a quadratic fit (attention grows as L^2), until the deadline.

For the smallest candidate that did not fit (else the largest that ran), the largest buffers of
its compiled train step are classified from XLA's program text: ``logits`` (a dimension V),
``attention scores`` (two sequence dimensions), ``layer checkpoints`` (the per-layer remat
residuals, [layers, B, L, D]) or ``activations``: this is the "limited by" column.

    PYTHONPATH=$PWD python3 -m benchmarks.bench_tunix               # GPU: budgeted ~5 min
    PYTHONPATH=$PWD python3 -m benchmarks.bench_tunix --smoke       # CPU: tiny Qwen3, chunked
                                                                    # backend, 64 MiB limit

On CPU no run ever runs out of memory, so ``--smoke`` emulates the limit (``--memory-limit-mib``)
by XLA's buffer sizes alone. Results: ``bench_tunix.{json,md}`` (``bench_tunix_smoke.*``) in
out/bench (``--out``, ``--update-results``: benchmarks/README.md); the markdown table is also
printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback

from benchmarks import output

ALGOS = ("grpo", "ppo")
PAD_ID, EOS_ID = 0, 1
RESULT = "RESULT "
GIB = 2.0**-30


# -- the model -------------------------------------------------------------------------------


def scanned_qwen3_class():
    """tunix's Qwen3 with its decoder layers stacked and run by ``nnx.scan``."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    class ScannedQwen3(nnx.Module):
        """``qwen3.Qwen3``'s __call__ (embedder, decoder layers, final norm, hidden states sown
        as "all_hidden_states", tied-embedding logits in float32) over stacked
        ``qwen3.DecoderLayer`` modules; training only (no KV cache), tied embedding only."""

        def __init__(self, config, *, rngs):
            if not config.use_tied_embedding:
                raise ValueError("ScannedQwen3: tied embedding only (Qwen3-0.6B's)")
            self.config = config
            self.embedder = qwen3.Embedder(
                vocab_size=config.vocab_size,
                embed_dim=config.embed_dim,
                rngs=rngs,
                shd_config=config.shd_config,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
            )

            @nnx.split_rngs(splits=config.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def layers(rngs):
                return qwen3.DecoderLayer(config=config, rngs=rngs)

            self.layers = layers(rngs)
            self.final_norm = qwen3.RMSNorm(
                config.embed_dim,
                rngs=rngs,
                norm_eps=config.norm_eps,
                shd_config=config.shd_config,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
            )

        def __call__(
            self,
            input_tokens,
            positions,
            cache,
            attention_mask,
            output_hidden_states=False,
            segment_ids=None,
        ):
            if cache is not None:
                raise ValueError("ScannedQwen3 has no KV cache (training only)")
            x = self.embedder.encode(input_tokens)

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, layer):  # the layer remats itself (RematConfig.DECODER)
                _, x = layer(x, positions, None, attention_mask, segment_ids=segment_ids)
                return x

            x = self.final_norm(run(x, self.layers))
            if output_hidden_states:
                self.sow(nnx.Intermediate, "all_hidden_states", x)
            return jnp.astype(self.embedder.decode(x), jnp.float32), None

    return ScannedQwen3


def qwen3_config(args):
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3

    if args.smoke:
        config = qwen3.ModelConfig(
            num_layers=2,
            vocab_size=32771,
            embed_dim=64,
            hidden_dim=128,
            num_heads=4,
            head_dim=16,
            num_kv_heads=2,
            rope_theta=10_000,
            norm_eps=1e-6,
            use_tied_embedding=True,
        )
    else:
        config = qwen3.ModelConfig.qwen3_0p6b()
    config.remat_config = qwen3.RematConfig.DECODER
    config.dtype = config.param_dtype = jnp.bfloat16
    return config


# -- one loss, in its own process ---------------------------------------------------------------


def out_of_memory(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


SHAPE = re.compile(r"\b(f64|f32|bf16|f16|s64|s32|u32|s16|u16|s8|u8|pred)\[([0-9,]*)\]")
DTYPE_BYTES = {
    "f64": 8,
    "s64": 8,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
}


def classify(shape, *, seq, completion, vocab, dim, layers) -> str:
    lengths = {seq, seq - 1, completion, completion + 1}
    if vocab in shape:
        return "LM head weight" if set(shape) <= {vocab, dim, 1} else "logits"
    if sum(1 for d in shape if d in lengths) >= 2:
        return "attention scores"
    if len(shape) >= 3 and shape[0] == layers and any(d in lengths for d in shape):
        return "layer checkpoints"
    return "activations"


def largest_buffers(hlo_text, top=3, **dims):
    """The ``top`` largest distinct arrays of a compiled program: (GiB, "dtype[shape]", kind)."""
    sizes = {}
    for dtype, text in SHAPE.findall(hlo_text):
        shape = tuple(int(d) for d in text.split(",") if d)
        sizes[(dtype, shape)] = math.prod(shape) * DTYPE_BYTES[dtype]
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [
        (n * GIB, f"{dtype}[{','.join(map(str, shape))}]", classify(shape, **dims))
        for (dtype, shape), n in ranked
    ]


class Worker:
    """The three programs of one loss (see the module docstring) on a fresh model."""

    def __init__(self, args):
        import jax
        import optax
        from flax import nnx
        from tunix.models import dummy_model_creator
        from tunix.models.qwen3 import model as qwen3
        from tunix.rl import common, function_registry
        from tunix.rl import trainer as rl_trainer
        from tunix.sft import peft_trainer

        from jaxrl_kernels.integrations import tunix as jaxrl_tunix

        self.args, self.jax, self.nnx = args, jax, nnx
        self.ours = args.worker.startswith("jaxrl_")
        self.algo = args.worker.removeprefix("jaxrl_")
        self.config = qwen3_config(args)
        model_class = scanned_qwen3_class() if args.model == "scan" else qwen3.Qwen3
        if self.algo == "grpo":
            from tunix.rl.grpo import grpo_learner

            self.algo_config = grpo_learner.GRPOConfig(num_generations=2, num_iterations=2)
            self.algo_config.temperature = 1.0  # what GRPOLearner copies from the rollout
            self.example_type = grpo_learner.TrainExample
        else:
            from tunix.rl.ppo import ppo_learner

            self.algo_config = ppo_learner.PPOConfig(num_iterations=2)
            self.example_type = ppo_learner.TrainExample
        loss_fn = function_registry.get_policy_loss_fn(args.worker)
        extra = {"backend": args.backend} if self.ours and args.backend else {}
        if self.ours and args.memory != "lean":
            extra["memory"] = args.memory
        if self.ours:
            self.logprob_pass = jaxrl_tunix.compute_per_token_logps
            self.pass_kwargs = {"backend": args.backend}
        else:
            self.logprob_pass = common.compute_per_token_logps
            self.pass_kwargs = {}

        def new_model():
            return dummy_model_creator.create_dummy_model(
                model_class, self.config, dtype=self.config.param_dtype, scale=0.02
            )

        def build():
            trainer = rl_trainer.Trainer(
                new_model(),
                optax.adamw(1e-6),
                peft_trainer.TrainingConfig(eval_every_n_steps=10**9),
                custom_checkpoint_metadata_fn=dict,
            )
            trainer.with_loss_fn(
                lambda model, train_example, algo_config: loss_fn(
                    model, train_example, algo_config, PAD_ID, EOS_ID, **extra
                ),
                has_aux=True,
            )
            trainer.with_gen_model_input_fn(
                lambda x: {"train_example": x, "algo_config": self.algo_config}
            )
            return trainer

        self.build = build
        self.reference = nnx.split(new_model())  # the reference model: its own parameters
        self.reset()

    def reset(self):
        """A fresh model and optimizer (a failed run may have consumed the donated ones)."""
        self.state = None
        trainer = self.build()
        self.graphdef, self.state = self.nnx.split((trainer.model, trainer.optimizer))
        graphdef = self.graphdef

        def step(state, example):
            model, optimizer = self.nnx.merge(graphdef, state)
            loss, _, grad_norm = trainer._train_step(model, optimizer, example)
            return loss, grad_norm, self.nnx.state((model, optimizer))

        self.jitted = self.jax.jit(step, donate_argnums=0)

    def policy(self):
        """(graphdef, state) of the current policy model (the rollout policy's parameters)."""
        model, _ = self.nnx.merge(self.graphdef, self.state)
        return self.nnx.split(model)

    def example(self, batch, completion):
        import jax.numpy as jnp
        import numpy as np

        rng = np.random.default_rng(batch * 100_003 + completion)
        p, c, vocab = self.args.prompt, completion, self.config.vocab_size

        def logp():
            return jnp.asarray(-3.0 + 0.3 * rng.standard_normal((batch, c)), jnp.float32)

        fields = dict(
            prompt_ids=jnp.asarray(rng.integers(2, vocab, (batch, p)), jnp.int32),
            prompt_mask=jnp.ones((batch, p), jnp.int32),
            completion_ids=jnp.asarray(rng.integers(2, vocab, (batch, c)), jnp.int32),
            completion_mask=jnp.ones((batch, c), jnp.int32),
            ref_per_token_logps=logp(),
            old_per_token_logps=logp(),
        )
        if self.algo == "grpo":
            fields["advantages"] = jnp.asarray(rng.standard_normal(batch), jnp.float32)
        else:
            fields["advantages"] = jnp.asarray(rng.standard_normal((batch, c)), jnp.float32)
        return self.example_type(**fields)

    @staticmethod
    def need_bytes(compiled):
        m = compiled.memory_analysis()
        return (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            + m.temp_size_in_bytes
            - m.alias_size_in_bytes
        )

    def compile_step(self, example):
        """(compiled, XLA's bytes, of which not temporaries (the state: parameters, optimizer),
        compile s)."""
        start = time.perf_counter()
        compiled = self.jitted.lower(self.state, example).compile()
        need = self.need_bytes(compiled)
        fixed = need - compiled.memory_analysis().temp_size_in_bytes
        return compiled, need, fixed, time.perf_counter() - start

    def time_step(self, compiled, example, steps):
        """Median ms of a train step after one warm-up step (``benchmarks.common``'s timer;
        each step takes the state the last one returned)."""
        from benchmarks import common as timer

        last = []

        def step():
            loss, grad_norm, self.state = compiled(self.state, example)
            last[:] = [loss]
            return loss, grad_norm, self.state

        timing = timer.time_calls(step, warmup=1, runs=steps)
        loss = last[0]
        if not bool(self.jax.numpy.isfinite(loss)):
            raise FloatingPointError(f"loss is {float(loss)}")
        return timing.median

    def time_passes(self, example, steps):
        """(median ms of one log-prob pass, XLA's bytes of the pass, compile s): the reference
        model's pass and the policy's, alternately."""
        from benchmarks import common as timer

        models = [self.reference, self.policy()]
        args = lambda m: (m[0], m[1], example.prompt_ids, example.completion_ids)  # noqa: E731
        start = time.perf_counter()
        compiled = self.logprob_pass.lower(
            *args(models[0]),
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            stop_gradient=True,
            temperature=1.0,
            **self.pass_kwargs,
        ).compile()
        seconds = time.perf_counter() - start
        timing = timer.time_calls(
            compiled, arg_sets=[args(m) for m in models], warmup=2, runs=2 * steps
        )
        return timing.median, self.need_bytes(compiled), seconds


def peak_bytes():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use"), stats.get("bytes_limit")


def fit_candidate(points, degree, limit, lo, hi, step, cap):
    """The next size to try: where a polynomial fit of XLA's bytes over the size first reaches
    0.99 x the limit above ``lo``, kept strictly between the largest size that ran (``lo``) and the smallest that
    did not (``hi``), a multiple of ``step``, at most 4 x lo and ``cap``; 2 x lo while fewer
    than two sizes are known."""
    import numpy as np

    guess = None
    if len(points) >= 2:
        xs, ys = zip(*sorted(points.items())[-(degree + 1) :])
        coeffs = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), min(degree, len(xs) - 1))
        coeffs[-1] -= 0.99 * limit
        # the first crossing above lo (a concave fit crosses back down further out)
        roots = [r.real for r in np.roots(coeffs) if abs(r.imag) < 1e-9 and r.real > lo]
        if roots:
            guess = min(roots)
    if guess is None or not math.isfinite(guess):
        guess = 2 * lo
    upper = min(cap, 4 * lo, (hi - step) if hi is not None else cap)
    candidate = int(guess) // step * step
    return max(lo + step, min(candidate, upper))


def worker(args):
    started = time.perf_counter()
    w = Worker(args)
    config = w.config
    _, limit = peak_bytes()
    limit = limit if limit is not None else int(args.memory_limit_mib * 2**20)
    report = {"loss": args.worker, "bytes_limit_gib": limit * GIB, "rows": [], "compile_s": []}
    prompt = args.prompt

    def buffers(compiled, completion):
        return largest_buffers(
            compiled.as_text(),
            seq=prompt + completion,
            completion=completion,
            vocab=config.vocab_size,
            dim=config.embed_dim,
            layers=config.num_layers,
        )

    def add_passes(row, steps):
        """Time both log-prob passes at the row's size (the step is train + 2 passes)."""
        example = w.example(row["micro_batch"], row["completion"])
        pass_ms, pass_need, seconds = w.time_passes(example, steps)
        report["compile_s"].append(round(seconds, 1))
        step_ms = row["train_ms"] + 2 * pass_ms
        tokens = row["micro_batch"] * (prompt + row["completion"])
        row.update(
            pass_ms=pass_ms,
            pass_xla_gib=pass_need * GIB,
            step_ms=step_ms,
            tokens_per_s=tokens / (step_ms * 1e-3),
        )
        peak, _ = peak_bytes()
        row["peak_gib"] = None if peak is None else peak * GIB

    def attempt(batch, completion, what, steps):
        """Compile the train step at (batch, completion) and run it when XLA's buffers fit the
        limit. Returns (row or None, XLA's bytes, why not, its largest buffers)."""
        example = w.example(batch, completion)
        compiled, need, fixed, seconds = w.compile_step(example)
        report["compile_s"].append(round(seconds, 1))
        report["fixed_gib"] = fixed * GIB
        top = buffers(compiled, completion)
        if need > limit:
            why = f"XLA's buffers {need * GIB:.2f} GiB exceed the {limit * GIB:.2f} GiB limit"
            print(f"{args.worker}: B={batch} C={completion}: {why}", flush=True)
            return None, need, why, top
        try:
            train_ms = w.time_step(compiled, example, steps)
        except Exception as err:  # noqa: BLE001
            if not out_of_memory(err):
                raise
            why = "ran out of memory (RESOURCE_EXHAUSTED)"
            print(f"{args.worker}: B={batch} C={completion}: {why}", flush=True)
            del compiled
            w.reset()  # the failed run may have consumed the donated state
            return None, need, why, top
        peak, _ = peak_bytes()
        row = {
            "loss": args.worker,
            "what": what,
            "micro_batch": batch,
            "prompt": prompt,
            "completion": completion,
            "train_ms": train_ms,
            "pass_ms": None,
            "step_ms": None,
            "tokens_per_s": None,
            "xla_gib": need * GIB,
            "pass_xla_gib": None,
            "peak_gib": None if peak is None else peak * GIB,
            "buffers": top,
        }
        print(
            f"{args.worker}: B={batch} C={completion}: train step {train_ms:.0f} ms, XLA "
            f"{need * GIB:.2f} GiB",
            flush=True,
        )
        return row, need, None, top

    def search(what, size_of, make, lo, points, degree, step, cap, deadline):
        """Grow one size (micro-batch or completion) by runs; see the module docstring."""
        best, hi, hi_why, hi_top, stopped = None, None, None, None, None
        while hi is None or hi - lo > step:
            if lo + step > cap:
                stopped = f"search cap {cap}"
                break
            if time.perf_counter() > deadline:
                stopped = "time budget spent"
                break
            candidate = fit_candidate(points, degree, limit, lo, hi, step, cap)
            row, need, why, top = attempt(*make(candidate), what, steps=1)
            points[candidate] = need
            if row is None:
                hi, hi_why, hi_top = candidate, why, top
            else:
                lo, best = candidate, row
        if best is not None:  # a result is a whole step: the two log-prob passes too
            try:
                add_passes(best, 1)
            except Exception as err:  # noqa: BLE001
                if not out_of_memory(err):
                    raise
                best["pass_failed"] = "a log-prob pass ran out of memory at this size"
        return {
            "largest": size_of(best) if best else None,
            "row": best,
            "exact": hi is not None and hi - lo <= step,
            "next": None if hi is None else {"size": hi, "why": hi_why, "buffers": hi_top},
            "stopped": stopped,
        }

    tb, completion = args.time_batch, args.completion
    timed, need, why, _ = attempt(tb, completion, "same micro-batch", args.steps)
    if timed is None:
        raise SystemExit(
            f"{args.worker}: micro-batch {tb} at completion {completion} does not fit: {why}"
        )
    add_passes(timed, args.steps)
    report["rows"].append(timed)
    # The first fits: XLA's bytes are the state's (size 0) plus a part that grows with the
    # micro-batch (linearly) and with the length (linearly: logits, activations; as L^2:
    # attention), so one micro-batch of the timed size is that part / tb.
    fixed = report["fixed_gib"] / GIB
    one = fixed + (need - fixed) / tb

    if "batch" in args.searches:
        result = search(
            "largest micro-batch",
            lambda r: r["micro_batch"],
            lambda b: (b, completion),
            tb,
            {0: fixed, tb: need},
            1,
            1,
            args.max_batch,
            started + 0.55 * args.budget_s,
        )
        report["batch_search"] = result
        if result["row"] is not None:
            report["rows"].append(result["row"])
    if "length" in args.searches:
        result = search(
            "longest completion",
            lambda r: r["completion"],
            lambda c: (1, c),
            completion,
            {0: fixed, completion: one},
            2,
            args.length_step,
            args.max_completion,
            started + args.budget_s,
        )
        report["length_search"] = result
        if result["row"] is not None:
            report["rows"].append(result["row"])
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
    text = jk.explain(
        "linear_logprobs",
        s((n, config.embed_dim), jnp.bfloat16),
        s((config.vocab_size, config.embed_dim), jnp.bfloat16),
        s((n,), jnp.int32),
        return_entropy=True,
    )
    return text.splitlines()[0]


def _num(x, fmt):
    return "n/a" if x is None else format(x, fmt)


def _limit_text(search, meta):
    """What stops the search: the largest buffers of the first size that did not fit."""
    nxt = search.get("next")
    source = nxt["buffers"] if nxt else (search["row"] or {}).get("buffers") or []
    big = [b for b in source if b[2] != "LM head weight"][:2]
    what = "; ".join(f"{kind} {shape} {gib:.2f} GiB" for gib, shape, kind in big)
    if nxt:
        return f"{big[0][2] if big else '?'} ({what})"
    return f"not reached; largest buffers at the largest size: {what}"


def markdown(meta, reports):
    by_loss = {r["loss"]: r for r in reports}
    v = meta["versions"]
    lines = [
        f"bench_tunix: {meta['device']}, {meta['date']}, jax {meta['jax']}, "
        f"tunix {v['google-tunix']}, flax {v['flax']}, commit {meta['commit']}",
        "",
        f"Qwen3 {meta['model']} ({meta['model_impl']}), bf16, each decoder layer "
        f"rematerialised; one {meta['algo_names']} micro-step = reference log-probs + "
        f"old-policy log-probs (one forward pass each) + the actor train step (forward, "
        f"loss, backward, AdamW); prompt {meta['prompt']} tokens. tunix: its own "
        f"loss and `compute_per_token_logps`; jaxrl: the registered loss and "
        f"`integrations.tunix.compute_per_token_logps` ({meta['jaxrl_backend']}).",
        "",
        "| loss | | micro-batch | completion | train step (ms) | log-prob pass (ms) "
        "| step (ms) | tokens/s | XLA buffers, train (GiB) | peak so far (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for report in reports:
        for row in report["rows"]:
            lines.append(
                f"| `{row['loss']}` | {row['what']} | {row['micro_batch']} | "
                f"{row['completion']} | {row['train_ms']:.0f} | {_num(row['pass_ms'], '.0f')} | "
                f"{_num(row['step_ms'], '.0f')} | {_num(row['tokens_per_s'], ',.0f')} | "
                f"{row['xla_gib']:.2f} | {_num(row['peak_gib'], '.2f')} |"
            )
    if any(r.get("batch_search") or r.get("length_search") for r in reports):
        lines += [
            "",
            "| loss | search | result | next size | limited by |",
            "|---|---|---|---|---|",
        ]
    for report in reports:
        for key, label, unit in (
            ("batch_search", "largest micro-batch", f"at completion {meta['completion']}"),
            ("length_search", "longest completion", "at micro-batch 1"),
        ):
            search = report.get(key)
            if not search:
                continue
            kind = "exact" if search["exact"] else f"lower bound: {search['stopped']}"
            nxt = search["next"]
            nxt_text = "none tried" if nxt is None else f"{nxt['size']}: {nxt['why']}"
            extra = (
                " (a log-prob pass failed there)"
                if (search["row"] or {}).get("pass_failed")
                else ""
            )
            if search["largest"] is None:
                start = (
                    f"{meta['time_batch']} (the timed run)"
                    if key == "batch_search"
                    else f"none run beyond {meta['completion']}"
                )
                result = f"{start}{'' if search['exact'] else f' ({kind})'}"
            else:
                result = f"{search['largest']} ({kind}){extra}"
            lines.append(
                f"| `{report['loss']}` | {label} {unit} | {result} | {nxt_text} | "
                f"{_limit_text(search, meta)} |"
            )
    lines.append("")
    for report in reports:
        lines.append(
            f"- `{report['loss']}`: limit {report['bytes_limit_gib']:.1f} GiB; "
            f"compiles {report['compile_s']} s; {report['seconds']} s in all."
        )
    for algo in meta["algos"]:
        ours, theirs = by_loss.get(f"jaxrl_{algo}"), by_loss.get(algo)
        if not (ours and theirs):
            continue
        o, t = ours["rows"][0], theirs["rows"][0]
        parts = [
            f"step-time speed-up at micro-batch {meta['time_batch']}: "
            f"{t['step_ms'] / o['step_ms']:.2f}x"
        ]
        for key, label in (
            ("batch_search", "largest micro-batch"),
            ("length_search", "longest completion"),
        ):
            a, b = ours.get(key), theirs.get(key)
            if a and b and a["largest"] and b["largest"]:
                parts.append(f"{label} {a['largest'] / b['largest']:.2f}x")
        lines.append(f"- {algo}, jaxrl over tunix: " + "; ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def driver(args):
    from benchmarks import common

    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    # the searches measure against the whole limit: an allocator that grows region by region
    # can fail a buffer of several GiB that the limit has room for
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    reports = []
    losses = [name for algo in args.algos for name in (algo, f"jaxrl_{algo}")]
    for loss in losses:
        cmd = [sys.executable, "-m", "benchmarks.bench_tunix", "--worker", loss] + args.passthrough
        print("==", " ".join(cmd), flush=True)
        try:
            run = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.budget_s + 240
            )
        except subprocess.TimeoutExpired as err:
            out = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            print(f"{loss}: worker timed out\n{out[-3000:]}", flush=True)
            continue
        sys.stdout.write(
            "".join(line + "\n" for line in run.stdout.splitlines() if not line.startswith(RESULT))
        )
        found = [line[len(RESULT) :] for line in run.stdout.splitlines() if line.startswith(RESULT)]
        if run.returncode or not found:
            print(f"{loss}: worker failed ({run.returncode})\n{run.stderr[-4000:]}", flush=True)
            continue
        reports.append(json.loads(found[-1]))
    meta = common.metadata() | {
        "versions": versions(),
        "model": "tiny (smoke)" if args.smoke else "0.6B dimensions",
        "model_impl": "nnx.scan over tunix's DecoderLayer"
        if args.model == "scan"
        else "tunix's Qwen3",
        "algos": list(args.algos),
        "algo_names": "/".join(a.upper() for a in args.algos),
        "prompt": args.prompt,
        "completion": args.completion,
        "time_batch": args.time_batch,
        "max_batch": args.max_batch,
        "budget_s": args.budget_s,
        "jaxrl_backend": args.backend or backend_line(args),
    }
    table = markdown(meta, reports)
    name = "bench_tunix_smoke" if args.smoke else "bench_tunix"
    path = common.results_dir()
    (path / f"{name}.json").write_text(json.dumps({"meta": meta, "reports": reports}, indent=1))
    (path / f"{name}.md").write_text(table)
    print(table)
    return 0 if len(reports) == len(losses) else 1


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths, for CPU")
    parser.add_argument("--algos", nargs="+", default=["grpo"], choices=ALGOS)
    parser.add_argument(
        "--model",
        default="scan",
        choices=("scan", "tunix"),
        help="scan: nnx.scan over tunix's decoder layers (fast compiles); "
        "tunix: tunix's Qwen3 class itself",
    )
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--completion", type=int)
    parser.add_argument("--time-batch", type=int)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--searches", nargs="*", default=["batch", "length"], choices=("batch", "length")
    )
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--max-completion", type=int, default=131072)
    parser.add_argument("--length-step", type=int)
    parser.add_argument(
        "--budget-s",
        type=float,
        help="seconds per loss (from its start) after which no new size is "
        "tried: 0.55 of it for the micro-batch search, the rest for the "
        "completion length (default 100; smoke 90)",
    )
    parser.add_argument(
        "--backend",
        help="jaxrl_kernels backend for the jaxrl loss and log-probs (default: automatic)",
    )
    parser.add_argument(
        "--memory",
        default="lean",
        choices=("lean", "fast"),
        help="linear_logprobs' memory mode in the jaxrl loss's train step",
    )
    parser.add_argument(
        "--memory-limit-mib",
        type=float,
        default=64.0,
        help="the memory limit where the device reports none (CPU)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke and not args.backend:
        args.backend = "chunked"  # CPU's automatic choice materialises [N, V] at this size
    args.prompt = args.prompt or (8 if args.smoke else 256)
    args.completion = args.completion or (32 if args.smoke else 2048)
    args.time_batch = args.time_batch or (2 if args.smoke else 4)
    args.length_step = args.length_step or (16 if args.smoke else 256)
    args.budget_s = args.budget_s or (90.0 if args.smoke else 100.0)
    args.passthrough = list(argv if argv is not None else sys.argv[1:])
    if "--algos" in args.passthrough:  # the driver's own list, not the worker's
        i = args.passthrough.index("--algos")
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
