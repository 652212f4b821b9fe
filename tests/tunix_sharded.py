"""The tunix losses on a (fsdp=2, tp=4) mesh of 8 host devices, sharded as tunix shards.

Run by tests/test_tunix.py::test_sharded_fsdp2_tp4_matches_tunix in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count is fixed at JAX's start).
Parameters are placed by the models' own ShardingConfig (``nnx.get_named_sharding``), the
example's batch axis over "fsdp" as tunix's trainer does, inside ``with mesh``; then
"jaxrl_grpo" / "jaxrl_ppo" (reference and chunked backends) must equal tunix's "grpo" / "ppo"
on the same sharded inputs and the unsharded result (loss, every aux key, every parameter's
gradient: 1e-5 of scale).
Prints "tunix sharded: all equal" on success.
"""

from __future__ import annotations

import os
import sys

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

sys.path.insert(0, os.path.dirname(__file__))
import tunix_support as ts  # noqa: E402

VOCAB = 64  # divisible by tp = 4 (the vocabulary axis of emb_vd / emb_dv)
BACKENDS = ("reference", "chunked")


def shard_model(model, mesh):
    graphdef, state = nnx.split(model)
    shardings = nnx.get_named_sharding(state, mesh)
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def shard_example(example, mesh):
    batch = NamedSharding(mesh, PartitionSpec("fsdp"))
    return jax.tree.map(lambda x: jax.device_put(x, batch), example)


def check(family, mesh):
    model = ts.make_model(family, VOCAB, dim=16, heads=4, kv_heads=4)
    grpo = ts.grpo_config(0.7, loss_agg_mode="sequence-mean-token-mean", beta=0.04,
                          kl_loss_mode="low_var_kl", epsilon_c=3.0)
    example = ts.make_example(model, VOCAB, ts.ExampleSpec(sampler_is=True), seed=2,
                              temperature=0.7)
    ppo = ts.ppo_config(entropy_coef=0.05)
    ppo_example = ts.make_example(model, VOCAB, ts.ExampleSpec(token_advantages=True), seed=3,
                                  ppo=True)
    unsharded = {"grpo": ts.loss_and_grads("jaxrl_grpo", model, example, grpo),
                 "ppo": ts.loss_and_grads("jaxrl_ppo", model, ppo_example, ppo)}
    with mesh:
        sharded_model = shard_model(model, mesh)
        head = sharded_model.lm_head.w if family == "qwen3" else \
            sharded_model.embedder.input_embedding
        print(f"{family}: head {head.shape} sharded {head.sharding.spec}", flush=True)
        for name, ex, config in (("grpo", example, grpo), ("ppo", ppo_example, ppo)):
            ex = shard_example(ex, mesh)
            want = ts.loss_and_grads(name, sharded_model, ex, config)
            for backend in BACKENDS:
                got = ts.loss_and_grads(f"jaxrl_{name}", sharded_model, ex, config,
                                        backend=backend)
                ts.assert_same(got, want)
                ts.assert_same(got, unsharded[name])
                grads = got[2]
                head_grad = (grads["lm_head"]["w"] if family == "qwen3"
                             else grads["embedder"]["input_embedding"])
                print(f"  d_head sharding: {getattr(head_grad, 'value', head_grad).sharding}")
                print(f"{family} {name} ({backend}): equal to tunix's sharded loss and to the "
                      "unsharded one", flush=True)


def main():
    assert jax.device_count() == 8, f"needs 8 devices, got {jax.device_count()}"
    # tunix builds its meshes with Auto axes (tunix/utils/mesh.py).
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    for family in ("qwen3", "qwen3_tied"):
        check(family, mesh)
    print("tunix sharded: all equal")


if __name__ == "__main__":
    main()
