"""The PyTorch rows of ``benchmarks.bench_tokens`` (``--torch``, ``--peers``), in a process of
their own: PyTorch only, never JAX, so that the two allocators never share it.

Per (N, D, V) of the sweep, forward+backward (``torch.autograd.grad(L, (h, W))``) on the very
batch the JAX rows time: ``bench_tokens`` saves it (``--batch DIR``: bf16 hidden [B, T, D] and
head [V, D] as bit patterns, actions and mask, :func:`load_batch`) before JAX takes the device,
random or ``benchmarks.realistic_batch``'s. Without ``--batch`` (this module run by hand) the
batch is drawn here: bf16 hidden ~ N(0, 1), head ~ N(0, 4/D), uniform targets, no padding.
Padded positions (mask 0) take the masking each implementation has: target
``ignore_index=-100`` for the cross-entropy peers (Cut Cross-Entropy then leaves those rows
out of its kernels; Liger computes them and gives them no loss and no gradient), the mask in
the plain torch loss.

- ``torch bf16`` (``--torch``): the plain torch code of the GRPO loss: bf16 logits, float32
  ``log_softmax``, gather, clipped ratio, masked mean; eager.
- ``QuACK chunked``: ``chunked_linear_cross_entropy`` (``use_scaled_exp=False``), its summed
  loss (its API has no per-token loss), timed as that L.
- ``Liger``: ``liger_fused_linear_cross_entropy(reduction="sum")``, its summed loss: Liger's
  fast path, which computes both gradients chunk by chunk inside the forward and only scales
  them in the backward.
- ``Liger, per-token``: the same with ``reduction="none"``, the per-token loss a GRPO loss
  weights, timed as L = Σ g·loss with a random cotangent g ~ N(0, 1). Liger 0.8.5 cannot
  take that path's gradient in the forward (the per-token weights are not known yet), so its
  forward runs the chunked logits without gradients and its backward runs them again with
  the gradients: the logits' GEMM twice.
- ``CCE`` / ``CCE, no filtering``: Cut Cross-Entropy's ``linear_cross_entropy(e, c,
  targets, reduction="none")`` with its default ``filter_eps="auto"`` (gradient entries
  below eps(bf16)/32 skipped) and with ``filter_eps=None``, timed as L = Σ g·loss (its
  backward takes a per-token cotangent natively).

**Why the committed Liger rows (``bench_tokens_peers_eb186a5``, 55-79 ms at every N, 6-55× the
jnp code) are slow.** Mostly Liger's design, partly the call. Liger chunks the rows so that a
chunk's logits hold no more than N×D elements: ``chunk = next_pow2(ceil(N / ceil(V / D)))``,
that is ceil(V/D) = 64 chunks at V = 131072, D = 2048 (32 at D = 4096), whatever N is (4 rows
each at N = 256). Every chunk's GEMMs read the whole head W [V, D] (the logits, d_hidden) and
read and write the whole bf16 ``grad_weight`` [V, D] (its ``addmm`` accumulation): about
(V/D)·4·V·D·2 bytes = 8·V² bytes = 137 GB per call at V = 131072, at any N and D, ~29 ms at
an H200's 4.8 TB/s before any arithmetic, in skinny GEMMs (M = 4 … 256 rows). Those rows
called ``reduction="none"``, which adds a forward of the chunked logits without gradients
(another 2·V² bytes) before the backward runs them all again with gradients. The side-by-side
harness measured that same call at N = 4096 on an H100 (``linear_side_by_side.md``): 14.2 ms
forward alone, 79.1 ms forward+backward, so the two harnesses agree (79.1 / 59.2 ms = 1.34,
close to the H200/H100 bandwidth ratio 1.43, as a bandwidth-bound call should be). It is not
compilation or autotuning (the 3 warm-up calls compile Liger's one Triton kernel; it has no
autotuner), nor a float32 upcast (its GEMMs run in bf16, its ``grad_weight`` accumulates in
bf16). ``reduction="sum"`` (the ``Liger`` row) drops the gradient-free forward, the 14 of
79 ms above: expect it about a fifth faster than ``Liger, per-token``, still nearly flat in N
(~45-50 ms on an H200 at V = 131072). That is its fast path as shipped (default
``chunk_mem_const=1``); a larger ``chunk_mem_const`` trades memory for fewer chunks.

The peers compute cross-entropy, that is the log-probs; the GRPO loss on top of them adds one
elementwise pass over [N] values, negligible beside the [N, V] work. Each row is the median
CUDA-event time of ``runs`` calls after 3 warm-up calls (``benchmarks.torch_clock``), which
take the compilations (Liger's and CCE's Triton kernels, CCE's ``torch.compile``d sort, QuACK's
CuTe kernels).

Records: ``{"impl", "N", "D", "V", "fwdbwd_ms", "version", "note"}``, or with ``"error"``
instead of ``"fwdbwd_ms"``. An implementation that cannot be imported (or no CUDA GPU) gives
one record, without a size; one that fails at a size (out of memory) gives that size's record
and the sweep goes on. Each record is printed (stderr) and, with ``--records FILE``, appended
to that JSON-lines file as it is made, so that a worker that dies keeps what it measured.

    python -m benchmarks.token_peers '[[512, 2048, 131072]]' 20   # one JSON line of records
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

PEERS = ("QuACK chunked", "Liger", "Liger, per-token", "CCE", "CCE, no filtering")
"""Impl names of the peers' rows (``--peers``), in table order."""
TORCH = "torch bf16"
"""The plain torch code's row (``--torch``)."""
WARMUP = 3
IGNORE = -100
NOTE = (
    "; cross-entropy (the log-probs): the GRPO loss on top of them adds one elementwise "
    "pass over [N], negligible"
)


