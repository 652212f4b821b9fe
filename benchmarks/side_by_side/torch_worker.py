"""PyTorch rows of the side-by-side table: materialised logits, Liger, Cut Cross-Entropy, QuACK.

Each implementation is a function ``logp(h, w, t) -> [N] float32``. Forward: under
``torch.no_grad`` with inputs that need no gradient. Forward+backward: ``torch.autograd.grad``
of L = Σ g·logp with respect to h and W. Times, medians after warm-up
(``benchmarks.torch_clock``): ``*_ms`` by the host clock around a run and ``synchronize`` (as
the JAX worker's around ``block_until_ready``), ``*_device_ms`` by CUDA events around it (the
JAX worker's device time is the kernels' span in a profiler trace). Extra memory:
``torch.cuda.max_memory_allocated`` during forward+backward above what was allocated before,
less the returned gradients (so, like XLA's temp size, neither inputs nor outputs count).
Errors: ‖got − exact‖/‖exact‖ over the whole gradient, in float32 on the device.

Liger and Cut Cross-Entropy are cross-entropy losses: their per-token loss (reduction
"none") is −logp, so L = Σ (−g)·loss is the same function, exactly. QuACK's linear
cross-entropy returns only a mean or a sum: its rows time L = Σ −logp (reduction "sum") and
compare with that L's exact gradients (``exact_dh_sum`` / ``exact_dw_sum`` of the inputs file).

    python -m benchmarks.side_by_side.torch_worker --data X.npz --out rows.jsonl --deadline T
"""

from __future__ import annotations

import time
import traceback

import numpy as np
import torch

from benchmarks import torch_clock
from benchmarks.side_by_side import shared


def torch_bf16_logits_f32_softmax(h, w, t):
    """bf16 logits [N, V], log_softmax in float32, gather."""
    z = h @ w.T
    return torch.log_softmax(z.float(), dim=-1).gather(1, t[:, None])[:, 0]


def torch_bf16_materialised(h, w, t):
    """bf16 logits [N, V] and ``F.cross_entropy`` on them, no upcast: the plain torch code."""
    z = h @ w.T
    loss = torch.nn.functional.cross_entropy(z, t, reduction="none")
    return -loss.float()


def liger(reduction="none"):
    """Liger's fused linear cross-entropy. ``reduction="none"``: ``logp(h, w, t)``, minus its
    per-token loss (Liger defers the gradients of that path to a backward that computes the
    chunked logits again); ``"sum"``: ``loss(h, w, t)``, its summed loss, the path that takes
    both gradients inside the forward (``benchmarks.token_peers`` says what that costs)."""
    import liger_kernel
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    version = getattr(liger_kernel, "__version__", None) or _dist_version("liger-kernel")
    if reduction == "sum":

        def loss(h, w, t):
            return liger_fused_linear_cross_entropy(h, w, t, reduction="sum")

        note = (
            "reduction='sum' (its fast path: both gradients taken chunk by chunk in the "
            "forward): L = sum(-logp) over the unmasked tokens"
        )
        return loss, f"liger-kernel {version}", note

    def logp(h, w, t):
        return -liger_fused_linear_cross_entropy(h, w, t, reduction="none").float()

    return (
        logp,
        f"liger-kernel {version}",
        (
            "-(per-token loss, reduction='none'; gradients recomputed in its backward): "
            "L = sum(-g * loss) exactly"
        ),
    )


def cce(filter_eps):
    import cut_cross_entropy
    from cut_cross_entropy import linear_cross_entropy

    def logp(h, w, t):
        return -linear_cross_entropy(h, w, t, reduction="none", filter_eps=filter_eps).float()

    note = (
        "gradient filtering on (its default): entries below eps(bf16)/32 skipped; "
        if filter_eps
        else "gradient filtering off; "
    )
    return (
        logp,
        f"cut-cross-entropy {cut_cross_entropy.__version__}",
        (note + "-(per-token loss, reduction='none'): L = sum(-g * loss) exactly"),
    )


def quack(scaled_exp):
    """QuACK's chunked linear cross-entropy (3 GEMMs: d_hidden and d_weight taken in the forward,
    per chunk of rows), summed over tokens: its API returns only a mean or a sum."""
    import quack
    from quack import linear_cross_entropy as lce

    fn = lce.scaled_exp_linear_cross_entropy if scaled_exp else lce.chunked_linear_cross_entropy
    extra = {} if scaled_exp else {"use_scaled_exp": False}

    def loss(h, w, t):
        return fn(h, w, t, reduction="sum", **extra)

    version = getattr(quack, "__version__", None) or _dist_version("quack-kernels")
    dsl = _dist_version("nvidia-cutlass-dsl")
    note = (
        "scaled-exp pipeline (bf16 exp-scaled logits)"
        if scaled_exp
        else "chunked_linear_cross_entropy(use_scaled_exp=False): logits chunk, glue, two GEMMs"
    )
    return (
        loss,
        f"quack-kernels {version}, nvidia-cutlass-dsl {dsl}",
        (
            note + "; reduction='sum' (its API has no per-token loss): L = sum(-logp), gradients "
            "against the exact ones of that L"
        ),
    )


def _dist_version(name):
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def timed(clock, fn, budget_ms, smoke):
    """(wall ms, device ms | None): medians after warm-up (``benchmarks.torch_clock``), the
    run count kept inside the time budget."""
    wall = clock.time_calls(
        fn,
        warmup=2 if smoke else 3,
        runs=2 if smoke else 25,
        budget_ms=None if smoke else budget_ms,
    )
    device = clock.time_calls(fn, warmup=0, runs=len(wall), events=True) if clock.cuda else None
    return torch_clock.median(wall), (torch_clock.median(device) if device else None)


