"""Shared test configuration: the backend list, markers, random inputs and tolerances.

Every op test takes a ``backend`` argument and is parametrized over :data:`CPU_BACKENDS`
(the one list); set ``JAXRL_TEST_PALLAS=1`` to add the Pallas backend (interpret mode
on CPU). Cases too slow for interpret mode carry ``@pytest.mark.pallas_slow`` (or are
wrapped with :func:`pallas_slow`) and are skipped for ``backend="pallas"`` unless
``JAXRL_TEST_PALLAS_SLOW=1``; a case marked ``slow_on(*backends)`` (:func:`slow_on`) is
skipped for those backends unless ``JAXRL_TEST_SLOW=1``. A test marked ``@pytest.mark.op(*names)`` (the public ops it
calls; bare ``@pytest.mark.op``: its ``op`` parameter) runs each function once: a backend
whose call of each of them runs the very function an earlier backend runs (:func:`same_code`:
reference and chunked share ppo_math's ppo_loss and aggregation_math's group_advantages; kl_penalty, aggregate
and policy_gradient_loss dispatch to no backend) is skipped unless ``JAXRL_TEST_SLOW=1``.

Tolerances (docs/api.md "Numerics"), see :func:`assert_close`:

* float32 inputs: ``|got - want| <= 1e-5 * S`` elementwise, ``S`` = the largest magnitude
  of the float64 result (at least SCALE_FLOOR), or a larger condition scale a test passes:
  max|z| for log-probs, whose value is a difference of two O(|z|) terms; aggregate(|terms|)
  for a loss that is a signed sum. A max-norm relative bound: an elementwise relative bound
  cannot hold for results that are small through cancellation.
* bf16/f16 inputs: ``|got - want| <= |want32 - want| + 1e-3 * S`` elementwise, where want32
  is the same formula evaluated in float32 NumPy on the same upcast inputs.
* gradients of bf16/f16 inputs (returned in that dtype) are judged over the whole tensor, as
  docs/api.md says: ``‖got − want‖ / ‖want‖ <= ‖round(want32) − want‖ / ‖want‖ + 1e-3``,
  with round() to the gradient's dtype.
"""

from __future__ import annotations

import inspect
import itertools
import os
import zlib

# Eight host devices for the many-device tests (test_sharding.py); single-device tests still run
# on device 0. Must be set before jax starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# XLA's CPU compiler (jaxlib 0.12) can spend many minutes in its call inliner propagating the
# Python stack frames of each op's location into inlined while loops (the loops of Pallas
# interpret mode); the cost grows with the frames kept per location (default 10). Five keep
# every compile here short; none (0, the default here) cut the pallas tests' time by another
# 10-15% (the HLO loses only its source locations: Python tracebacks are unchanged). The
# environment variable carries it to the processes tests start; set it to keep frames.
TRACEBACK_FRAMES = int(os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0"))
jax.config.update("jax_traceback_in_locations_limit", TRACEBACK_FRAMES)

# On CPU the suite's time is mostly XLA compiling thousands of small programs (every eager op
# call compiles its primitives one by one, ~20 ms each), not running them: compile them with
# XLA's backend optimizations off (jax_disable_most_optimizations: LLVM -O0, no expensive
# passes), which cuts a compile by a quarter or more. It changes how fast a program runs; the
# float64-oracle tolerances hold as before. The environment variable carries it to the processes
# tests start (test_multiprocess.py, test_demo.py). Not on GPUs; JAXRL_TEST_XLA_OPT=1 keeps
# XLA's defaults everywhere. The modules of DEFAULT_XLA_MODULES run with XLA's defaults (see
# default_xla_optimizations).
FAST_COMPILE = (
    os.environ.get("JAXRL_TEST_XLA_OPT") != "1"
    and jax.default_backend() == "cpu"
    and os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "1") == "1"
)
if FAST_COMPILE:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)

# Assertions that hold for XLA's default code generation only: batch invariance (a row's bits
# independent of the other rows) is a property of the programs XLA emits at its default
# optimization level; at -O0 XLA:CPU's code for a row differs with the batch size
# (test_batch_invariance.py fails there).
DEFAULT_XLA_MODULES = {"test_batch_invariance"}


@pytest.fixture(autouse=True, scope="module")
def default_xla_optimizations(request):
    """XLA's default optimizations for the modules of DEFAULT_XLA_MODULES. jax's in-memory
    caches are cleared on the way in and out (a cached executable was compiled under the
    other setting; the persistent cache's keys include it)."""
    if not FAST_COMPILE or _basename(request.module) not in DEFAULT_XLA_MODULES:
        yield
        return
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
        jax.clear_caches()


CPU_BACKENDS = ["reference", "chunked"]
if os.environ.get("JAXRL_TEST_PALLAS") == "1":
    CPU_BACKENDS.append("pallas")