def error_text(err: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(err).split())
    return f"{type(err).__name__}: {msg[:limit]}"


def batch_paths(directory, n, d, v) -> dict[str, pathlib.Path]:
    """The files of one size's saved batch (``bench_tokens.save_batches``); the head's is
    shared by every N of one (D, V): both generators draw it from the seed, V and D alone."""
    root = pathlib.Path(directory)
    return {
        "hidden": root / f"hidden_{n}_{d}_{v}.npy",  # uint16 bf16 bits [B, T, D]
        "weight": root / f"weight_{d}_{v}.npy",  # uint16 bf16 bits [V, D]
        "actions": root / f"actions_{n}_{d}_{v}.npy",  # int32 [B, T]
        "mask": root / f"mask_{n}_{d}_{v}.npy",  # float32 [B, T]
    }


def load_batch(directory, n, d, v) -> dict:
    """One size's saved batch as NumPy arrays (:func:`batch_paths`)."""
    import numpy as np

    return {k: np.load(p) for k, p in batch_paths(directory, n, d, v).items()}


class Batch:
    """One size's torch tensors: h [N, D], W [V, D] (bf16), actions [N], targets [N]
    (``IGNORE`` where masked), mask [N], a cotangent g [N] and advantages [N] ~ N(0, 1), and
    the old log-probs [N] (−log V)."""

    def __init__(self, n, d, v, directory=None, seed=0, device="cuda"):
        import math

        import numpy as np
        import torch

        cuda = torch.device(device)
        gen = torch.Generator(device=cuda).manual_seed(seed)
        if directory is None:
            self.h = torch.randn(n, d, device=cuda, dtype=torch.bfloat16, generator=gen)
            self.w = (torch.randn(v, d, device=cuda, generator=gen) * (2.0 / d**0.5)).to(
                torch.bfloat16
            )
            self.actions = torch.randint(0, v, (n,), device=cuda, generator=gen)
            self.mask = torch.ones(n, device=cuda)
        else:
            data = load_batch(directory, n, d, v)

            def bf16(bits):
                flat = np.ascontiguousarray(bits).reshape(-1, bits.shape[-1]).view(np.int16)
                return torch.from_numpy(flat).to(cuda).view(torch.bfloat16)

            self.h, self.w = bf16(data["hidden"]), bf16(data["weight"])
            self.actions = torch.from_numpy(data["actions"].reshape(-1).astype(np.int64)).to(cuda)
            self.mask = torch.from_numpy(data["mask"].reshape(-1)).to(cuda)
        self.n = self.h.shape[0]
        self.t = torch.where(self.mask != 0, self.actions, torch.full_like(self.actions, IGNORE))
        self.g = torch.randn(self.n, device=cuda, generator=gen)
        self.adv = torch.randn(self.n, device=cuda, generator=gen)
        self.old = torch.full((self.n,), -math.log(v), device=cuda)


def plain_grpo(h, w, b):
    """The plain torch GRPO loss: bf16 logits, float32 log_softmax, gather, clipped ratio,
    masked mean."""
    import torch

    logp = torch.log_softmax((h @ w.T).float(), -1).gather(-1, b.actions[:, None])[:, 0]
    ratio = torch.exp(logp - b.old)
    per = -torch.minimum(ratio * b.adv, ratio.clamp(0.8, 1.28) * b.adv)
    return (per * b.mask).sum() / b.mask.sum().clamp_min(1.0)


