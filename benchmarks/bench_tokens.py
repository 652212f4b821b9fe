"""``linear_grpo_loss`` forward+backward against the plain code and the GEMM floor, per token count.

Question: at every token count a trainer runs per device, is the library (lean, the default,
and ``memory="fast"``) at least as fast as what a JAX user writes without it, and how far from
the matrix units' floor? Each row is ``jax.jit(jax.value_and_grad(loss, (hidden, weight)))``
of a GRPO loss (groups of 2, bf16 hidden [N, D] and head [V, D]), the median of synchronised
calls by the host clock after a warm-up, and XLA's temp size:

- ``jnp bf16``: ``einsum`` to bf16 logits, float32 ``log_softmax`` and gather
  (``jk.token_logprobs``, reference backend), the same loss (:func:`losses`);
- ``ours default`` / ``ours lean`` / ``ours fast``: ``jk.linear_grpo_loss`` with
  ``memory=None`` (``"auto"``) / ``"lean"`` / ``"fast"``
  (``ours fast, XLA logits``: its logits and statistics by XLA, as off Hopper; ``ours fast,
  logits kept``: its relative form withheld, the logits' gradient written over the kept
  logits in the forward, ``head.relative_probs``);
- ``3 GEMMs``: the three products of a forward+backward that keeps the logits (h·Wᵀ, G·W,
  Gᵀ·h, bf16 in and out) through XLA's cuBLAS calls: the floor of ``fast`` and of the plain
  code; ``lean`` computes the logits twice, so its floor is 4/3 of it (``floor_ms`` columns).
- ``torch bf16``: the plain torch code of the same loss (bf16 logits, float32 ``log_softmax``,
  masked mean) in a separate PyTorch process, when torch is importable (``--torch``);
- the peers (``--peers``): the peer libraries' fused linear cross-entropy, forward+backward in
  that PyTorch process: QuACK's ``chunked_linear_cross_entropy`` (its summed loss: its API
  has no per-token loss), Liger's ``liger_fused_linear_cross_entropy`` with
  ``reduction="sum"`` (``Liger``, its fast path) and ``"none"`` (``Liger, per-token``, the
  path a per-token loss takes, which computes the logits twice), Cut Cross-Entropy's
  ``linear_cross_entropy`` with its default gradient filtering (``CCE``) and without (``CCE,
  no filtering``). They compute cross-entropy, the log-probs: the GRPO loss on top adds one
  elementwise pass over [N], negligible. ``benchmarks.token_peers`` says what each row calls
  and why the earlier Liger rows (``reduction="none"``) were 55-79 ms at every N.

The PyTorch rows run on the very batch the JAX rows time, random or realistic: before JAX
takes the device, a short JAX process saves each size's batch (bf16 bits of hidden and head,
actions, mask) to a temporary directory, the PyTorch process loads it, then this process loads
it too. Padded positions are masked as each peer can (``ignore_index=-100``; the mask in the
torch loss). The PyTorch process runs before this one touches the device (its memory pool);
its rows are timed by CUDA events around each call (median of ``--runs`` calls after 3 warm-up
calls) and have no temp size or floor; ``x_jnp`` divides by the jnp bf16 row of the same size.
A peer that is not installed (or a size it fails at) is printed and leaves a row with
``error`` and no times; it never stops the sweep, and a PyTorch process that dies keeps the
rows it had written. The table adds the ``version`` and ``error`` columns when a row has one
(``note`` is in the JSON only).

    python -m benchmarks.bench_tokens                    # the sweep (GPU), bench_tokens.{json,md}
    python -m benchmarks.bench_tokens --torch --peers    # with torch, QuACK, Liger, CCE
    python -m benchmarks.bench_tokens --profile 512      # where one call's device time goes
    python -m benchmarks.bench_tokens --small            # toy sizes, any device
    python -m benchmarks.bench_tokens --batch realistic --padding 0.35   # an RL batch
    # ... --sizes realistic_pair --torch --peers: torch and every peer on the same RL batch

``benchmarks/plot_tokens.py`` draws µs per token against N from the JSON (matplotlib).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from benchmarks import output
from benchmarks.token_peers import PEERS, TORCH  # torch is imported only inside its worker

COLUMNS = [
    "impl",
    "N",
    "D",
    "V",
    "padded",
    "fwdbwd_ms",
    "us_per_token",
    "x_floor",
    "x_jnp",
    "temp_mib",
]
TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
SIZES = {
    "full": [(n, d, 131072) for d in (2048, 4096) for n in TOKENS]
    + [(n, 4096, 151936) for n in (512, 2048, 8192)],
    "d2048": [(n, 2048, 131072) for n in TOKENS],
    "d4096": [(n, 4096, 131072) for n in TOKENS] + [(n, 4096, 151936) for n in (512, 2048, 8192)],
    "small_n": [(n, 2048, 131072) for n in (256, 512, 1024, 2048, 4096)] + [(512, 4096, 131072)],
    "small": [(8, 32, 1000), (64, 32, 1000)],
    "peer_shapes": [(4096, 2048, 131072), (8192, 4096, 131072)],
    "realistic": [(n, d, 131072) for d in (2048, 4096) for n in (2048, 4096, 16384)],
    "realistic_pair": [(4096, 2048, 131072), (16384, 4096, 131072)],
}


def inputs(n, d, v, seed=0, batch="random", padding=0.0):
    """bf16 hidden [B, T, D], head [V, D], actions, old log-probs, rewards and mask: the
    inputs of every loss of :func:`losses`. ``batch="random"``: B = 2 sequences per 1024
    tokens (at least 2), hidden N(0, 1), head N(0, 4/D), uniform actions;
    ``"realistic"``: ``benchmarks.realistic_batch`` (peaked rows, sampled actions, B
    completions of 512 tokens). ``padding``: that fraction of the positions masked on
    average, at each completion's tail (``realistic_batch.padding_mask``)."""
    return completed(*drawn(n, d, v, seed, batch, padding), batch)