RTOL_F32 = 1e-5
LOW_PRECISION_SLACK = 1e-3
# S is at least this: a result that is exactly 0 in exact arithmetic (e.g. every gradient at V = 1)
# comes out as rounding noise of O(eps * operands); operands in these tests are O(1), so an
# absolute 1e-8 (f32) is allowed there. Exact zeros that docs/api.md promises are checked by assert_zero.
SCALE_FLOOR = 1e-3

LOW_DTYPES = (jnp.bfloat16, jnp.float16)


# ----------------------------------------------------------------------------- pytest hooks


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped where there is none)")
    config.addinivalue_line("markers", "slow: larger CPU cases; skipped unless JAXRL_TEST_SLOW=1")
    config.addinivalue_line(
        "markers",
        "pallas_slow: too slow for Pallas interpret mode; skipped for backend='pallas' "
        "unless JAXRL_TEST_PALLAS_SLOW=1",
    )
    config.addinivalue_line(
        "markers",
        "slow_on(*backends): skipped for those values of 'backend' unless JAXRL_TEST_SLOW=1",
    )
    config.addinivalue_line(
        "markers",
        "grid_full: the whole many-device grid (test_sharding_grid.py); skipped "
        "unless JAXRL_TEST_GRID=full",
    )
    config.addinivalue_line(
        "markers",
        "op(*names): the public ops a test exercises (none: its 'op' parameter); a "
        "backend that runs the same function as an earlier one is skipped unless "
        "JAXRL_TEST_SLOW=1",
    )


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames and not _parametrizes(metafunc, "backend"):
        metafunc.parametrize("backend", CPU_BACKENDS)


def _parametrizes(metafunc, name):
    """Whether the test parametrizes ``name`` itself (as with :func:`slow_backends`)."""
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        if name in names:
            return True
    return False


def slow_backends(*kept):
    """CPU_BACKENDS as the values of ``backend`` for ``@pytest.mark.parametrize``, each backend
    not in ``kept`` marked ``slow``: a test too costly to run on every backend in CI runs on
    ``kept`` there, on all of them with JAXRL_TEST_SLOW=1."""
    return [pytest.param(b, marks=() if b in kept else pytest.mark.slow) for b in CPU_BACKENDS]


# Modules whose tests take longest (tens of seconds each on CPU: processes started, models
# trained), run first: under ``pytest -n 2 --dist worksteal`` a long test that starts last
# leaves the other worker idle at the end.
SLOW_MODULES_FIRST = (
    "test_multiprocess",
    "test_tunix_learners",
    "test_bench_distill",
    "test_demo",
    "test_examples",
    "test_bench_sampler_logprobs",
    "test_bench_many_devices",
)


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    module = lambda item: _basename(getattr(item, "module", None))
    items.sort(key=lambda item: order.get(module(item), len(order)))  # stable: rest in order
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    skip_slow_pallas = pytest.mark.skip(
        reason="pallas_slow case; set JAXRL_TEST_PALLAS_SLOW=1 to run it in interpret mode"
    )
    run_slow_pallas = os.environ.get("JAXRL_TEST_PALLAS_SLOW") == "1"
    skip_grid = pytest.mark.skip(reason="the full sharding grid; set JAXRL_TEST_GRID=full")
    run_grid = os.environ.get("JAXRL_TEST_GRID") == "full"
    skip_slow = pytest.mark.skip(reason="slow case; set JAXRL_TEST_SLOW=1 to run it")
    run_slow = os.environ.get("JAXRL_TEST_SLOW") == "1"
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
        if "grid_full" in item.keywords and not run_grid:
            item.add_marker(skip_grid)
        callspec = getattr(item, "callspec", None)
        if (
            callspec is not None
            and callspec.params.get("backend") == "pallas"
            and "pallas_slow" in item.keywords
            and not run_slow_pallas
        ):
            item.add_marker(skip_slow_pallas)
        # every slow_on mark counts (a case may carry one per backend)
        slow_backends_of = {b for mark in item.iter_markers("slow_on") for b in mark.args}
        if (
            callspec is not None
            and callspec.params.get("backend") in slow_backends_of
            and not run_slow
        ):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"slow on backend {callspec.params['backend']!r}; set "
                    "JAXRL_TEST_SLOW=1 to run it"
                )
            )
        same = _same_code_as(item)
        if same is not None and not run_slow:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs the same function as backend {same!r}; set JAXRL_TEST_SLOW=1 "
                    "to run it anyway"
                )
            )


def _basename(module) -> str:
    """A test module's own name (``test_x`` of ``tests.<layer>.test_x``)."""
    return getattr(module, "__name__", "").rpartition(".")[2]


