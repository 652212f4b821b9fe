"""One process of the two-process test (test_multiprocess.py): jax.distributed over CPU (gloo).

Each process holds 4 of the 8 devices of a (data=2, model=4) mesh, so no process sees every
device. Hidden states are split over ``data`` (one row block per process), the weight over
``model``. The sharded value and gradients of linear_logprobs (and of linear_grpo_loss) must
equal the unsharded ones, which each process computes on its own first device.

usage: python multiprocess_worker.py <process id> <port> <backend> <Auto|Explicit>
"""

import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, backend, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxrl_kernels as jk  # noqa: E402

B, T, D, V = 4, 8, 32, 4096
rng = np.random.default_rng(0)  # same draw in both processes
h = rng.standard_normal((B, T, D)).astype(np.float32)
w = (rng.standard_normal((V, D)) / 4).astype(np.float32)
t = rng.integers(0, V, (B, T)).astype(np.int32)
old = (-8.0 + 0.3 * rng.standard_normal((B, T))).astype(np.float32)
rewards = rng.standard_normal(B).astype(np.float32)
mask = (rng.random((B, T)) < 0.8).astype(np.float32)

assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)


def place(x, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def loss(h, w, t, old, rewards, mask):
    lp, ent = jk.linear_logprobs(h, w, t, return_entropy=True, backend=backend)
    grpo, _, _ = jk.linear_grpo_loss(h, w, t, old, rewards, mask, group_size=2, backend=backend)
    return jnp.sum(lp * mask) + 0.1 * jnp.sum(ent) + grpo


args = (h, w, t, old, rewards, mask)
specs = (P("data", None, None), P("model", None), P("data", None), P("data", None), P("data"),
         P("data", None))
step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
value, (dh, dw) = step(*(place(x, s) for x, s in zip(args, specs)))
local = jax.local_devices()[0]
want_value, (want_dh, want_dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(
    *(jax.device_put(x, local) for x in args))
assert dw.sharding.spec[0] == "model", dw.sharding
got = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in (value, dh, dw)]
for name, g, want in zip(("value", "d_hidden", "d_weight"), got, (want_value, want_dh, want_dw)):
    want = np.asarray(want)
    err = float(np.max(np.abs(g - want)))
    scale = max(float(np.max(np.abs(want))), 1e-3)
    assert err <= 1e-5 * scale, f"process {pid}: {name} error {err:.3e} > 1e-5 x {scale:.3e}"
hlo = step.lower(*(place(x, s) for x, s in zip(args, specs))).compile().as_text()
gathered = [int(np.prod([int(d) for d in t.group(1).split(",") if d]))
            for m in re.finditer(r"= (.*?) all-gather(?:-start)?\(", hlo)
            for t in re.finditer(r"\w+\[([\d,]*)\]", m.group(1))]
limit = h.size // 8  # a device's share of the hidden states
assert all(n < limit for n in gathered), f"all-gathers of {gathered} elements (limit {limit})"
print(f"process {pid}: ok ({backend}, {kind})")
jax.distributed.shutdown()