def rel_err(got, exact):
    return float(torch.linalg.vector_norm(got.float() - exact) / torch.linalg.vector_norm(exact))


def same_bits(a, b):
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def measure(logp, h, w, t, g, exact_dh, exact_dw, clock, smoke, summed=None):
    """One row's numbers for ``logp(h, w, t) -> [N]`` (L = Σ g·logp), or for ``summed(h, w, t)
    -> L`` (a peer that returns only the summed loss; the exact gradients must be L's)."""

    def loss_of(h, w):
        return summed(h, w, t) if summed is not None else (g * logp(h, w, t)).sum()

    def fwd():
        with torch.no_grad():
            return summed(h, w, t) if summed is not None else logp(h, w, t)

    def fwdbwd():
        hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(loss_of(hg, wg), (hg, wg))

    row = {}
    row["fwd_ms"], row["fwd_device_ms"] = timed(clock, fwd, 2000.0, smoke)
    row["fwdbwd_ms"], row["fwdbwd_device_ms"] = timed(clock, fwdbwd, 2500.0, smoke)
    if clock.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        grads = fwdbwd()
        torch.cuda.synchronize()
        out_bytes = sum(x.numel() * x.element_size() for x in grads)
        row["fwdbwd_extra_mb"] = (torch.cuda.max_memory_allocated() - before - out_bytes) / 2**20
        del grads
    dh, dw = fwdbwd()
    dh2, dw2 = fwdbwd()
    row["bitwise_repeat"] = same_bits(dh, dh2) and same_bits(dw, dw2)
    row["err_dh"] = rel_err(dh, exact_dh)
    row["err_dW"] = rel_err(dw, exact_dw)
    return row


def main():
    args = shared.worker_args(__doc__.split("\n")[0])
    budget = shared.Budget(args.deadline)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = shared.load_inputs(args.data)
    n, d, v = (int(x) for x in data["size"])
    base = {"N": n, "D": d, "V": v}

    def bf16(bits):
        return (
            torch.from_numpy(np.ascontiguousarray(bits).view(np.int16))
            .view(torch.bfloat16)
            .to(device)
        )

    h, w = bf16(data["h_bits"]), bf16(data["w_bits"])
    t = torch.from_numpy(data["t"].astype(np.int64)).to(device)
    g = torch.from_numpy(data["g"]).to(device)
    exact_dh = torch.from_numpy(data["exact_dh"]).to(device)
    exact_dw = torch.from_numpy(data["exact_dw"]).to(device)
    exact_sum = {k: data.get(k) for k in ("exact_dh_sum", "exact_dw_sum")}
    del data
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    torch_version = f"torch {torch.__version__}"
    try:
        import triton

        torch_version += f", triton {triton.__version__}"
    except ImportError:
        pass
    print(f"torch worker: {torch_version} on {name}", flush=True)
    clock = torch_clock.Clock(device)

    makers = {
        "torch_bf16_materialised": lambda: (
            torch_bf16_materialised,
            "",
            "bf16 logits, F.cross_entropy(reduction='none') on "
            "them (no upcast), logp = -loss; eager",
        ),
        "torch_bf16_logits_f32_softmax": lambda: (
            torch_bf16_logits_f32_softmax,
            "",
            "bf16 logits, log_softmax in float32, gather; eager",
        ),
        "liger-kernel fused linear CE": liger,
        "cut-cross-entropy filter_eps='high'": lambda: cce("high"),
        "cut-cross-entropy filter_eps=None": lambda: cce(None),
        "quack_chunked": lambda: quack(False),
        "quack_scaled_exp": lambda: quack(True),
    }
    summed_impls = ("quack_chunked", "quack_scaled_exp")
    for impl, layout in shared.selected(args.impls)["torch"]:
        row = {
            "impl": impl,
            "op": "cross_entropy",
            "mode": "",
            "layout": layout,
            **base,
            "version": torch_version,
            "note": "",
        }
        start = time.perf_counter()
        logp = None
        try:
            logp, version, row["note"] = makers[impl]()
            if version:
                row["version"] = f"{version}, {torch_version}"
        except Exception as err:  # a missing or incompatible wheel: say so in its row
            traceback.print_exc()
            row["error"] = "import failed: " + shared.error_text(err)
        if logp is None:
            pass
        elif not impl.startswith("torch_") and device.type != "cuda":
            row["error"] = "skipped: its Triton kernels need a CUDA GPU (torch device: cpu)"
        elif budget.spent():
            row["error"] = "skipped: the PyTorch worker's time budget was spent"
        else:
            try:
                if impl in summed_impls:
                    if exact_sum["exact_dh_sum"] is None:
                        raise RuntimeError("the inputs file has no exact gradients of the sum")
                    dh_sum, dw_sum = (
                        torch.from_numpy(exact_sum[k]).to(device)
                        for k in ("exact_dh_sum", "exact_dw_sum")
                    )
                    row.update(
                        measure(None, h, w, t, g, dh_sum, dw_sum, clock, args.smoke, summed=logp)
                    )
                    del dh_sum, dw_sum
                else:
                    row.update(measure(logp, h, w, t, g, exact_dh, exact_dw, clock, args.smoke))
            except Exception as err:  # report, keep measuring the others
                traceback.print_exc()
                row["error"] = shared.error_text(err)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"{impl} {layout}: {time.perf_counter() - start:.1f} s", flush=True)
        shared.write_row(args.out, row)


if __name__ == "__main__":
    main()
