"""JAX rows of the side-by-side table: jaxrl_kernels, XLA with materialised logits, tokamax.

Each log-prob implementation is a function ``logp(h, w, t) -> [N] float32``; its forward is
``jax.jit(logp)`` and its forward+backward ``jax.jit(jax.grad(Σ g·logp, (h, w)))``. Our
losses are timed as users call them, ``jax.jit(jax.value_and_grad(loss, (h, w)))``, on a
problem whose gradient is the same one up to a factor: B = N sequences of one token,
advantages g, mask 1, token-mean aggregation, and (GRPO, PPO) old log-probs equal to the
forward's own, so that every ratio is 1 and the loss is −(1/N)·Σ g·logp; their errors are
taken after multiplying the gradient by −N. Times
after warm-up: ``*_ms`` the median host clock around a call and its ``block_until_ready``,
``*_device_ms`` the median span from its first kernel's start to its last one's end in a
profiler trace of synchronised calls (``common.call_spans``); extra memory is XLA's temp buffer size of
the compiled forward+backward (arguments and outputs not counted); errors are
‖got − exact‖/‖exact‖ over the whole gradient, in float32 on the device.

    python -m benchmarks.side_by_side.jax_worker --data X.npz --out rows.jsonl --deadline T
"""

from __future__ import annotations

import importlib.util
import sys
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np

import jaxrl_kernels as jk
from benchmarks import common
from benchmarks.side_by_side import shared


def ours(backend, layout):
    def logp(h, w, t):
        return jk.linear_logprobs(h, w, t, weight_layout=layout, backend=backend)

    return logp


def ours_fast(layout):
    def logp(h, w, t):
        return jk.linear_logprobs(h, w, t, weight_layout=layout, memory="fast")

    return logp


def ours_loss(op, layout, memory, h, w, t, g):
    """``loss(h, w)`` of our loss ``op`` whose gradient is −(1/N)·∇ Σ g·logp (module doc)."""
    n = h.shape[0]
    mask = jnp.ones((n, 1), jnp.float32)
    targets = t[:, None]
    old = jax.jit(lambda h, w: jk.linear_logprobs(h, w, t, weight_layout=layout, memory=memory))(
        h, w
    )[:, None]
    common = dict(weight_layout=layout, memory=memory)
    if op == "linear_grpo_loss":

        def loss(h, w):
            return jk.linear_grpo_loss(
                h[:, None], w, targets, old, jnp.zeros(n), mask, advantages=g, **common
            )[0]
    elif op == "linear_ppo_loss":

        def loss(h, w):
            return jk.linear_ppo_loss(h[:, None], w, targets, old, g, mask, **common)[0]
    else:

        def loss(h, w):
            return jk.linear_policy_gradient_loss(h[:, None], w, targets, g, mask, **common)

    return loss


def xla_materialised(h, w, t):
    """float32 logits [N, V] from the bf16 product, log_softmax, gather."""
    z = jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), t[:, None], axis=1)[:, 0]


def jnp_bf16_materialised(h, w, t):
    """bf16 logits [N, V] (the product's own dtype), log_softmax in float32, gather: the code
    most JAX users write."""
    z = jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=h.dtype)
    return jnp.take_along_axis(
        jax.nn.log_softmax(z.astype(jnp.float32), axis=-1), t[:, None], axis=1
    )[:, 0]


def import_tokamax():
    """tokamax and a note. tokamax imports xprof (a 22 MB profiler UI wheel with a native
    library) at import time, only for its xprof timers, which this benchmark does not use;
    where xprof is absent an empty module stands in for that one import."""
    note = ""
    if importlib.util.find_spec("xprof") is None:
        names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
        for name in names:
            sys.modules[name] = types.ModuleType(name)
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = sys.modules[names[-1]]
        note = "xprof absent: an empty module stood in for tokamax's import of it; "
    import tokamax

    return tokamax, note


def tokamax_impl(tokamax, implementation):
    """logp = −(tokamax's per-token cross-entropy, reduction="none"); weights [D, V]."""

    def logp(h, w_dv, t):
        loss = tokamax.linear_softmax_cross_entropy_loss(
            h, t, w_dv, reduction="none", implementation=implementation
        )
        return -loss.astype(jnp.float32)

    return logp