def makers(torch_worker):
    """``{impl: maker}``, ``maker() -> (loss(h, W, batch) -> L, version, note)``; the peers
    are the side-by-side worker's functions, imported, not copied."""

    def summed(make):
        def maker():
            fn, version, note = make()
            return (lambda h, w, b: fn(h, w, b.t)), version, note + NOTE

        return maker

    def per_token(make):
        def maker():
            logp, version, note = make()
            return (lambda h, w, b: (b.g * logp(h, w, b.t)).sum()), version, note + NOTE

        return maker

    def plain():
        import torch

        note = "bf16 logits, float32 log_softmax, gather, clipped ratio, masked mean; eager"
        return plain_grpo, f"torch {torch.__version__}", note

    return {
        TORCH: plain,
        "QuACK chunked": summed(lambda: torch_worker.quack(False)),
        "Liger": summed(lambda: torch_worker.liger("sum")),
        "Liger, per-token": per_token(torch_worker.liger),
        "CCE": per_token(lambda: torch_worker.cce("auto")),
        "CCE, no filtering": per_token(lambda: torch_worker.cce(None)),
    }


def fwdbwd_ms(loss, b, runs, clock):
    """Median CUDA-event milliseconds of ``torch.autograd.grad(L, (h, W))`` after warm-up
    (``benchmarks.torch_clock``)."""
    import torch

    def fwdbwd():
        hg, wg = b.h.detach().requires_grad_(), b.w.detach().requires_grad_()
        return torch.autograd.grad(loss(hg, wg, b), (hg, wg))

    times = clock.time_calls(fwdbwd, warmup=WARMUP, runs=runs, events=True)
    return statistics.median(times)


class Records:
    """The records made so far: printed (stderr) and appended to ``path`` as they come."""

    def __init__(self, path=None):
        self.path, self.out = path, []

    def add(self, rec):
        self.out.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def worker(sizes, runs, impls=PEERS, directory=None, records_path=None):
    """The records (module docstring) of every impl of ``impls`` at every ``(N, D, V)``."""
    rec = Records(records_path)
    try:
        import torch

        from benchmarks import torch_clock
        from benchmarks.side_by_side import torch_worker
    except Exception as err:  # noqa: BLE001 - no torch (or a broken one): no peer can run
        for impl in impls:
            rec.add({"impl": impl, "error": "import failed: " + error_text(err)})
        return rec.out
    if not torch.cuda.is_available():
        for impl in impls:
            rec.add({"impl": impl, "error": "skipped: needs a CUDA GPU (torch sees none)"})
        return rec.out
    ready = {}
    torch_version = f"torch {torch.__version__}"
    every = makers(torch_worker)
    for impl in impls:
        try:
            fn, version, note = every[impl]()
        except Exception as err:  # noqa: BLE001 - a missing or incompatible wheel: one record
            rec.add({"impl": impl, "error": "import failed: " + error_text(err)})
            continue
        full = version if version.startswith("torch ") else f"{version}, {torch_version}"
        ready[impl] = (fn, full, note)
    clock = torch_clock.Clock(torch.device("cuda"))
    for n, d, v in sizes:
        try:
            b = Batch(n, d, v, directory)
        except Exception as err:  # noqa: BLE001 - a size that cannot be loaded: its records
            for impl in ready:
                rec.add({"impl": impl, "N": n, "D": d, "V": v, "error": error_text(err)})
            torch.cuda.empty_cache()
            continue
        for impl, (fn, version, note) in ready.items():
            row = {"impl": impl, "N": b.n, "D": d, "V": v}
            try:
                row["fwdbwd_ms"] = fwdbwd_ms(fn, b, runs, clock)
            except Exception as err:  # noqa: BLE001 - out of memory: this size's record says so
                row["error"] = error_text(err)
            row.update(version=version, note=note)
            rec.add(row)
            torch.cuda.empty_cache()
        del b
        torch.cuda.empty_cache()
    return rec.out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sizes", help="JSON [[N, D, V], ...]")
    parser.add_argument("runs", type=int)
    parser.add_argument("--impls", default=json.dumps(PEERS), help="the rows, a JSON list")
    parser.add_argument("--batch", help="the saved batch's directory (bench_tokens)")
    parser.add_argument("--records", help="append each record to this JSON-lines file")
    args = parser.parse_args(argv)
    out = worker(
        json.loads(args.sizes), args.runs, json.loads(args.impls), args.batch, args.records
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