def drawn(n, d, v, seed=0, batch="random", padding=0.0):
    """(hidden, head, actions, mask) of :func:`inputs`. Either batch draws the head from
    ``seed``, V and D alone (``token_peers.batch_paths`` keeps one per (D, V))."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import realistic_batch

    if batch == "realistic":
        return realistic_batch.make(n, d, v, padding=padding, seed=seed).as_tuple()
    b = max(2, 2 * (n // 1024))
    t = n // b
    keys = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(keys[0], (b, t, d), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (v, d), jnp.float32) * (2.0 / np.sqrt(d))).astype(jnp.bfloat16)
    a = jax.random.randint(keys[2], (b, t), 0, v)
    mask = realistic_batch.padding_mask(jax.random.fold_in(keys[0], 7), b, t, padding)
    return h, w, a, mask


def completed(h, w, a, mask, batch):
    """:func:`inputs` from (hidden, head, actions, mask): old log-probs −0.3 (realistic) or
    −log V (random), rewards 0 … B−1."""
    import jax.numpy as jnp
    import numpy as np

    b, t = mask.shape
    old = -0.3 if batch == "realistic" else -np.log(w.shape[0])
    return (
        h,
        w,
        a,
        jnp.full((b, t), old, jnp.float32),
        jnp.arange(b, dtype=jnp.float32),
        mask,
    )


def save_batches(sizes, directory, batch="random", padding=0.0, seed=0):
    """Write each size's :func:`drawn` batch to ``directory`` (``token_peers.batch_paths``:
    bf16 as uint16 bits), for the PyTorch process and :func:`saved_inputs`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import token_peers

    for n, d, v in sizes:
        h, w, a, mask = drawn(n, d, v, seed, batch, padding)
        paths = token_peers.batch_paths(directory, n, d, v)
        bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))  # noqa: E731
        np.save(paths["hidden"], bits(h))
        if not paths["weight"].exists():
            np.save(paths["weight"], bits(w))
        np.save(paths["actions"], np.asarray(a, np.int32))
        np.save(paths["mask"], np.asarray(mask, np.float32))
        print(f"saved the {batch} batch N={n} D={d} V={v}", flush=True)
        del h, w, a, mask


def saved_inputs(directory, n, d, v, batch="random"):
    """:func:`inputs` of one size from the batch :func:`save_batches` wrote."""
    import jax
    import jax.numpy as jnp

    from benchmarks import token_peers

    data = token_peers.load_batch(directory, n, d, v)

    def bf16(bits):
        return jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)

    a = jnp.asarray(data["actions"])
    return completed(
        bf16(data["hidden"]), bf16(data["weight"]), a, jnp.asarray(data["mask"]), batch
    )


BATCH_TIMEOUT = 900  # seconds for the process that saves the batches