def timed(fn, args, budget_ms, smoke):
    """(wall ms, device ms): medians of synchronised calls, by the host clock and by the
    kernels' span in a profiler trace (None where the trace has no device kernels)."""
    wall = common.time_calls(
        fn,
        *args,
        warmup=2 if smoke else 3,
        runs=2 if smoke else 25,
        budget_ms=None if smoke else budget_ms,
    )
    runs = len(wall.samples)
    spans = common.call_spans(fn, args, runs + 1)[0][1:]  # the first call starts the trace
    return wall.median, (float(np.median([s[1] for s in spans])) if spans else None)


@jax.jit
def rel_err(got, exact):
    diff = got.astype(jnp.float32) - exact
    return jnp.sqrt(jnp.sum(diff * diff)) / jnp.sqrt(jnp.sum(exact * exact))


def same_bits(a, b):
    width = {2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return bool(
        jnp.array_equal(
            jax.lax.bitcast_convert_type(a, width), jax.lax.bitcast_convert_type(b, width)
        )
    )


def measure(logp, h, w, t, g, exact_dh, exact_dw, layout, smoke, loss=None):
    """One row's numbers; ``loss`` (our losses): time ``value_and_grad(loss)`` instead, and
    compare −N times its gradient with the exact one."""
    scale = 1.0
    if loss is None:

        def loss(h, w):
            return jnp.sum(g * logp(h, w, t))

        fwd = jax.jit(logp)
        fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w).compile()
        fwd_args = (h, w, t)
    else:
        fwd = jax.jit(loss)
        grads = jax.value_and_grad(loss, argnums=(0, 1))
        fwdbwd = jax.jit(lambda h, w: grads(h, w)[1]).lower(h, w).compile()
        fwd_args = (h, w)
        scale = -float(h.shape[0])
    row = {"fwdbwd_extra_mb": fwdbwd.memory_analysis().temp_size_in_bytes / 2**20}
    row["fwd_ms"], row["fwd_device_ms"] = timed(fwd, fwd_args, 2000.0, smoke)
    row["fwdbwd_ms"], row["fwdbwd_device_ms"] = timed(fwdbwd, (h, w), 2500.0, smoke)
    dh, dw = fwdbwd(h, w)
    dh2, dw2 = fwdbwd(h, w)
    row["bitwise_repeat"] = same_bits(dh, dh2) and same_bits(dw, dw2)
    dh = dh.astype(jnp.float32) * scale
    dw = dw.astype(jnp.float32) * scale
    row["err_dh"] = float(rel_err(dh, exact_dh))
    row["err_dW"] = float(rel_err(dw.T if layout == "dv" else dw, exact_dw))
    return row


