"""Two processes joined by jax.distributed (CPU, gloo collectives), 4 devices each: no process
sees every device, and the ops still compute rows where they live and use a vocabulary-sharded
weight or logits in place, under jax.jit (Auto and Explicit mesh axes, option combinations, an
FSDP head, distillation lean and fast, sampler-matched log-probs with the vocabulary split across
the processes, packed rows with segment ids) and inside a user's jax.shard_map with
``vocab_axis`` (see multiprocess_worker.py).
One pair of processes per backend runs every case under both mesh types (starting and joining
them is a good part of the cost); CI runs the reference pair, the chunked and pallas pairs are
marked ``slow``, and under Auto axes only the linear case unless JAXRL_TEST_SLOW=1. On a host
of 4 or 8 GPUs the ``gpu`` test runs the same cases (all of them) with each process on half of
the GPUs."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import slow_backends

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "support", "multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


RUNS = ["Auto:linear,distill,packed", "Explicit:linear,options,distill,vocab_axis,sampler,packed"]
# CPU: under Auto axes the linear case only (distill and packed run under Explicit axes; all of
# them under both with JAXRL_TEST_SLOW=1)
CPU_RUNS = RUNS if os.environ.get("JAXRL_TEST_SLOW") == "1" else ["Auto:linear", RUNS[1]]


@pytest.mark.parametrize("backend", slow_backends("reference"))  # ~30 s, chunked ~70, pallas ~130
def test_two_processes(backend):
    _run_pair(backend, [{}, {}], CPU_RUNS)


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["ffi", "pallas"])
def test_two_processes_gpus(backend_name):
    """The same runs with each process on half of this host's GPUs (2 or 4 GPUs in all; NCCL)."""
    import jax

    gpus = jax.local_device_count() if jax.default_backend() == "gpu" else 0
    if gpus not in (4, 8):  # two processes of 2 or 4 GPUs each
        pytest.skip("needs 4 or 8 GPUs")
    half = [",".join(str(g) for g in range(i * gpus // 2, (i + 1) * gpus // 2)) for i in range(2)]
    _run_pair(
        backend_name,
        [
            dict(
                JAXRL_MULTIPROCESS_ON="gpu",
                CUDA_VISIBLE_DEVICES=ids,
                XLA_PYTHON_CLIENT_PREALLOCATE="false",
            )
            for ids in half
        ],
    )


def _run_pair(backend, extra_env, runs=RUNS):
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(i), port, backend, *runs],
            env=dict(env, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, extra in enumerate(extra_env)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for i, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        for run in runs:
            kind, cases = run.split(":")
            assert f"process {i}: ok ({backend}, {kind}, {cases})" in out, out[-4000:]