def save_in_process(sizes, directory, batch, padding):
    """:func:`save_batches` in a JAX process of its own, which gives the device back when it
    exits (this one must not take it before the PyTorch process has run). None, or why not."""
    code = (
        "import json,sys; from benchmarks.bench_tokens import save_batches; "
        "save_batches(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]))"
    )
    cmd = [sys.executable, "-c", code, json.dumps(sizes), str(directory), batch, str(padding)]
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        proc = subprocess.run(
            cmd,
            cwd=pathlib.Path(__file__).resolve().parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=BATCH_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return f"saving the batch ran past {BATCH_TIMEOUT} s"
    print(proc.stdout, end="", flush=True)
    if proc.returncode:
        print("saving the batch failed:", proc.stderr[-2000:])
        last = next((x for x in reversed(proc.stderr.splitlines()) if x.strip()), "")
        return f"saving the batch failed (code {proc.returncode}): {last[:250]}"
    return None


def losses():
    """``{impl: loss(hidden, weight, actions, old_logp, rewards, mask)}``."""
    import jax.numpy as jnp

    import jaxrl_kernels as jk

    groups = jk.Groups(size=2)
    config = jk.PolicyLoss(clip_low=0.2, clip_high=0.28)

    def plain(h, w, a, old, r, mask):
        logp = jk.token_logprobs(jnp.einsum("btd,vd->btv", h, w), a, backend="reference")
        adv = jk.group_advantages(r, groups=groups)
        return jk.ppo_loss(logp, old, adv, mask, config=config)[0]

    def ours(memory):
        def loss(h, w, a, old, r, mask):
            return jk.linear_grpo_loss(
                h, w, a, old, r, mask, groups=groups, config=config, memory=memory
            )[0]

        return loss

    return {
        "jnp bf16": plain,
        "ours default": ours(None),
        "ours lean": ours("lean"),
        "ours fast": ours("fast"),
        "ours fast, XLA logits": xla_logits(ours("fast")),
        "ours fast, logits kept": logits_kept(ours("fast")),
    }


def traced_under(fn, patch):
    """``fn`` run (and so traced) inside the context manager ``patch()``."""

    def traced(*args):
        with patch():
            return fn(*args)

    return traced


def xla_logits(fn):
    """``fn`` run (and so traced) with the ffi backend's ``kept_logits`` withheld:
    ``memory="fast"``'s logits and their statistics from XLA's GEMM and reductions (the
    reference backend's), as off Hopper, against the kernel that writes them and folds them at
    once."""
    from unittest import mock

    def withheld():
        from jaxrl_kernels.backends import ffi

        others = {name: op for name, op in ffi.OPS.items() if name != "kept_logits"}
        return mock.patch.dict(ffi.OPS, others, clear=True)

    return traced_under(fn, withheld)


def logits_kept(fn):
    """``fn`` traced with the fast loss's relative form withheld (``head.relative_probs``): the
    logits kept and their gradient written over them in the forward, as for a head the
    relative form does not serve, against the relative form's ``exp(z − z_t)``."""
    from unittest import mock

    from jaxrl_kernels.head import relative_probs

    return traced_under(fn, lambda: mock.patch.object(relative_probs, "MIN_ROWS", 2**62))


def three_gemms(h, w, *_):
    """The GEMMs of a forward+backward that keeps bf16 logits, nothing else (the floor)."""
    import jax.numpy as jnp

    logits = jnp.einsum("btd,vd->btv", h, w)
    g = (logits * 0.5).astype(h.dtype)  # an elementwise step XLA fuses into the GEMM's epilogue
    return jnp.einsum("btv,vd->btd", g, w), jnp.einsum("btv,btd->vd", g, h)


def steps():
    """``{impl: jitted step(h, w, a, old, r, mask)}``."""
    import jax

    out = {
        impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1))) for impl, loss in losses().items()
    }
    out["3 GEMMs"] = jax.jit(three_gemms)
    return out


def profile(n, d, v, top=12):
    """Per impl: one call's device span and its kernels by summed time (3 traced calls)."""
    import jax

    from benchmarks import common

    args = inputs(n, d, v)
    for impl, step in steps().items():
        common.warm_up(step, *args, seconds=0.5)
        spans, kernels, _ = common.call_spans(step, args, calls=3)
        per_call = collections.Counter()
        for k in kernels:
            per_call[k["name"][:90]] += k["dur"] / 1e3 / 3
        lead, span, busy, tail, _ = spans[-1]
        print(
            f"== {impl} N={n} D={d} V={v}: span {span:.3f} ms, kernels busy {busy:.3f}, "
            f"host lead {lead:.3f}, tail {tail:.3f}; {len(kernels) // 3} kernels per call"
        )
        for name, ms in per_call.most_common(top):
            print(f"   {ms:8.3f} ms  {name}")
        jax.clear_caches()