def main():
    args = shared.worker_args(__doc__.split("\n")[0])
    budget = shared.Budget(args.deadline)
    data = shared.load_inputs(args.data)
    n, d, v = (int(x) for x in data["size"])
    base = {"N": n, "D": d, "V": v}
    h = jnp.asarray(data["h_bits"].view(jnp.bfloat16))
    w = jnp.asarray(data["w_bits"].view(jnp.bfloat16))
    w_dv = jax.block_until_ready(jnp.asarray(w.T))  # the same W, transposed once
    t = jnp.asarray(data["t"])
    g = jnp.asarray(data["g"])
    exact_dh = jnp.asarray(data["exact_dh"])
    exact_dw = jnp.asarray(data["exact_dw"])
    del data
    meta = common.metadata()
    print("jax worker:", meta, flush=True)
    jax_version = f"jax {jax.__version__}"

    impls = {}  # (impl, layout) -> (make, version, note, op, mode); make() -> (logp, loss)
    for backend, layout in ((None, "vd"), (None, "dv"), ("pallas", "vd"), ("chunked", "vd")):
        name = "jaxrl_kernels" + (f"[{backend}]" if backend else "")
        weight = w if layout == "vd" else w_dv
        if backend is None:
            choice = jk.explain("linear_logprobs", h, weight, t, weight_layout=layout)
            note = "automatic: " + choice.splitlines()[0].split(": ", 1)[-1]
        else:
            note = f"backend={backend!r}"
        impls[(name, layout)] = (
            lambda b=backend, lay=layout: (ours(b, lay), None),
            jax_version,
            note,
            "linear_logprobs",
            "lean",
        )
    for layout in ("vd", "dv"):
        impls[("jaxrl_kernels memory=fast", layout)] = (
            lambda lay=layout: (ours_fast(lay), None),
            jax_version,
            "memory='fast': logits kept as bf16 for the backward (3 GEMMs)",
            "linear_logprobs",
            "fast",
        )
    losses = [("linear_grpo_loss", lay, mem) for mem in ("lean", "fast") for lay in ("vd", "dv")]
    losses += [
        (op, lay, "fast")
        for op in ("linear_ppo_loss", "linear_policy_gradient_loss")
        for lay in ("vd", "dv")
    ]
    for op, layout, mem in losses:
        name = f"jaxrl_kernels {op}" + (" memory=fast" if mem == "fast" else "")
        impls[(name, layout)] = (
            lambda op=op, lay=layout, mem=mem: (
                None,
                ours_loss(op, lay, mem, h, w if lay == "vd" else w_dv, t, g),
            ),
            jax_version,
            "value_and_grad of the loss; B = N sequences of one token, ratio 1"
            + ("; the loss's gradient taken in the forward (3 GEMMs)" if mem == "fast" else ""),
            op,
            mem,
        )
    impls[("jnp_f32_materialised", "vd")] = (
        lambda: (xla_materialised, None),
        jax_version,
        "float32 logits, log_softmax, gather; jit",
        "linear_logprobs",
        "",
    )
    impls[("jnp_bf16_materialised", "vd")] = (
        lambda: (jnp_bf16_materialised, None),
        jax_version,
        "bf16 logits (dot with preferred_element_type=bf16), float32 log_softmax, gather; jit",
        "linear_logprobs",
        "",
    )
    try:
        tokamax, tnote = import_tokamax()
        tver = f"tokamax {tokamax.__version__}, {jax_version}"
        tnote += "logp = -(per-token loss, reduction='none'): L = sum(-g * loss) exactly"
        impls[("tokamax (default)", "dv")] = (
            lambda: (tokamax_impl(tokamax, None), None),
            tver,
            "implementation=None (mosaic_tpu declines off TPU, so 'xla': logits "
            "materialised); " + tnote,
            "cross_entropy",
            "",
        )
        impls[("tokamax chunked_xla", "dv")] = (
            lambda: (tokamax_impl(tokamax, "chunked_xla"), None),
            tver,
            "implementation='chunked_xla'; " + tnote,
            "cross_entropy",
            "",
        )
    except Exception as err:  # a missing wheel or an incompatible version: say so in its rows
        traceback.print_exc()
        for key in (("tokamax (default)", "dv"), ("tokamax chunked_xla", "dv")):
            impls[key] = (None, "", f"import failed: {shared.error_text(err)}", "cross_entropy", "")

    for name, layout in shared.selected(args.impls)["jax"]:
        make, version, note, op, mode = impls[(name, layout)]
        row = {
            "impl": name,
            "op": op,
            "mode": mode,
            "layout": layout,
            **base,
            "version": version,
            "note": note,
        }
        if make is None:
            row["error"], row["note"] = note, ""
        elif budget.spent():
            row["error"] = "skipped: the JAX worker's time budget was spent"
        else:
            start = time.perf_counter()
            try:
                logp, loss = make()
                row.update(
                    measure(
                        logp,
                        h,
                        w if layout == "vd" else w_dv,
                        t,
                        g,
                        exact_dh,
                        exact_dw,
                        layout,
                        args.smoke,
                        loss=loss,
                    )
                )
            except Exception as err:  # report, keep measuring the others
                traceback.print_exc()
                row["error"] = shared.error_text(err)
            print(f"{name} {layout}: {time.perf_counter() - start:.1f} s", flush=True)
        shared.write_row(args.out, row)


if __name__ == "__main__":
    main()
