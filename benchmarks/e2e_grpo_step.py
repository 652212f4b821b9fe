"""End-to-end GRPO training step: a ~300M-parameter Flax decoder with a 128k vocabulary.

One jitted step = the decoder's forward to the final hidden states, the GRPO loss, the
backward, and ``optax.adamw``, on B sequences of T=1024 tokens. Four loss paths:

- ``jaxrl_kernels``: ``jk.linear_grpo_loss(hidden, W, ...)`` on the hidden states and the
  tied embedding W [V, D] (layout "vd"), automatic backend; no [B, T, V] logits;
- ``jaxrl_kernels_fast``: the same with ``memory="fast"`` (the logits kept for the backward);
- ``materialised``: logits = hidden Wᵀ in float32 [B, T, V], log_softmax, gather, then the
  same GRPO math in jnp (our formulas: group-normalised advantages, clipped surrogate,
  token mean);
- ``materialised_bf16``: the same with bf16 logits (the product's own dtype) and a float32
  log_softmax: the code most JAX users write.

The model (random init, seed 0): d_model 1024, 14 pre-LayerNorm blocks (16 heads, MLP 4x,
XLA attention), learned positions, the token embedding tied to the LM head (311M parameters).
Parameters and AdamW state in float32, compute in bfloat16; ``nn.scan`` over the blocks with
``nn.remat`` (activations of each block recomputed in the backward), which also keeps the
compile time of one step to seconds. Batches: random tokens, a 128-token prompt (mask 0), a
completion of random length, random 0/1 rewards in groups of 8, old log-probs near −log V.

Per path, in a fresh process (so device peak memory is this path's alone):

1. at B = 16: step time (median of 10 after warm-up), tokens/s (B·T per step), the device's
   ``peak_bytes_in_use``, XLA's compiled sizes (temp; arguments + outputs − aliased), the loss;
2. the largest micro-batch: XLA's memory need (temp + arguments + outputs − aliased, from
   ``compiled.memory_analysis()``) at B and 2B, a straight-line fit to the device's
   ``bytes_limit``, then compile + one step at the predicted size (stepping down on
   RESOURCE_EXHAUSTED), and B + 8 compiled to show that it would not fit; step time there.

Workers use ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` (unless set) so that the largest batch is
measured against nearly the whole GPU, and always preallocate it
(``XLA_PYTHON_CLIENT_PREALLOCATE=true``): an allocator that grows region by region can fail a
buffer of several GiB that the limit has room for.

    python -m benchmarks.e2e_grpo_step            # GPU, ~4 min (at most 2 x (120 + 60) s)
    python -m benchmarks.e2e_grpo_step --smoke    # tiny model, any device (~1 min on CPU)

Results: ``e2e_grpo_step.{json,md}`` (benchmarks.common.write_results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
import traceback

from benchmarks import output
from benchmarks.workers import failure, run_worker

PATHS = ("jaxrl_kernels", "jaxrl_kernels_fast", "materialised", "materialised_bf16")
COLUMNS = [
    "path",
    "params_M",
    "B",
    "T",
    "step_ms",
    "tokens_per_s",
    "peak_mib",
    "temp_mib",
    "largest_B",
    "largest_step_ms",
    "largest_tokens_per_s",
    "largest_need_mib",
    "limit_mib",
    "loss",
    "note",
    "error",
]


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 131072
    d_model: int = 1024
    layers: int = 14
    heads: int = 16
    seq: int = 1024
    prompt: int = 128
    group: int = 8
    batch: int = 16  # the micro-batch both paths are timed at
    max_batch: int = 512  # the search's cap
    timed_steps: int = 10


SMOKE = Config(
    vocab=1000,
    d_model=64,
    layers=2,
    heads=4,
    seq=64,
    prompt=8,
    group=4,
    batch=8,
    max_batch=64,
    timed_steps=2,
)


# -- the model ---------------------------------------------------------------------------


def build(cfg: Config):
    """(model, optimizer) of ``cfg``; flax is imported here, in the worker only."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    dtype = jnp.bfloat16

    class Block(nn.Module):
        d_model: int
        heads: int

        @nn.compact
        def __call__(self, x, _):
            head_dim = self.d_model // self.heads
            h = nn.LayerNorm(dtype=dtype)(x)
            qkv = nn.DenseGeneral((3, self.heads, head_dim), dtype=dtype, name="qkv")(h)
            att = jax.nn.dot_product_attention(
                qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True
            )
            x = x + nn.DenseGeneral(self.d_model, axis=(-2, -1), dtype=dtype, name="out")(att)
            h = nn.LayerNorm(dtype=dtype)(x)
            h = nn.Dense(4 * self.d_model, dtype=dtype)(h)
            return x + nn.Dense(self.d_model, dtype=dtype)(nn.gelu(h)), None

    class Decoder(nn.Module):
        """tokens [B, T] → final hidden states [B, T, D] (bf16); the head is ``embed``."""

        @nn.compact
        def __call__(self, tokens):
            embed = self.param("embed", nn.initializers.normal(0.02), (cfg.vocab, cfg.d_model))
            pos = self.param("pos", nn.initializers.normal(0.02), (cfg.seq, cfg.d_model))
            x = (embed[tokens] + pos[: tokens.shape[1]]).astype(dtype)
            blocks = nn.scan(
                nn.remat(Block),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.layers,
            )
            x, _ = blocks(cfg.d_model, cfg.heads, name="blocks")(x, None)
            return nn.LayerNorm(dtype=dtype, name="final_norm")(x)

    return Decoder(), optax.adamw(1e-5, weight_decay=0.01)


