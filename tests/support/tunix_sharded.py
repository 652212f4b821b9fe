"""The tunix losses on a (fsdp=2, tp=4) mesh of 8 host devices, sharded as tunix shards.

Called by tests/integrations/test_tunix.py::test_sharded_fsdp2_tp4_matches_tunix (tests/conftest.py
gives the test process 8 host devices), or run as a script (it sets the device count itself).
Parameters are placed by the models' own ShardingConfig (``nnx.get_named_sharding``: the vocabulary
of the LM head over "tp", D over "fsdp"), the example's batch axis over "fsdp" as tunix's trainer
does, inside ``with mesh``; then "jaxrl_grpo" (lm_head [D, V], reference and chunked backends) and
"jaxrl_ppo" with entropy (tied [V, D] embedding, chunked) must equal tunix's "grpo" / "ppo" on the
same sharded inputs (loss, every aux key, every parameter's gradient: 1e-5 of scale). Prints "tunix
sharded: all equal" on success.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before jax starts
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support import tunix_support as ts  # noqa: E402

VOCAB = 64  # divisible by tp = 4 (the vocabulary axis of emb_vd / emb_dv)
CASES = (("qwen3", "grpo", ("reference", "chunked")), ("qwen3_tied", "ppo", ("chunked",)))


def shard_model(model, mesh):
    graphdef, state = nnx.split(model)
    shardings = nnx.get_named_sharding(state, mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def shard_example(example, mesh):
    batch = NamedSharding(mesh, PartitionSpec("fsdp"))
    return jax.tree.map(lambda x: jax.device_put(x, batch), example)


def check(family, algo, backends, mesh):
    model = ts.make_model(family, VOCAB, dim=16, heads=4, kv_heads=4)
    if algo == "grpo":
        config = ts.grpo_config(
            0.7,
            loss_agg_mode="sequence-mean-token-mean",
            beta=0.04,
            kl_loss_mode="low_var_kl",
            epsilon_c=3.0,
        )
        example = ts.make_example(
            model, VOCAB, ts.ExampleSpec(sampler_is=True), seed=2, temperature=0.7
        )
    else:
        config = ts.ppo_config(entropy_coef=0.05)
        example = ts.make_example(
            model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=3, ppo=True
        )
    with mesh:
        sharded_model = shard_model(model, mesh)
        head = (
            sharded_model.lm_head.w if family == "qwen3" else sharded_model.embedder.input_embedding
        )
        print(f"{family}: head {head.shape} sharded {head.sharding.spec}", flush=True)
        example = shard_example(example, mesh)
        want = ts.loss_and_grads(algo, sharded_model, example, config)
        for backend in backends:
            got = ts.loss_and_grads(
                f"jaxrl_{algo}", sharded_model, example, config, backend=backend
            )
            ts.assert_same(got, want)
            print(f"{family} {algo} ({backend}): equal to tunix's sharded loss", flush=True)


def check_all():
    assert jax.device_count() >= 8, f"needs 8 devices, got {jax.device_count()}"
    # tunix builds its meshes with Auto axes (tunix/utils/mesh.py).
    mesh = jax.make_mesh(
        (2, 4),
        ("fsdp", "tp"),
        devices=jax.devices()[:8],
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    for family, algo, backends in CASES:
        check(family, algo, backends, mesh)
    print("tunix sharded: all equal")


if __name__ == "__main__":
    check_all()