def _same_code_as(item) -> str | None:
    """For a test marked ``op``: the earlier backend its backend repeats for every op, if any."""
    marker = item.get_closest_marker("op")
    callspec = getattr(item, "callspec", None)
    if marker is None or callspec is None or "backend" not in callspec.params:
        return None
    ops = marker.args or (callspec.params["op"],)
    same = {same_code(op, callspec.params["backend"]) for op in ops}
    return same.pop() if len(same) == 1 else None


def same_code(op: str, backend: str) -> str | None:
    """The first backend before ``backend`` in CPU_BACKENDS whose call of the public op ``op``
    runs the very same function (None if none does): an op that dispatches to no backend
    runs one function whatever the backend asked for."""
    from jaxrl_kernels import dispatch
    from jaxrl_kernels.dispatch import contract

    earlier = CPU_BACKENDS[: CPU_BACKENDS.index(backend)]
    if op not in contract.OP_PRIMITIVE:
        return earlier[0] if earlier else None
    impl = dispatch.select(op, contract.Problem(), backend).impl
    return next(
        (b for b in earlier if dispatch.select(op, contract.Problem(), b).impl is impl), None
    )


def pallas_slow(*values):
    """A ``pytest.param`` for a case that is too slow for Pallas interpret mode."""
    return pytest.param(*values, marks=pytest.mark.pallas_slow)


def slow_on(backends, *values):
    """A ``pytest.param`` skipped for the ``backends`` (a tuple of backend names) unless
    JAXRL_TEST_SLOW=1: a combination that another case covers on those backends."""
    return pytest.param(*values, marks=pytest.mark.slow_on(*backends))


def pallas_sample(pallas, *axes):
    """Every combination of the values of ``axes`` as a ``pytest.param`` (a tuple value gives
    several parameters); those not in the set ``pallas`` carry ``pallas_slow``: interpret mode
    runs the covering sample ``pallas``."""
    cases = [
        sum((v if isinstance(v, tuple) else (v,) for v in combo), ())
        for combo in itertools.product(*axes)
    ]
    return [
        pytest.param(
            *case,
            id="-".join(_param_id(v) for v in case),
            marks=() if case in pallas else pytest.mark.pallas_slow,
        )
        for case in cases
    ]


def _param_id(value):
    if isinstance(value, tuple):  # a shape
        return "x".join(map(str, value))
    return dtype_id(value) if isinstance(value, type) else str(value)


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: fresh inputs per test, reproducible per run."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# ----------------------------------------------------------------------------- calling ops


def call(fn, backend, *args, **kwargs):
    """Call a public op on ``backend``: through ``backend=`` where the op takes it,
    else inside ``use_backend`` (ops whose docs/api.md signature has no backend argument)."""
    import jaxrl_kernels as jk

    if "backend" in inspect.signature(fn).parameters:
        return fn(*args, backend=backend, **kwargs)
    with jk.use_backend(backend):
        return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- inputs


def dtype_id(dt):
    return jnp.dtype(dt).name