# -- the losses --------------------------------------------------------------------------


def grpo_from_logp(logp, old_logp, rewards, mask, group, clip=0.2, eps=1e-6):
    """our GRPO in jnp: adv = (r − mean_g)/(std_g + eps); pg = max(−A·r, −A·clip(r));
    loss = Σ m·pg / max(Σ m, 1) with r = exp(clip(logp − old_logp, −20, 20))."""
    import jax.numpy as jnp

    r = rewards.reshape(-1, group)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)).reshape(-1, 1)
    ratio = jnp.exp(jnp.clip(logp - old_logp, -20.0, 20.0))
    pg = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - clip, 1 + clip))
    return jnp.sum(mask * pg) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_fn(path, model, cfg):
    import jax
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    def loss(params, batch):
        hidden = model.apply(params, batch["inputs"])
        head = params["params"]["embed"].astype(jnp.bfloat16)
        if path.startswith("jaxrl_kernels"):
            memory = "fast" if path == "jaxrl_kernels_fast" else "lean"
            return jk.linear_grpo_loss(
                hidden,
                head,
                batch["actions"],
                batch["old_logp"],
                batch["rewards"],
                batch["mask"],
                groups=jk.Groups(size=cfg.group),
                memory=memory,
            )[0]
        logits_dtype = jnp.bfloat16 if path == "materialised_bf16" else jnp.float32
        logits = jnp.einsum("btd,vd->btv", hidden, head, preferred_element_type=logits_dtype)
        logp = jnp.take_along_axis(
            jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1),
            batch["actions"][..., None],
            axis=-1,
        )[..., 0]
        return grpo_from_logp(logp, batch["old_logp"], batch["rewards"], batch["mask"], cfg.group)

    return loss