PEER_TIMEOUT = int(os.environ.get("BENCH_PEERS_TIMEOUT", "1800"))
"""Seconds for the whole PyTorch process (``BENCH_PEERS_TIMEOUT``); the rows it wrote stay."""


def jnp_row_ms(rows, n, d, v):
    """The jnp bf16 row's milliseconds at (N, D, V) (NaN if it has none)."""
    return next(
        (
            r["fwdbwd_ms"]
            for r in rows
            if r["impl"] == "jnp bf16" and (r["N"], r["D"], r["V"]) == (n, d, v)
        ),
        float("nan"),
    )


def peer_results(sizes, runs, impls=PEERS, directory=None):
    """The PyTorch rows' records (``benchmarks.token_peers``: ``impls`` on the batch saved in
    ``directory``) from a separate process. Records it wrote before dying (or running past
    :data:`PEER_TIMEOUT`) are kept; an impl it never reported gets one record that says why,
    as does each size it did not reach of an impl it reported."""
    with tempfile.TemporaryDirectory(prefix="token_peers_") as tmp:
        path = pathlib.Path(tmp) / "records.jsonl"
        cmd = [sys.executable, "-m", "benchmarks.token_peers", json.dumps(sizes), str(runs)]
        cmd += ["--impls", json.dumps(list(impls)), "--records", str(path)]
        cmd += ["--batch", str(directory)] if directory else []
        reason = None
        try:
            proc = subprocess.run(
                cmd,
                cwd=pathlib.Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=PEER_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            reason = f"the PyTorch worker ran past {PEER_TIMEOUT} s"
        else:
            if proc.returncode:
                print("the PyTorch worker failed:", proc.stderr[-2000:])
                last = next((x for x in reversed(proc.stderr.splitlines()) if x.strip()), "")
                reason = f"the PyTorch worker exited with code {proc.returncode}: {last[:250]}"
        records = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    reason = reason or "the PyTorch worker printed no record of it"
    out = []
    for impl in impls:
        mine = [r for r in records if r.get("impl") == impl]
        if not mine:
            out.append({"impl": impl, "error": reason})
            continue
        out += mine
        if any("N" not in r for r in mine):
            continue  # a record without a size stands for every size
        done = {(r["N"], r["D"], r["V"]) for r in mine}
        out += [
            {"impl": impl, "N": n, "D": d, "V": v, "error": reason}
            for n, d, v in sizes
            if (n, d, v) not in done
        ]
    return out


def peer_rows(results, rows):
    """The rows of the peers' records: ``us_per_token`` and ``x_jnp`` against ``rows``' jnp
    bf16 row of the same size. A record with an error is printed and kept (an import failure
    is one record per peer, so it is reported once)."""
    out = []
    for rec in results:
        row = {"impl": rec["impl"]}
        row.update((k, rec[k]) for k in ("N", "D", "V") if k in rec)
        if "error" in rec:
            size = f" N={rec['N']} D={rec['D']} V={rec['V']}" if "N" in rec else ""
            print(f"{rec['impl']}{size}: {rec['error']}", flush=True)
            row["error"] = rec["error"]
        else:
            n, ms = rec["N"], rec["fwdbwd_ms"]
            row.update(
                fwdbwd_ms=ms,
                us_per_token=1e3 * ms / n,
                x_jnp=ms / jnp_row_ms(rows, n, rec["D"], rec["V"]),
            )
        row.update((k, rec[k]) for k in ("version", "note") if k in rec)
        out.append(row)
    return out


def torch_worker(sizes, runs):
    """[((N, D, V), median ms)] of the plain torch GRPO loss forward+backward, bf16 logits."""
    import torch

    from benchmarks import torch_clock

    out = []
    for n, d, v in sizes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(
            n, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True
        )
        w = (
            (torch.randn(v, d, device="cuda", generator=gen) * (2.0 / d**0.5))
            .to(torch.bfloat16)
            .requires_grad_()
        )
        a = torch.randint(0, v, (n,), device="cuda", generator=gen)
        old = torch.full((n,), -float(torch.log(torch.tensor(float(v)))), device="cuda")
        adv = torch.randn(n, device="cuda", generator=gen)

        def step():
            logp = torch.log_softmax((h @ w.T).float(), -1).gather(-1, a[:, None])[:, 0]
            ratio = torch.exp(logp - old)
            loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv).mean()
            loss.backward()
            h.grad = w.grad = None

        times = torch_clock.Clock().time_calls(step, warmup=3, runs=runs, events=True)
        out.append(((n, d, v), torch_clock.median(times)))
        h = w = None  # the next size's tensors replace these: free them first
        torch.cuda.empty_cache()
    return out