def rand(rng, shape, dtype=jnp.float32, scale=1.0, loc=0.0):
    """Normal samples as a jax array of ``dtype`` and as the float64 values it holds."""
    x = jnp.asarray((loc + scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)
    return x, np.asarray(x).astype(np.float64)


def as_jnp(x64, dtype):
    """A float64 numpy array as a jax array of dtype, and the float64 values it holds."""
    x = jnp.asarray(np.asarray(x64, np.float32)).astype(dtype)
    return x, np.asarray(x).astype(np.float64)


def cotangent(rng, shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def random_mask(rng, b, t, *, p=0.75, empty_rows=(0,)):
    """A {0,1} float mask [B, T] with the listed rows fully masked and no other empty row."""
    m = (rng.random((b, t)) < p).astype(np.float32)
    m[:, 0] = 1
    for r in empty_rows:
        if r < b:
            m[r] = 0
    return m


def ppo_token_inputs(rng, lp64, old64, dtype, *, adv_rank=2, empty_rows=(1,)):
    """The per-token inputs of a PPO loss around float64 ``logp`` / ``old_logp`` [B, T]: jax
    arrays of ``dtype`` with their float64 values (``as_jnp``), and a mask."""
    b, t = lp64.shape
    adv_shape = (b, t) if adv_rank == 2 else (b,)
    arrays = dict(
        logp=as_jnp(lp64, dtype),
        old_logp=as_jnp(old64, dtype),
        advantages=as_jnp(rng.standard_normal(adv_shape), dtype),
        rollout_logp=as_jnp(old64 + 0.4 * rng.standard_normal((b, t)), dtype),
        # |ref - logp| >= 0.15 stays > 0 after bf16 rounding (no tie at the kink of "abs")
        ref_logp=as_jnp(
            lp64 + rng.choice([-1, 1], (b, t)) * (0.15 + 0.4 * rng.random((b, t))), dtype
        ),
        entropy=as_jnp(np.abs(rng.standard_normal((b, t))) * 3, dtype),
    )
    return arrays, random_mask(rng, b, t, empty_rows=empty_rows)


# ----------------------------------------------------------------------------- tolerances


def is_low(dtype):
    return jnp.dtype(dtype) in [jnp.dtype(d) for d in LOW_DTYPES]


def _half_ulp_rel(dtype):
    return float(jnp.finfo(dtype).eps) / 2


def assert_close(got, want, *, in_dtype=jnp.float32, want32=None, scale=None, name="value"):
    """Check ``got`` (a library output) against the float64 oracle ``want``.

    ``in_dtype``: the dtype of the op's floating inputs (selects the docs/api.md tolerance);
    ``want32``: the oracle evaluated in float32 on the same inputs (needed for bf16/f16);
    ``scale``: a condition scale S (at least max|want| is always used).
    NaN must be at exactly the same positions; +-inf must match exactly.
    """
    got_arr = np.asarray(got)
    out_dtype = got_arr.dtype
    g = got_arr.astype(np.float64)
    w = np.asarray(want, np.float64)
    assert g.shape == w.shape, f"{name}: shape {g.shape} != expected {w.shape}"
    nan_g, nan_w = np.isnan(g), np.isnan(w)
    assert np.array_equal(nan_g, nan_w), (
        f"{name}: NaN at {np.argwhere(nan_g != nan_w)[:5].tolist()} differs from the oracle"
    )
    inf_w = np.isinf(w)
    assert np.array_equal(g[inf_w], w[inf_w]) and not np.isinf(g[~inf_w]).any(), (
        f"{name}: infinities differ"
    )
    fin = ~nan_w & ~inf_w
    g, w = g[fin], w[fin]
    if w.size == 0:
        return
    s = float(np.max(np.abs(w), initial=0.0))
    if scale is not None:
        s = max(s, float(np.max(np.abs(np.asarray(scale, np.float64)))))
    s = max(s, SCALE_FLOOR)
    err = np.abs(g - w)
    if is_low(in_dtype):
        assert want32 is not None, "low-precision check needs want32"
        w32 = np.asarray(want32, np.float64)[fin]
        if out_dtype not in (np.float32, np.float64):  # a gradient in the input dtype
            _assert_grad_norm(g, w, w32, out_dtype, name)
            return
        bound = np.abs(w32 - w) + LOW_PRECISION_SLACK * s
        rule = f"|f32 formula err| + {LOW_PRECISION_SLACK} * S"
    else:
        bound = RTOL_F32 * s + _half_ulp_rel(out_dtype) * np.abs(w) * (out_dtype != np.float32)
        rule = f"{RTOL_F32} * S"
    bad = err > bound
    if bad.any():
        i = int(np.argmax(err - bound))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{err.size} elements off (in={jnp.dtype(in_dtype).name}, "
            f"out={out_dtype}); worst: got {g[i]!r} want {w[i]!r} err {err[i]:.3e} > bound "
            f"{bound[i]:.3e} ({rule}, S={s:.3e})"
        )


def _assert_grad_norm(got, want, want32, dtype, name):
    """The whole-tensor rule for a gradient in a 16-bit dtype (see the module docstring)."""
    rounded = np.asarray(jnp.asarray(want32, jnp.float32).astype(dtype)).astype(np.float64)
    norm = max(float(np.linalg.norm(want)), SCALE_FLOOR * np.sqrt(want.size))
    err = float(np.linalg.norm(got - want)) / norm
    bound = float(np.linalg.norm(rounded - want)) / norm + LOW_PRECISION_SLACK
    assert err <= bound, (
        f"{name}: ‖got − want‖/‖want‖ = {err:.3e} > {bound:.3e} (the float32 formula rounded "
        f"to {np.dtype(dtype).name}, + {LOW_PRECISION_SLACK}); max |got − want| "
        f"{float(np.max(np.abs(got - want))):.3e}"
    )


def assert_bitwise(a, b, what="rerun"):
    """Two pytrees of arrays bitwise identical: structure, dtypes, shapes and bytes."""
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, what
        assert x.tobytes() == y.tobytes(), f"{what}: not bitwise identical"


def assert_f32(*xs):
    for x in xs:
        dtype = jnp.asarray(x).dtype
        assert dtype == jnp.float32, f"output dtype {dtype} != float32"


def assert_zero(x, name="gradient"):
    """Exactly zero (or a float0/None cotangent)."""
    if x is None:
        return
    a = np.asarray(x)
    if a.dtype == jax.dtypes.float0:
        return
    a = a.astype(np.float64)
    assert not np.any(a != 0), f"{name} must be exactly zero, max |x| = {np.abs(a).max()}"