def make_batch(cfg: Config, size: int):
    """Random rollouts of ``size`` sequences (the same for both paths: fixed keys)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def draw(key):
        k_tok, k_len, k_rew, k_old = jax.random.split(key, 4)
        tokens = jax.random.randint(k_tok, (size, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
        length = jax.random.randint(k_len, (size, 1), cfg.seq // 4, cfg.seq - cfg.prompt + 1)
        t = jnp.arange(cfg.seq)[None, :]
        mask = ((t >= cfg.prompt) & (t < cfg.prompt + length)).astype(jnp.float32)
        old = -math.log(cfg.vocab) + 0.05 * jax.random.normal(k_old, (size, cfg.seq))
        rewards = jax.random.bernoulli(k_rew, 0.5, (size,)).astype(jnp.float32)
        return {
            "inputs": tokens[:, :-1],
            "actions": tokens[:, 1:],
            "mask": mask,
            "old_logp": old,
            "rewards": rewards,
        }

    return draw(jax.random.key(1))


# -- the worker --------------------------------------------------------------------------


class Trainer:
    """Parameters, optimizer state and compiled steps of one loss path."""

    def __init__(self, path, cfg):
        import jax
        import jax.numpy as jnp
        import optax

        self.cfg = cfg
        self.model, self.tx = build(cfg)
        self.loss = loss_fn(path, self.model, cfg)

        def step(params, opt_state, batch):
            value, grads = jax.value_and_grad(self.loss)(params, batch)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.init_fn = jax.jit(lambda key: self.model.init(key, jnp.zeros((1, cfg.seq), jnp.int32)))
        self.reset()
        self.n_params = sum(x.size for x in jax.tree.leaves(self.params))

    def reset(self):
        """Fresh parameters (seed 0) and optimizer state; also after a failed step, whose
        donated buffers may be gone."""
        import jax

        self.params = self.init_fn(jax.random.key(0))
        self.opt_state = jax.jit(self.tx.init)(self.params)

    def compile(self, batch):
        """(compiled step, XLA's memory need in bytes, its temp bytes)."""
        compiled = self.step.lower(self.params, self.opt_state, batch).compile()
        ma = compiled.memory_analysis()
        need = (
            ma.temp_size_in_bytes
            + ma.argument_size_in_bytes
            + ma.output_size_in_bytes
            - ma.alias_size_in_bytes
        )
        return compiled, need, ma.temp_size_in_bytes

    def run(self, compiled, batch):
        import jax

        self.params, self.opt_state, value = compiled(self.params, self.opt_state, batch)
        return float(jax.block_until_ready(value))

    def time_steps(self, compiled, batch, steps):
        """Median ms of ``steps`` train steps (``benchmarks.common``'s timer; each step takes
        the parameters the last one returned)."""
        from benchmarks import common

        def step():
            self.params, self.opt_state, value = compiled(self.params, self.opt_state, batch)
            return value

        return common.time_calls(step, warmup=0, runs=steps).median


def out_of_memory(err):
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def largest_batch(trainer, cfg, limit, need0, deadline, log):
    """The largest micro-batch (a multiple of the group size) whose step runs, or None.

    Straight-line fit of XLA's memory need at B0 and 2·B0 to ``limit``; then compile and
    one step at the predicted size, stepping down while the prediction or the run fails.
    Returns (B, step ms at B, need at B, note)."""
    g, b0 = cfg.group, cfg.batch

    def floor_g(x):
        return max(g, int(x) // g * g)

    _, need2, _ = trainer.compile(make_batch(cfg, 2 * b0))
    slope = (need2 - need0) / b0
    guess = floor_g(b0 + (limit - need0) / slope) if slope > 0 else cfg.max_batch
    guess = min(guess, cfg.max_batch)
    log(
        f"memory need {need0 / 2**20:.0f} MiB at B={b0}, {need2 / 2**20:.0f} MiB at "
        f"B={2 * b0}; limit {limit / 2**20:.0f} MiB → predicted largest B={guess}"
    )
    note = f"linear fit predicted {guess}"
    tried = []
    while guess >= g and time.time() < deadline:
        batch = make_batch(cfg, guess)
        try:
            compiled, need, _ = trainer.compile(batch)
            if need > limit:
                tried.append(f"{guess}: needs {need / 2**20:.0f} MiB")
                guess = min(guess - g, floor_g(guess * limit / need))
                continue
            trainer.run(compiled, batch)  # the step that must fit (includes warm-up)
            ms = trainer.time_steps(compiled, batch, min(2, cfg.timed_steps))
        except Exception as err:  # noqa: BLE001 - only out-of-memory is expected here
            if not out_of_memory(err):
                raise
            tried.append(f"{guess}: RESOURCE_EXHAUSTED")
            trainer.reset()
            guess = floor_g(guess * 0.9) if guess > g else 0
            continue
        finally:
            del batch
        if tried:
            note += "; " + ", ".join(tried)
        if guess >= cfg.max_batch:
            note += f"; the search's cap is {cfg.max_batch}"
        elif time.time() > deadline - 20:
            note += f"; B={guess + g} not compiled (time budget)"
        else:
            try:
                _, need_next, _ = trainer.compile(make_batch(cfg, guess + g))
                note += f"; B={guess + g} needs {need_next / 2**20:.0f} MiB" + (
                    " > limit" if need_next > limit else " <= limit (not run)"
                )
            except Exception as err:  # noqa: BLE001
                if not out_of_memory(err):
                    raise
                note += f"; B={guess + g}: RESOURCE_EXHAUSTED at compile"
        return guess, ms, need, note
    return (
        None,
        None,
        None,
        note + "; " + ", ".join(tried) + ("; time budget spent" if time.time() >= deadline else ""),
    )


def worker(path, cfg, out, deadline, mem_limit_mib):
    import jax

    from benchmarks import common

    def log(msg):
        print(f"[{path}] {msg}", flush=True)

    def emit(row):
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")

    start = time.perf_counter()
    trainer = Trainer(path, cfg)
    row = {"path": path, "params_M": trainer.n_params / 1e6, "B": cfg.batch, "T": cfg.seq}
    log(
        f"{trainer.n_params / 1e6:.1f}M parameters on {jax.devices()[0]} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    batch = make_batch(cfg, cfg.batch)
    compiled, need0, temp = trainer.compile(batch)
    log(f"compiled B={cfg.batch} ({time.perf_counter() - start:.1f} s)")
    row["loss"] = trainer.run(compiled, batch)  # first step: the freshly initialised model
    trainer.run(compiled, batch)
    row["step_ms"] = trainer.time_steps(compiled, batch, cfg.timed_steps)
    row["tokens_per_s"] = cfg.batch * cfg.seq / (row["step_ms"] * 1e-3)
    row["temp_mib"] = temp / 2**20
    row["need_mib"] = need0 / 2**20
    row["peak_mib"] = common.peak_mib()
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if mem_limit_mib:
        limit = mem_limit_mib * 2**20
    row["limit_mib"] = None if limit is None else limit / 2**20
    log(
        f"B={cfg.batch}: {row['step_ms']:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s, "
        f"peak {row['peak_mib']} MiB, loss {row['loss']:.6f} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    emit(row)
    del batch, compiled
    if limit is None:
        row["note"] = "largest B not searched: the device reports no memory limit"
    else:
        b, ms, need, note = largest_batch(trainer, cfg, limit, need0, deadline, log)
        row.update(
            largest_B=b,
            largest_step_ms=ms,
            note=note,
            largest_need_mib=None if need is None else need / 2**20,
            largest_tokens_per_s=None if ms is None else b * cfg.seq / (ms * 1e-3),
        )
        log(f"largest B={b} ({note}) ({time.perf_counter() - start:.1f} s)")
    emit(row)


# -- the driver --------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny model, any device")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument(
        "--budget", type=float, default=0, help="seconds per path (default 120; smoke 300)"
    )
    parser.add_argument(
        "--mem-limit-mib",
        type=float,
        default=0,
        help="search the largest batch against this limit instead of the "
        "device's (lets the search run on CPU)",
    )
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = SMOKE if args.smoke else Config()
    if args.worker:
        worker(args.worker, cfg, args.rows_out, args.deadline, args.mem_limit_mib)
        return

    budget = args.budget or (300 if args.smoke else 120)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="e2e_grpo_"))
    rows = []
    try:
        for path in args.paths.split(","):
            out = tmp / f"{path}.jsonl"
            extra = ["--smoke"] if args.smoke else []
            if args.mem_limit_mib:
                extra += ["--mem-limit-mib", str(args.mem_limit_mib)]
            env = {
                "XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get(
                    "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"
                ),
                "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
            }
            code, tail = run_worker(
                "benchmarks.e2e_grpo_step",
                [
                    "--worker",
                    path,
                    "--rows-out",
                    str(out),
                    "--deadline",
                    str(time.time() + budget),
                    *extra,
                ],
                sys.executable,
                budget + 60,
                env,
            )
            lines = out.read_text().splitlines() if out.exists() else []
            row = json.loads(lines[-1]) if lines else {"path": path}
            if code != 0:
                row["error"] = failure(code, tail, budget + 60)
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    losses = [r.get("loss") for r in rows if r.get("loss") is not None]
    config = (
        f"d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads, V={cfg.vocab}, "
        f"T={cfg.seq}, tied embedding (head layout vd), f32 params + AdamW, bf16 compute, "
        f"remat per block, GRPO groups of {cfg.group}"
    )
    print("model:", config)
    if len(losses) >= 2:
        print(
            "first-step losses:",
            ", ".join(f"{r['path']} {r['loss']:.6g}" for r in rows if r.get("loss") is not None),
        )
    for row in rows:
        row["config"] = config
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # after every worker
    from benchmarks import common

    print(common.write_results("e2e_grpo_step", rows, COLUMNS))


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