def jax_rows(sizes, runs, batch, padding, directory=None):
    """The JAX impls' rows (:func:`steps`) at every size, on the batch saved in ``directory``
    (:func:`save_batches`) or drawn here."""
    import jax

    from benchmarks import common

    rows = []
    for n, d, v in sizes:
        if directory:
            data = saved_inputs(directory, n, d, v, batch)
        else:
            data = inputs(n, d, v, batch=batch, padding=padding)
        n = data[0].shape[0] * data[0].shape[1]
        padded = 1.0 - float(data[-1].mean())
        if batch == "realistic":
            from benchmarks import realistic_batch

            stats = realistic_batch.statistics(realistic_batch.Batch(*data[:3], data[-1]))
            print({"N": n, "D": d, "V": v, **stats}, flush=True)
        timed = {}
        for impl, step in steps().items():
            try:
                common.warm_up(step, *data, seconds=0.3)
                timed[impl] = (
                    common.median_ms(step, *data, runs=runs),
                    common.temp_mib(step, *data),
                )
            except Exception as e:  # noqa: BLE001 - an impl out of memory still leaves its row
                print(f"{impl} N={n} D={d} V={v}: {type(e).__name__}: {str(e)[:200]}")
        del data
        jax.clear_caches()
        floor = timed.get("3 GEMMs", (float("nan"),))[0]
        jnp_ms = timed.get("jnp bf16", (float("nan"),))[0]
        for impl, (ms, temp) in timed.items():
            own_floor = floor * (4 / 3 if impl == "ours lean" else 1)
            row = {
                "impl": impl,
                "N": n,
                "D": d,
                "V": v,
                "padded": padded,
                "fwdbwd_ms": ms,
                "us_per_token": 1e3 * ms / n,
                "floor_ms": own_floor,
                "x_floor": ms / own_floor,
                "x_jnp": ms / jnp_ms,
                "temp_mib": temp,
            }
            print(row, flush=True)
            rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    output.output_arguments(parser)
    parser.add_argument("--sizes", default="full", choices=sorted(SIZES))
    parser.add_argument("--small", action="store_true", help="toy sizes, any device")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--torch", action="store_true", help="add the plain torch rows")
    parser.add_argument(
        "--peers",
        nargs="?",
        const=";".join(PEERS),
        default="",
        metavar="NAMES",
        help="add the peers' fused linear cross-entropy rows (QuACK, Liger, Cut Cross-Entropy); "
        "NAMES, separated by ';' (names hold commas), picks some of them (a call with a short time limit)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="profile the impls at N tokens (D, V: --profile-shape)",
    )
    parser.add_argument("--profile-shape", default="2048,131072", metavar="D,V")
    parser.add_argument("--name", default="bench_tokens", help="the results' file name")
    parser.add_argument(
        "--batch",
        default="random",
        choices=("random", "realistic"),
        help="random heads, or benchmarks.realistic_batch (peaked rows, sampled actions)",
    )
    parser.add_argument(
        "--padding", type=float, default=0.0, help="the fraction of positions masked (tails)"
    )
    args = parser.parse_args()

    from benchmarks import common

    if args.profile:
        d, v = map(int, args.profile_shape.split(","))
        profile(args.profile, d, v)
        return
    sizes = SIZES["small" if args.small else args.sizes]
    peers = [name.strip() for name in args.peers.split(";") if name.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"--peers: unknown {unknown}; the peers are {list(PEERS)}")
    impls = ([TORCH] if args.torch else []) + peers
    records, directory = [], None
    with tempfile.TemporaryDirectory(prefix="bench_tokens_batch_") as tmp:
        if impls:
            # The PyTorch process runs before this one touches the device (its memory pool),
            # on the batches a JAX process of its own saved; this one then loads them too.
            why = save_in_process(sizes, tmp, args.batch, args.padding)
            if why is None:
                directory = tmp
                records = peer_results(sizes, args.runs, impls, directory)
            else:
                records = [{"impl": impl, "error": why} for impl in impls]
        rows = jax_rows(sizes, args.runs, args.batch, args.padding, directory)
    rows += peer_rows(records, rows)
    extra = [c for c in ("version", "error") if any(c in r for r in rows)]
    print(common.write_results(args.name, rows, COLUMNS + extra))


if __name__ == "__main__":
    main()
