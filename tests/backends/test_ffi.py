"""The ``ffi`` backend (SM90 custom call): build, lowering, dispatch; on a Hopper GPU, values.

CPU (CI): the extension is built when nvcc is present and imports without a GPU; the op
lowers for CUDA to the custom call (forward and gradient); the work planner covers every
tile once; dispatch declines ffi with the reason. GPU (``-m gpu``, Hopper only): values
against the float64 oracle over N ∈ {1, 100, 4096}, D ∈ {64, 2048, 4096}, V ∈ {1000,
32768, 50257, 131072}, both layouts, bias, temperature, bf16 and f16; invalid rows and
out-of-range targets; gradients through the custom_vjp; bitwise determinism.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk
from benchmarks import kernel_entry
from benchmarks.studies.variants import ffi_xla_gemms
from jaxrl_kernels import dispatch
from jaxrl_kernels.backends import ffi
from jaxrl_kernels.backends.ffi import distill as ffi_distill
from jaxrl_kernels.backends.ffi import extension
from jaxrl_kernels.backends.ffi import kept_gemms as ffi_kept_gemms
from jaxrl_kernels.backends.ffi import kept_set as ffi_kept_set
from jaxrl_kernels.backends.ffi import linear as ffi_linear
from jaxrl_kernels.dispatch.contract import Parts, Problem
from jaxrl_kernels.engine import fused_loss, linear_head, row_skip
from jaxrl_kernels.engine.linear_head import HeadCall
from jaxrl_kernels.head import head_grad, relative_probs, rounded_logits
from jaxrl_kernels.sharding.placement import Placement
from tests.conftest import assert_bitwise, assert_close, assert_f32, cotangent
from tests.support import oracle

OFF = {"OFF", "0", "FALSE", "NO", "N"}
ON = {"ON", "1", "TRUE", "YES", "Y"}


def _hopper_visible() -> bool:
    """What csrc/CMakeLists.txt asks under AUTO: nvidia-smi reports a GPU of compute capability 9.x."""
    if shutil.which("nvidia-smi") is None:
        return False
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return out.returncode == 0 and any(c.strip().startswith("9.") for c in out.stdout.split())


def _cuda_build_expected() -> bool:
    """The install builds the extension with JAXRL_KERNELS_BUILD_CUDA=ON (CI), or under AUTO
    (the default) where nvcc is found and a Hopper GPU is visible."""
    mode = os.environ.get("JAXRL_KERNELS_BUILD_CUDA", "AUTO").upper()
    if mode in OFF:
        return False
    return mode in ON or (shutil.which("nvcc") is not None and _hopper_visible())


# ----------------------------------------------------------------------------- CPU (CI)


def test_extension_built_and_imports():
    if not _cuda_build_expected():
        pytest.skip(
            "pure-Python install: no Hopper GPU and nvcc, and JAXRL_KERNELS_BUILD_CUDA is not ON"
        )
    assert extension.sm90 is not None, (
        f"the build was expected, but no extension: {extension.IMPORT_ERROR}"
    )
    assert "sm_90a" in extension.sm90.build_info()
    # JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON (CI) builds the measurement-only handlers as well
    if os.environ.get("JAXRL_KERNELS_MEASUREMENT_HANDLERS", "OFF").upper() in ON:
        assert extension.sm90.measurement_handlers, (
            "JAXRL_KERNELS_MEASUREMENT_HANDLERS is ON, but the extension has no measurement handlers"
        )
    measurement = [ffi_linear.GRAD_TARGET] if extension.sm90.measurement_handlers else []
    assert sorted(extension.sm90.registrations()) == sorted(
        [
            ffi_linear.TARGET,
            ffi_linear.KEPT_TARGET,
            ffi_linear.KEPT_EXP_TARGET,
            ffi_linear.BACKWARD_TARGET,
            extension.UNINITIALIZED_TARGET,
            ffi_distill.STATS_TARGET,
            ffi_distill.GRAD_TARGET,
            ffi_kept_set.TARGET,
            ffi_kept_gemms.TARGET,
        ]
        + measurement
    )
    assert extension.sm90.DISTILL_TILE_COLS == ffi_distill.TILE_COLS
    assert extension.sm90.PAIR_STATS_K == ffi_distill.PAIR_STATS_K


@pytest.fixture
def sm90():
    """The extension module, for the tests of its host-side planners (skipped without it)."""
    if extension.sm90 is None:
        pytest.skip(f"extension not built: {extension.IMPORT_ERROR}")
    return extension.sm90


def _tile_grid(sm90, n, cols):
    """(row blocks, column tiles) of an [n, cols] logit block in the kernels' tiles."""
    return -(-n // sm90.TILE_ROWS), -(-cols // sm90.TILE_COLS)


@pytest.mark.parametrize(
    "n,v,sms",
    [
        (1, 1000, 132),
        (100, 32768, 132),
        (4096, 131072, 132),
        (8192, 151936, 132),
        (300, 50257, 7),
        (5000, 300, 132),
    ],
)
def test_planner_covers_every_tile_once(sm90, n, v, sms):
    plan = sm90.plan(n, v, sms)
    rows, tiles = _tile_grid(sm90, n, v)
    assert (plan["row_blocks"], plan["vocab_tiles"]) == (rows, tiles)
    assert 1 <= plan["grid"] <= sms and 1 <= plan["splits"] <= tiles
    assert plan["partials_bytes"] == 3 * 4 * plan["splits"] * n  # 3 floats per row per split
    seen = np.zeros((rows, tiles), np.int64)
    load = np.zeros(plan["grid"], np.int64)
    for u in range(rows * plan["splits"]):
        p, s, begin, end = sm90.decode_unit(u, rows, plan["splits"], plan["group_rows"], tiles)
        assert 0 <= s < plan["splits"] and begin < end
        seen[p, begin:end] += 1
        load[u % plan["grid"]] += end - begin
    assert (seen == 1).all()
    assert load.max() == plan["makespan"]


def _inputs(n=6, d=16, v=40, layout="vd", dtype=jnp.bfloat16, bias=True, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype)
    wshape = (v, d) if layout == "vd" else (d, v)
    w = (jax.random.normal(k[1], wshape, jnp.float32) / 4).astype(dtype)
    b = jax.random.normal(k[2], (v,), jnp.float32).astype(dtype) if bias else None
    t = jnp.arange(n, dtype=jnp.int32) % v
    return h, w, b, t


def test_dv_slice_not_a_multiple_of_8_is_refused_when_traced():
    """A device's "dv" slice of 36 columns (a vocabulary of 144 split four ways): the per-device
    call raises when traced, rather than the kernel failing at run time."""
    h, w, b, t = _inputs(v=36, layout="dv", bias=False)
    rv = jnp.ones(t.shape, bool)
    with pytest.raises(NotImplementedError, match="not a multiple of 8"):
        jax.jit(
            lambda h, w: kernel_entry.ffi_linear_logprobs(
                h, w, None, t, rv, weight_layout="dv", temperature=1.0, return_entropy=False
            )
        ).trace(h, w)


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_lowers_to_the_custom_call_for_cuda(layout, with_bias):
    h, w, b, t = _inputs(layout=layout, bias=with_bias)
    rv = jnp.ones(t.shape, bool)

    def logp_sum(h, w, b):
        lp, ent = kernel_entry.ffi_linear_logprobs(
            h, w, b, t, rv, weight_layout=layout, temperature=0.7, return_entropy=True
        )
        return jnp.sum(lp) + jnp.sum(ent)

    fwd = jax.jit(logp_sum).trace(h, w, b).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{ffi_linear.TARGET}" in fwd
    assert ("weight_dv = true" in fwd) == (layout == "dv")
    assert ("has_bias = true" in fwd) == with_bias
    assert "splits = 0 : i32" in fwd  # ffi.linear.Config.splits: the planner chooses
    grad = jax.jit(jax.grad(logp_sum, argnums=(0, 1))).trace(h, w, b)
    text = grad.lower(lowering_platforms=("cuda",)).as_text()
    assert f"custom_call @{ffi_linear.TARGET}" in text
    # the backward dispatch picks at lowering time (platform cpu here): the ffi backward's
    # own custom call when asked for directly: one call for every chunk, no loop
    n = t.shape[0]
    rows = jnp.ones((n,), jnp.float32)

    def backward_text(**kw):
        bwd = jax.jit(
            lambda *a: ffi_linear.linear_backward(*a, weight_layout=layout, temperature=0.7, **kw)
        )
        return (
            bwd.trace(h, w, b, t, rows, rows, rows, rows)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )

    text = backward_text()
    assert text.count(f"stablehlo.custom_call @{ffi_linear.BACKWARD_TARGET}") == 1
    assert "stablehlo.while" not in text and ffi_linear.GRAD_TARGET + "(" not in text
    assert ("has_entropy = true" in text) and (("has_bias = true" in text) == with_bias)


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_fast_loss_forward_is_one_custom_call_for_cuda(layout):
    """memory="fast" on ffi's ``kept_logits``: the forward's logits and statistics come from
    the kept-logits call (no GEMM of XLA's and no reduction over them), and ``jax.grad`` of the
    loss runs the backward's two GEMMs only."""
    h, w, b, t = _inputs(layout=layout, bias=False)
    rv = jnp.ones(t.shape, bool)
    loss_fn = lambda logp, entropy, inputs: jnp.sum(logp * inputs) + jnp.sum(entropy)

    def loss(h, w):
        call = HeadCall(weight_layout=layout, temperature=0.7, return_entropy=True)
        return fused_loss.fused_linear_loss(
            ffi_linear.kept_logits,
            loss_fn,
            h,
            w,
            None,
            t,
            rv,
            jnp.linspace(-1, 1, t.shape[0]),
            call,
        )

    fwd = jax.jit(loss).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()
    assert fwd.count(f"stablehlo.custom_call @{ffi_linear.KEPT_TARGET}") == 1
    assert "stablehlo.dot_general" not in fwd and ffi_linear.TARGET + "(" not in fwd
    grad = (
        jax.jit(jax.grad(loss, argnums=(0, 1)))
        .trace(h, w)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert grad.count(f"stablehlo.custom_call @{ffi_linear.KEPT_TARGET}") == 1
    assert grad.count("stablehlo.dot_general") == 2


def test_fast_loss_kept_logits_at_every_row_under_row_skipping_for_cuda():
    """Row skipping (1024 rows, the last 300 masked): each branch's kept-logits call takes its
    S rows of hidden states and returns the logits at all 1024 rows (``Placement.logits_rows``;
    the call zeroes the rows past S), so no branch pads them into a second buffer. Branches of
    ``relative_probs.MIN_ROWS`` rows or more call the relative form's target, the others the
    kept logits'."""
    n, d, v = 1024, 16, 40
    h, w, _, t = _inputs(n=n, d=d, v=v, bias=False)
    rv = jnp.arange(n) < n - 300
    loss_fn = lambda logp, entropy, inputs: jnp.sum(logp * inputs)  # noqa: E731

    def loss(h, w):
        call = HeadCall(weight_layout="vd", temperature=1.0, return_entropy=False)
        return fused_loss.fused_linear_loss(
            ffi_linear.kept_logits, loss_fn, h, w, None, t, rv, jnp.ones((n,)), call
        )

    text = jax.jit(loss).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()
    targets = f"({ffi_linear.KEPT_TARGET}|{ffi_linear.KEPT_EXP_TARGET})"
    signature = re.compile(
        rf"@{targets}\(.*: \(tensor<(\d+)x{d}xbf16>.*\) -> \(tensor<(\d+)x{v}xbf16>"
    )
    calls = [m.groups() for m in map(signature.search, text.splitlines()) if m]
    assert sorted(int(rows) for _, rows, _ in calls) == sorted(row_skip.bucket_sizes(n)), calls
    assert all(int(out) == n for _, _, out in calls), calls
    relative = [int(rows) >= relative_probs.MIN_ROWS for _, rows, _ in calls]
    assert [target == ffi_linear.KEPT_EXP_TARGET for target, _, _ in calls] == relative, calls
    pads = [line for line in text.splitlines() if "stablehlo.pad" in line]
    assert not any(f"tensor<{n}x{v}xbf16>" in line for line in pads), pads


@pytest.mark.parametrize(
    "field, names",
    [("weight_copy", ("auto", "in_kernel", "apart")), ("hidden_tiles", ("auto", "wide", "narrow"))],
)
def test_backward_attribute_from_config(field, names):
    """ffi.linear.Config.weight_copy and .hidden_tiles reach the backward custom call as its
    attributes of the same names (csrc/sm90_launch.h WeightCopy, HiddenTiles), with the
    workspace sized for them; an unknown value is a ValueError."""
    if extension.sm90 is None:
        pytest.skip(f"extension not built (its workspace size): {extension.IMPORT_ERROR}")
    h, w, _, t = _inputs()
    n = h.shape[0]
    rows = [jnp.zeros((n,), jnp.float32)] * 4

    def lowered(value):
        f = functools.partial(
            ffi_linear.linear_backward,
            weight_layout="vd",
            temperature=1.0,
            config=ffi_linear.Config(**{field: value}),
        )
        return jax.jit(f).trace(h, w, None, t, *rows).lower(lowering_platforms=("cuda",)).as_text()

    for code, value in enumerate(names):
        assert f"{field} = {code} : i64" in lowered(value)
    with pytest.raises(ValueError, match=field):
        lowered("elsewhere")


@pytest.mark.parametrize(
    "n, v, expect",
    [
        (512, 131072, 16384),  # the 1/16 cap binds: V / 8 columns of float16
        (2048, 131072, 16384),  # 64 MiB and the 1/16 cap agree
        (4096, 131072, 8192),  # 64 MiB
        (16384, 131072, 8192),  # 64 MiB alone: 2048 columns; the floor widens them
        (65536, 151936, 8192),
        (16384, 32768, 4096),  # the 1/16 cap binds the floor: V / 8
        (5, 1000, 256),  # one tile: small problems stay small
    ],
)
def test_backward_chunk_width(n, v, expect):
    """The ffi backward's chunk: the wider of 64 MiB of float16 G and MIN_CHUNK_COLUMNS, at
    most 1/16 of float32 [N, V], a multiple of the kernels' 256-column tile."""
    assert ffi_linear.backward_chunk(n, v) == expect
    assert expect % ffi_linear.TILE_COLS == 0
    narrow = head_grad.chunk_columns(n, v, ffi_linear.GRAD_CHUNK_BYTES, ffi_linear.TILE_COLS)
    assert narrow <= expect  # the floor only widens


def test_forward_splits_attribute_from_config():
    """ffi.linear.Config.splits reaches the forward custom call as its ``splits`` attribute."""
    h, w, b, t = _inputs()
    rv = jnp.ones(t.shape, bool)
    stats = lambda h, w: ffi_linear.linear_stats(
        h,
        w,
        None,
        t,
        rv,
        weight_layout="vd",
        temperature=1.0,
        with_entropy=False,
        config=ffi_linear.Config(splits=3),
    )
    text = jax.jit(stats).trace(h, w).lower(lowering_platforms=("cuda",)).as_text()
    assert f"stablehlo.custom_call @{ffi_linear.TARGET}" in text and "splits = 3 : i32" in text


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_xla_gemms_variant_lowers_to_the_grad_call(layout):
    """benchmarks/studies/variants/ffi_xla_gemms.py (measurement only): the grad call in a
    loop of XLA GEMMs; d_weight starts as a buffer nobody writes (the chunk loop covers every
    column)."""
    from benchmarks.studies.variants import ffi_xla_gemms

    h, w, b, t = _inputs(layout=layout)
    rows = jnp.ones((t.shape[0],), jnp.float32)
    bwd = jax.jit(
        lambda *a: ffi_xla_gemms.linear_backward(*a, weight_layout=layout, temperature=0.7)
    )
    text = (
        bwd.trace(h, w, b, t, rows, rows, rows, rows).lower(lowering_platforms=("cuda",)).as_text()
    )
    assert f"stablehlo.custom_call @{ffi_linear.GRAD_TARGET}" in text
    assert f"stablehlo.custom_call @{extension.UNINITIALIZED_TARGET}" in text
    assert ffi_linear.BACKWARD_TARGET not in text


@pytest.mark.parametrize(
    "n,v,d,chunk,layout",
    [
        (4096, 131072, 2048, 8192, "vd"),
        (300, 1001, 64, 512, "vd"),
        (37, 77, 64, 256, "vd"),
        (129, 2056, 72, 768, "dv"),
        (1, 304, 64, 256, "dv"),
    ],
)
def test_backward_workspace_holds_its_buffers(sm90, n, v, d, chunk, layout):
    """The fused backward's workspace: G [N, ld] (ld = the widest chunk rounded up to 8
    columns), a tail buffer (the last chunk's weight copy, then its d_weight rows) exactly when
    a "vd" last chunk is not a multiple of 8 wide, each chunk's max |W| and 1 / sigma, and the
    GEMMs' own workspace, each 256-byte aligned. No weight copy [ld, D]: each chunk's lives in
    its own part of d_weight, so nothing in it grows with D but the GEMMs' own."""
    up = lambda x, a: -(-x // a) * a
    widest, last = min(chunk, v), v - (v - 1) // chunk * chunk
    ld = up(widest, 8)
    core = up(2 * n * ld, 256) + 2 * up(4 * -(-v // chunk), 256)
    tail = up(2 * up(last, 8) * d, 256) if layout == "vd" and last % 8 else 0
    got = sm90.backward_workspace_bytes(n, v, d, chunk, layout == "dv", True)
    assert got % 256 == 0 and core + tail <= got <= core + tail + 2**20
    assert got == sm90.backward_workspace_bytes(n, v, d, chunk, layout == "dv", False)


def _hidden_tiles(n, d):
    """d_hidden's output tiles of 128 × 256 over [n, d], M in whole clusters of two."""
    return -(-(-(-n // 128)) // 2) * 2 * -(-d // 256)


def _rounds(units):
    """Rounds of 132 CTAs that ``units`` work units take."""
    return -(-units // 132)


# (n, d, k, bf16) -> K's parts of d_hidden's GEMM, counted by hand: tiles of 128 x 256 (M in
# clusters of two), 132 CTAs a round.
HIDDEN_SPLITS = {
    (512, 2048, 8192, False): 4,  # 32 tiles: one wave holds 4 parts each
    (1024, 2048, 8192, False): 1,  # 64 tiles: 2 parts become narrow unsplit tiles
    (1536, 2048, 131072, True): 1,  # 96 tiles: one wave, 2 parts would not fit it
    (2560, 2048, 131072, True): 4,  # 160 tiles: 2 rounds unsplit, 5 of a quarter in 4 parts
    (2560, 2048, 8192, False): 1,  # the same tiles, but parts of K under 16384 columns
    (3072, 2048, 131072, True): 2,  # 192 tiles: 2 rounds, 3 of halves in 2 parts
    (3584, 2048, 131072, True): 7,  # 224 tiles: 2 rounds, 12 of sevenths (0.86 of 2)
    (4096, 2048, 131072, True): 1,  # 256 tiles: 2 rounds, 97 % full
    (10240, 4096, 131072, True): 1,  # 1280 tiles: 10 rounds, 97 % full
}


@pytest.mark.parametrize("shape", list(HIDDEN_SPLITS))
def test_hidden_plan_splits_where_the_rounds_are_idle(sm90, shape):
    """d_hidden's GEMM splits K where its tiles leave the CTAs idle, in one wave or in a last
    wave mostly empty; batch invariance never splits, and a pinned float16 tile width runs
    unsplit; a split plan's workspace holds a float32 partial tile per output tile."""
    n, d, k, bf16 = shape
    plan = sm90.hidden_plan(n, d, k, bf16)
    assert plan["splits"] == HIDDEN_SPLITS[shape]
    assert sm90.hidden_plan(n, d, k, bf16, split_k=False)["splits"] == 1
    if not bf16:
        for pinned, narrow in ((1, False), (2, True)):
            assert sm90.hidden_plan(n, d, k, False, hidden_tiles=pinned) == dict(
                splits=1, narrow=narrow
            )
    if bf16:
        partials = _hidden_tiles(n, d) * 128 * 256 * 4
        workspace = sm90.kept_gemms_workspace_bytes(n, k, d, False, True)
        assert (workspace >= partials) == (plan["splits"] > 1)


@pytest.mark.parametrize(
    "d,k,bf16", [(2048, 8192, False), (2048, 131072, True), (4096, 131072, True)]
)
def test_hidden_plan_never_takes_more_rounds(sm90, d, k, bf16):
    """At every N, the chosen parts take no more rounds of 132 CTAs (in units of an unsplit
    tile's time) than the GEMM unsplit, and each part keeps at least 2048 columns of K (16384
    where the unsplit tiles take more than one wave)."""
    for n in range(128, 16385, 128):
        splits = sm90.hidden_plan(n, d, k, bf16)["splits"]
        tiles = _hidden_tiles(n, d)
        assert 1 <= splits <= 8 and k // splits >= 2048
        assert _rounds(tiles * splits) / splits <= _rounds(tiles)
        if tiles > 132 and splits > 1:  # beyond one wave: long parts only
            assert k // splits >= 16384


@pytest.mark.parametrize("n,size,sms", [(1, 256, 132), (4096, 4096, 132), (300, 1000, 7)])
def test_grad_planner_one_unit_per_tile(sm90, n, size, sms):
    plan = sm90.grad_plan(n, size, sms)
    rows, tiles = _tile_grid(sm90, n, size)
    assert plan["splits"] == plan["vocab_tiles"] == tiles and plan["row_blocks"] == rows
    assert 1 <= plan["grid"] <= sms
    seen = np.zeros((rows, tiles), np.int64)
    for u in range(rows * tiles):
        p, s, begin, end = sm90.decode_unit(u, rows, tiles, plan["group_rows"], tiles)
        assert end == begin + 1 == s + 1
        seen[p, begin] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize(
    "n,size,copy",
    [
        (256, 8192, "apart"),
        (1024, 16384, "apart"),  # 4 tiles a CTA, but 8 row blocks
        (1920, 4096, "apart"),  # 15 row blocks
        (1921, 4096, "in_kernel"),  # 16: a partial block counts
        (2048, 8192, "in_kernel"),  # 16 row blocks
        (2048, 16384, "in_kernel"),
        (16384, 8192, "in_kernel"),
    ],
)
def test_weight_copy_apart_below_16_row_blocks(sm90, n, size, copy):
    """The automatic weight copy: its own kernel where a chunk has fewer than 16 row blocks of
    128 (the copy's share per CTA then outlasts the grad kernel's tiles, whatever the chunk's
    width), the grad kernel's producer warps otherwise."""
    assert sm90.grad_plan(n, size, 132)["weight_copy"] == copy


def _problem(**kw):
    base = dict(
        n_rows=64, vocab=1024, hidden_dim=128, dtype="bfloat16", weight_layout="vd", platform="gpu"
    )
    base.update(kw)
    return Problem(**base)


@pytest.mark.parametrize(
    "kw,expect",
    [
        ({}, None),
        ({"dtype": "float16", "weight_layout": "dv"}, None),
        ({"dtype": "float32"}, "float32"),
        ({"hidden_dim": 60}, "D = 60 is not a multiple of 8"),
        ({"weight_layout": "dv", "vocab": 50257}, "V = 50257 is not a multiple of 8"),
        ({"weight_layout": "vd", "vocab": 50257}, None),
        ({"weight_dtype": "float32"}, "weight is float32"),
    ],
)
def test_declines_what_the_kernel_does_not_serve(kw, expect):
    why = ffi.declines("linear_logprobs", _problem(**kw))
    assert (why is None) if expect is None else (expect in why), why
    assert "its backward, distill_divergence and kept_set, not 'token_logprobs'" in (
        ffi.declines("token_logprobs", _problem())
    )


def _distill_problem(**kw):
    base = dict(
        n_rows=64,
        vocab=1001,
        hidden_dim=128,
        dtype="bfloat16",
        weight_dtype="bfloat16",
        teacher_dtype="bfloat16",
        teacher_weight_dtype="bfloat16",
        teacher_hidden_dim=256,
        platform="gpu",
    )
    base.update(kw)
    return Problem(**base)


@pytest.mark.parametrize(
    "kw,expect",
    [
        ({}, None),
        (
            {
                key: "float16"
                for key in ("dtype", "weight_dtype", "teacher_dtype", "teacher_weight_dtype")
            },
            None,
        ),
        ({"teacher_dtype": "float16"}, "in one 16-bit dtype"),
        ({"weight_dtype": "float32"}, "in one 16-bit dtype"),
        ({"weight_layout": "dv"}, '"vd" weights'),
        ({"teacher_weight_layout": "dv"}, '"vd" weights'),
        ({"has_bias": True}, "without a bias"),
        ({"teacher_has_bias": True}, "without a bias"),
        ({"teacher_hidden_dim": 100}, "D_t = 100 must be"),
    ],
)
def test_distill_declines_what_the_kernels_do_not_serve(kw, expect):
    why = ffi.declines("distill_divergence", _distill_problem(**kw))
    assert (why is None) if expect is None else (expect in why), why


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
def test_distill_lowers_to_the_custom_calls_for_cuda(sm90, divergence):
    """The distillation parts lower for CUDA to the statistics call (twice for the JSD: its
    sums), and the backward to the gradient call in its chunk loop (and the ragged rest)."""
    from jaxrl_kernels.backends.ffi import distill as fd

    k = jax.random.split(jax.random.key(0), 4)
    n, ds, dt, v = 6, 16, 32, 300
    h, th = (jax.random.normal(k[i], (n, d)).astype(jnp.bfloat16) for i, d in ((0, ds), (2, dt)))
    w, tw = (jax.random.normal(k[i], (v, d)).astype(jnp.bfloat16) for i, d in ((1, ds), (3, dt)))
    opts = dict(
        weight_layout="vd",
        teacher_weight_layout="vd",
        divergence=divergence,
        beta=0.3,
        temperature=0.7,
        config=fd.DistillConfig(num_sms=132, chunk_bytes=n * 256 * 2),
    )
    fwd = jax.jit(lambda *a: fd.distill_forward(a[0], a[1], None, a[2], a[3], None, **opts))
    text = fwd.trace(h, w, th, tw).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(f"stablehlo.custom_call @{fd.STATS_TARGET}") == (
        2 if divergence == "jsd" else 1
    )
    assert ("jsd_sums = true" in text) == (divergence == "jsd")
    splits = sm90.distill_plan(n, v, 132)["splits"]
    assert f"splits = {splits} : i32" in text and f"tensor<{splits}x7x{n}xf32>" in text
    rows = jnp.ones((n,), jnp.float32)
    bwd = jax.jit(
        lambda *a: fd.distill_backward(a[0], a[1], None, a[2], a[3], None, *a[4:], **opts)
    )
    text = (
        bwd.trace(h, w, th, tw, rows, rows, rows, rows, rows)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count(f"stablehlo.custom_call @{fd.GRAD_TARGET}") == 2  # 256 columns, then 44
    assert f"mode = {fd.GRAD_MODES[divergence]} : i32" in text and "stablehlo.while" in text


def test_dispatch_picks_the_ffi_backward_where_ffi_serves(monkeypatch):
    """On a Hopper GPU (simulated: ffi available) the backward primitive goes to ffi for the
    inputs the kernels serve and to pallas for the others (float32 here)."""
    monkeypatch.setattr(
        ffi, "BACKEND", dataclasses.replace(ffi.BACKEND, unavailable_reason=lambda: None)
    )
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    pick = lambda **kw: dispatch.select(
        "linear_logprobs", _problem(**kw), primitive="linear_logprobs_backward", strict=False
    )
    assert pick().backend == "ffi" and pick().impl is ffi_linear.linear_backward
    assert pick(weight_layout="dv", dtype="float16").backend == "ffi"
    choice = pick(dtype="float32")
    assert choice.backend == "pallas" and "float32" in dict(choice.declined)["ffi"]
    assert dispatch.select("linear_logprobs", _problem()).backend == "ffi"


def test_unavailable_without_extension(monkeypatch):
    monkeypatch.setattr(extension, "sm90", None)
    monkeypatch.setattr(extension, "IMPORT_ERROR", "ImportError: test")
    assert "not built" in ffi.unavailable_reason()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU behaviour")
def test_cpu_dispatch_declines_ffi_with_reason():
    h, w, _, t = _inputs(n=5, d=16, v=40)
    assert "ffi" not in jk.available_backends("linear_logprobs")
    text = jk.explain("linear_logprobs", h, w, t)
    assert "ffi declined:" in text and "platform is 'cpu'" in text, text
    with pytest.raises(NotImplementedError, match="backend 'ffi' cannot serve"):
        jk.linear_logprobs(h, w, t, backend="ffi")


# ----------------------------------------------------------------------------- GPU (Hopper)

needs_sm90 = pytest.mark.skipif(
    ffi.unavailable_reason() is not None, reason=f"ffi unavailable: {ffi.unavailable_reason()}"
)
# The grad call alone (ffi_linear.GRAD_TARGET, benchmarks/studies/variants/ffi_xla_gemms.py) exists only in
# an extension built with JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON.
MEASUREMENT_HANDLERS = bool(getattr(extension.sm90, "measurement_handlers", False))
needs_measurement_handlers = pytest.mark.skipif(
    not MEASUREMENT_HANDLERS,
    reason="the extension was built without the measurement-only FFI handlers (the grad call "
    "alone): rebuild with JAXRL_KERNELS_MEASUREMENT_HANDLERS=ON (docs/building.md)",
)

# (N, D, V, layout, dtype, bias, temperature): covers N ∈ {1, 100, 4096}, D ∈ {64, 2048, 4096},
# V ∈ {1000, 32768, 50257, 131072}, ragged V (masked last tile), both layouts and dtypes.
GPU_CASES = [
    (1, 64, 1000, "vd", jnp.bfloat16, True, 0.7),
    (100, 2048, 50257, "vd", jnp.bfloat16, False, 1.0),
    (100, 64, 32768, "dv", jnp.float16, True, 1.3),
    (4096, 64, 50257, "vd", jnp.float16, True, 1.0),
    (4096, 4096, 32768, "dv", jnp.bfloat16, True, 1.0),
    (4096, 2048, 131072, "vd", jnp.bfloat16, False, 0.8),
    (100, 4096, 131072, "dv", jnp.bfloat16, True, 1.0),
]
CHECK_ROWS = 48  # large N: every row is computed, these rows are checked against float64


def _gpu_inputs(n, d, v, layout, dtype, with_bias, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (n, d), jnp.float32).astype(dtype)
    wshape = (v, d) if layout == "vd" else (d, v)
    w = (jax.random.normal(k[1], wshape, jnp.float32) * (2.0 / np.sqrt(d))).astype(dtype)
    b = (0.5 * jax.random.normal(k[2], (v,), jnp.float32)).astype(dtype) if with_bias else None
    t = jax.random.randint(k[3], (n,), 0, v, jnp.int32)
    return h, w, b, t


def _check_rows(logp, ent, h, w, b, t, rows, layout, temperature, dtype):
    h64 = np.asarray(h[rows]).astype(np.float64)
    w64 = np.asarray(w).astype(np.float64)
    b64 = None if b is None else np.asarray(b).astype(np.float64)
    tt = np.asarray(t)[rows]
    kw = dict(weight_layout=layout, temperature=temperature)
    want = oracle.linear_logprobs(h64, w64, tt, b64, **kw)
    want32 = oracle.linear_logprobs(h64, w64, tt, b64, dt=np.float32, **kw)
    zscale = np.abs(oracle.linear_logits(h64, w64, b64, weight_layout=layout)).max() / temperature
    assert_close(
        np.asarray(logp)[rows], want[0], in_dtype=dtype, want32=want32[0], scale=zscale, name="logp"
    )
    assert_close(
        np.asarray(ent)[rows],
        want[1],
        in_dtype=dtype,
        want32=want32[1],
        scale=zscale,
        name="entropy",
    )


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "n,d,v,layout,dtype,with_bias,temperature",
    GPU_CASES,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_gpu_values_against_float64(n, d, v, layout, dtype, with_bias, temperature):
    h, w, b, t = _gpu_inputs(n, d, v, layout, dtype, with_bias, seed=n + d + v)
    assert (
        ffi.declines(
            "linear_logprobs",
            _problem(
                n_rows=n, vocab=v, hidden_dim=d, dtype=jnp.dtype(dtype).name, weight_layout=layout
            ),
        )
        is None
    )
    f = jax.jit(
        lambda h, w, b, t: jk.linear_logprobs(
            h,
            w,
            t,
            b,
            weight_layout=layout,
            temperature=temperature,
            return_entropy=True,
            backend="ffi",
        )
    )
    logp, ent = f(h, w, b, t)
    assert_f32(logp, ent)
    rng = np.random.default_rng(n * 7 + v)
    edges = [0, n - 1, min(127, n - 1), min(128, n - 1)]
    rows = (
        np.arange(n)
        if n <= CHECK_ROWS
        else np.unique(
            np.concatenate([edges, rng.choice(n, CHECK_ROWS - len(edges), replace=False)])
        )
    )
    _check_rows(logp, ent, h, w, b, t, rows, layout, temperature, dtype)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_invalid_rows_and_out_of_range_targets(layout):
    n, d, v = 300, 128, 1000
    h, w, b, t = _gpu_inputs(n, d, v, layout, jnp.bfloat16, True, seed=3)
    t = np.asarray(t).copy()
    ignored = np.zeros(n, bool)
    ignored[[0, 5, 130, 299]] = True
    t[ignored] = -100
    bad = np.array([7, 131, 200, 250])
    t[bad] = [-1, v, v + 4096, 2**30]
    f = jax.jit(
        lambda h, w, b, t: jk.linear_logprobs(
            h, w, t, b, weight_layout=layout, ignore_index=-100, return_entropy=True, backend="ffi"
        )
    )
    logp, ent = map(np.asarray, f(h, w, b, jnp.asarray(t)))
    assert (logp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert np.isnan(logp[bad]).all() and np.isnan(ent[bad]).all()
    ok = np.flatnonzero(~ignored & ~np.isin(np.arange(n), bad))
    assert np.isfinite(logp[ok]).all()
    _check_rows(logp, ent, h, w, b, t, ok, layout, 1.0, jnp.bfloat16)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout,dtype", [("vd", jnp.bfloat16), ("dv", jnp.float16)])
def test_gpu_gradients_through_custom_vjp(layout, dtype):
    n, d, v, temperature = 100, 64, 1000, 0.9
    h, w, b, t = _gpu_inputs(n, d, v, layout, dtype, True, seed=11)

    def fn(h, w, b):
        return jk.linear_logprobs(
            h,
            w,
            t,
            b,
            weight_layout=layout,
            temperature=temperature,
            return_entropy=True,
            backend="ffi",
        )

    (logp, ent), vjp = jax.vjp(fn, h, w, b)
    rng = np.random.default_rng(5)
    g_lp, g_ent = cotangent(rng, (n,)), cotangent(rng, (n,))
    grads = jax.jit(vjp)((g_lp, g_ent))
    h64, w64, b64 = (np.asarray(x).astype(np.float64) for x in (h, w, b))
    kw = dict(weight_layout=layout, temperature=temperature)
    tt = np.asarray(t)
    want = oracle.linear_logprobs_vjp(h64, w64, tt, np.asarray(g_lp), np.asarray(g_ent), b64, **kw)
    want32 = oracle.linear_logprobs_vjp(
        h64, w64, tt, np.asarray(g_lp), np.asarray(g_ent), b64, dt=np.float32, **kw
    )
    for name, got, p, w_, w32 in zip(
        ("d_hidden", "d_weight", "d_bias"), grads, (h, w, b), want, want32
    ):
        assert got.dtype == p.dtype and got.shape == p.shape, name
        assert_close(got, w_, in_dtype=dtype, want32=w32, name=name)


# (N, D, V, layout, dtype, bias, entropy, temperature, chunk columns): ragged rows (N % 128),
# several chunks and a tail (odd in the last vd case: 16-bit stores), a masked last tile.
GRAD_CASES = [
    (257, 136, 1000, "vd", jnp.bfloat16, True, True, 0.8, 256),
    (37, 64, 77, "vd", jnp.float16, True, False, 1.0, 256),
    (130, 64, 1001, "vd", jnp.float16, False, True, 1.0, 512),
    (129, 72, 2056, "dv", jnp.bfloat16, True, False, 1.3, 768),
    (1, 64, 304, "dv", jnp.float16, False, True, 1.0, 256),
    (2048, 1024, 32768, "vd", jnp.bfloat16, False, True, 1.0, 4096),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "gemms",
    [
        "cutlass",
        "cutlass_in_kernel",
        "cutlass_apart",
        pytest.param("xla", marks=needs_measurement_handlers),
    ],
)
@pytest.mark.parametrize(
    "n,d,v,layout,dtype,with_bias,entropy,temperature,cols",
    GRAD_CASES,
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_gpu_backward_against_float64(
    n, d, v, layout, dtype, with_bias, entropy, temperature, cols, gemms
):
    """The ffi backward part against the float64 VJP, with ignored rows (lse = +inf, zero
    cotangents) and a target outside [0, V): the fused custom call (CUTLASS GEMMs; chunks of
    `cols` rounded up to 256 columns, "vd" tails of odd width through the tail buffer), with the
    weight copy where the backward puts it, in the grad kernel and apart, and the grad call in
    head_grad's loop of XLA GEMMs (benchmarks/studies/variants/ffi_xla_gemms.py)."""
    h, w, b, t = _gpu_inputs(n, d, v, layout, dtype, with_bias, seed=n + v)
    _check_backward(h, w, b, t, layout, dtype, entropy, temperature, cols, gemms)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_backward_weight_range_per_chunk(layout):
    """Chunks of W whose magnitudes differ by 2^24, the largest beyond float16's range (max
    |W| ~ 2^18): the fused backward scales each chunk's float16 weight copy by its own max
    |W| (found by the previous chunk's kernel) and divides it out in the d_hidden GEMM; hidden
    is scaled down so that the logits stay O(1)."""
    n, d, v, cols = 300, 64, 1024, 256
    h, w, b, t = _gpu_inputs(n, d, v, layout, jnp.bfloat16, False, seed=7)
    exps = np.repeat(np.array([-6.0, 0.0, 8.0, 18.0]), cols)  # per vocabulary column
    col_scale = jnp.asarray(np.exp2(exps), jnp.float32)
    w = (
        w.astype(jnp.float32) * (col_scale[:, None] if layout == "vd" else col_scale[None, :])
    ).astype(jnp.bfloat16)
    h = (h.astype(jnp.float32) * 2.0**-18).astype(jnp.bfloat16)
    for gemms in ("cutlass_in_kernel", "cutlass_apart") + (
        ("xla",) if MEASUREMENT_HANDLERS else ()
    ):
        _check_backward(h, w, b, t, layout, jnp.bfloat16, True, 1.0, cols, gemms)


def _check_backward(h, w, b, t, layout, dtype, entropy, temperature, cols, gemms):
    (n, d), v = h.shape, w.shape[0] if layout == "vd" else w.shape[1]
    b32 = None if b is None else b.astype(jnp.float32)
    t = np.asarray(t).copy()
    if n > 3:
        t[1] = v + 5  # out of range: no one-hot term
    h64, w64 = (np.asarray(x).astype(np.float64) for x in (h, w))
    b64 = None if b is None else np.asarray(b).astype(np.float64)
    z = oracle.linear_logits(h64, w64, b64, weight_layout=layout) / temperature
    zmax = z.max(axis=1, keepdims=True)
    lse = (zmax + np.log(np.exp(z - zmax).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    ent = lse - (p * z).sum(axis=1)
    rng = np.random.default_rng(n + d)
    g = rng.standard_normal(n)
    g_ent = rng.standard_normal(n) if entropy else None
    active = np.ones(n, bool)
    active[::5] = False  # no gradient: lse = +inf, cotangents 0
    g = np.where(active, g, 0.0)
    g_ent = None if g_ent is None else np.where(active, g_ent, 0.0)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    if gemms.startswith("cutlass"):
        copy = {"cutlass": "auto", "cutlass_in_kernel": "in_kernel", "cutlass_apart": "apart"}
        backward = functools.partial(
            ffi_linear.linear_backward,
            config=ffi_linear.Config(chunk_bytes=2 * n * cols, weight_copy=copy[gemms]),
        )
    else:
        backward = functools.partial(ffi_xla_gemms.linear_backward, chunk_bytes=2 * n * cols)
    got = jax.jit(lambda *a: backward(*a, weight_layout=layout, temperature=temperature))(
        h, w, b32, jnp.asarray(t), f32(np.where(active, lse, np.inf)), f32(ent), f32(g), f32(g_ent)
    )
    onehot = np.zeros_like(z)
    ok = (t >= 0) & (t < v)
    onehot[np.flatnonzero(ok), t[ok]] = 1.0
    dz = g[:, None] * (onehot - p)
    if g_ent is not None:
        dz -= g_ent[:, None] * p * (np.log(np.maximum(p, 1e-300)) + ent[:, None])
    dz = np.where(active[:, None], dz, 0.0) / temperature
    w_vd = w64 if layout == "vd" else w64.T
    d_w = dz.T @ h64
    want = (dz @ w_vd, d_w if layout == "vd" else d_w.T, dz.sum(axis=0))
    for name, got_x, want_x in zip(("d_hidden", "d_weight", "d_bias"), got, want):
        if name == "d_bias" and b is None:
            assert got_x is None
            continue
        got_x = np.asarray(got_x, np.float64)
        assert np.isfinite(got_x).all(), name  # every element written
        err = np.linalg.norm(got_x - want_x) / max(np.linalg.norm(want_x), 1e-30)
        # float16 G (2^-11) and float32 accumulation, output rounded to the input dtype
        assert err < 2.0e-3 + float(jnp.finfo(dtype).eps), (name, err)
    assert not np.asarray(got[0], np.float64)[~active].any(), "ignored rows get no gradient"


# (N, D, V, layout, dtype, bias, start, size): the chunk [start, start + size) of the grad call;
# ragged rows, widths that are odd, not a multiple of 8 (element stores) or of 256 (a partial
# tile), and a chunk that starts past column 0.
G_CASES = [
    (257, 136, 1000, "vd", jnp.bfloat16, True, 256, 489),
    (130, 64, 2056, "dv", jnp.float16, False, 0, 2056),
    (1, 64, 304, "vd", jnp.float16, True, 0, 301),
    (1000, 512, 8192, "dv", jnp.bfloat16, False, 4096, 4096),
]


@pytest.mark.gpu
@needs_sm90
@needs_measurement_handlers
@pytest.mark.parametrize(
    "n,d,v,layout,dtype,with_bias,start,size", G_CASES, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_gpu_logit_gradient_elementwise(n, d, v, layout, dtype, with_bias, start, size):
    """Every element of the grad call's G = alpha [v = target] - beta p (float16; the call
    as benchmarks/studies/variants/ffi_xla_gemms.py makes it) against
    float64: each lands where it belongs, whichever store path (16-byte rows, or single
    elements at a ragged edge) wrote it; and its second result, the chunk's weight copy
    float16(σ_W · W), equal bit for bit to the conversion in numpy."""
    h, w, b, t = _gpu_inputs(n, d, v, layout, dtype, with_bias, seed=3 * n + v)
    b32 = None if b is None else b.astype(jnp.float32)
    h64, w64 = (np.asarray(x).astype(np.float64) for x in (h, w))
    z = oracle.linear_logits(
        h64, w64, None if b is None else np.asarray(b).astype(np.float64), weight_layout=layout
    )
    zmax = z.max(axis=1, keepdims=True)
    lse = (zmax + np.log(np.exp(z - zmax).sum(axis=1, keepdims=True)))[:, 0]
    g = np.random.default_rng(n).uniform(-1.0, 1.0, n)
    rows = head_grad.RowGrad.of(
        jnp.asarray(lse, jnp.float32), jnp.asarray(g, jnp.float32), None, None, 1.0
    )
    write = ffi_xla_gemms.write_grad(b32, t, layout)
    sigma_w = 8.0 if dtype == jnp.bfloat16 else 0.25
    got, w16 = jax.jit(lambda h, w: write(rows, start, size, h, w, sigma_w))(h, w)
    got = np.asarray(got, np.float64)
    cols = np.arange(start, start + size)
    onehot = np.asarray(t)[:, None] == cols[None, :]
    want = g[:, None] * (onehot - np.exp(z[:, cols] - lse[:, None]))
    assert got.shape == (n, size)
    # float16 rounding (2^-11 relative) plus the float32 logits and ex2.approx
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-5)
    w_chunk = (
        np.asarray(w, np.float32)[cols] if layout == "vd" else np.asarray(w, np.float32)[:, cols]
    )
    assert w16.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(w16), (w_chunk * sigma_w).astype(np.float16))


@pytest.mark.gpu
@needs_sm90
def test_gpu_backward_bitwise_deterministic_and_chosen():
    h, w, _, t = _gpu_inputs(1024, 512, 32768, "vd", jnp.bfloat16, False, seed=4)
    g = jnp.asarray(np.random.default_rng(0).standard_normal(1024), jnp.float32)
    lean = lambda h, w: jnp.sum(g * jk.linear_logprobs(h, w, t, memory="lean"))  # noqa: E731
    f = jax.jit(jax.grad(lean, argnums=(0, 1)))
    assert_bitwise(f(h, w), f(h, w))
    text = jax.jit(f).lower(h, w).as_text()
    assert f"custom_call @{ffi_linear.BACKWARD_TARGET}" in text


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize(
    "field, one, other",
    [("weight_copy", "apart", "in_kernel"), ("hidden_tiles", "wide", "narrow")],
)
def test_gpu_backward_launch_choices_bitwise_the_same(layout, field, one, other):
    """The weight copy by its own kernel or by the grad kernel's producer warps, d_hidden's
    unsplit GEMM on tiles 256 or 128 wide: the same float16 copy, scales and per-element sums,
    so the same bits, over several chunks and a ragged last one."""
    h, w, _, t = _gpu_inputs(200, 256, 5000, layout, jnp.bfloat16, False, seed=6)
    g = jnp.asarray(np.random.default_rng(1).standard_normal(200), jnp.float32)

    def grads(value):
        backward = functools.partial(
            ffi_linear.linear_backward,
            config=ffi_linear.Config(chunk_bytes=2 * 200 * 1024, **{field: value}),
        )
        parts = Parts(ffi_linear.linear_stats, backward)
        rv = jnp.ones(t.shape, bool)
        f = lambda h, w: jnp.sum(
            g
            * linear_head.linear_from_parts(
                parts, h, w, None, t, rv, HeadCall(weight_layout=layout)
            )[0]
        )
        return jax.jit(jax.grad(f, argnums=(0, 1)))(h, w)

    assert_bitwise(grads(one), grads(other))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gpu_forced_splits_agree_with_the_plan(layout):
    """ffi.linear.Config.splits (1, 7 and more splits than vocabulary tiles) against the planner's
    choice: the same statistics up to the order of the split merge."""
    h, w, b, t = _gpu_inputs(300, 256, 50000, layout, jnp.bfloat16, True, seed=5)
    rv = jnp.ones(t.shape, bool)
    b32 = b.astype(jnp.float32)
    run = lambda splits: [
        np.asarray(x)
        for x in jax.jit(
            lambda h, w: ffi_linear._forward_call(
                h, w, b32, t, rv, layout, 0.9, ffi_linear.Config(splits=splits)
            )
        )(h, w)
    ]
    want = run(0)
    for splits in (1, 7, 1000):
        for got, ref in zip(run(splits), want):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    "layout,v,dtype,with_bias",
    [
        ("vd", 50257, jnp.bfloat16, True),
        ("dv", 32768, jnp.bfloat16, False),
        ("vd", 4099, jnp.float16, False),
        ("dv", 151936, jnp.float16, True),
    ],
)
def test_gpu_kept_logits_against_xla(layout, v, dtype, with_bias):
    """ffi's ``kept_logits`` against the reference's (``rounded_logits.local_stats``: XLA's GEMM
    rounded once, then its reductions over the rounded logits): the same kept logits up to one
    rounding step where the two float32 sums round to neighbours, and the same statistics of
    them; the target logit unrounded. Rows past a 128-row block, an odd V (single stores)."""
    n = 300
    h, w, b, t = _gpu_inputs(n, 256, v, layout, dtype, with_bias, seed=v)
    t = t.at[:4].set(jnp.array([0, v - 1, -1, v]))  # edges; outside [0, V): not held
    rv = jnp.ones(t.shape, bool).at[5].set(False)
    kw = dict(weight_layout=layout, temperature=0.8, with_entropy=True)
    plan = Placement.single(1)  # one device, the logits at the call's own N rows
    got = jax.jit(lambda h, w, b: ffi_linear.kept_logits(plan, h, w, b, t, rv, **kw))(h, w, b)
    want = jax.jit(lambda h, w, b: rounded_logits.local_stats(plan, h, w, b, t, rv, **kw))(h, w, b)
    (stats, t_rel, z), (stats_x, t_rel_x, z_x) = got, want
    assert z.dtype == dtype and z.shape == (n, v)
    z, z_x = np.asarray(z, np.float32), np.asarray(z_x, np.float32)
    ulp = np.abs(z_x) * float(jnp.finfo(dtype).eps) + 1e-30
    assert (np.abs(z - z_x) <= ulp).all() and (z == z_x).mean() > 0.95
    lse, ent = (
        np.asarray(x)
        for x in (stats[0] + jnp.log(stats[1]), jnp.log(stats[1]) - stats[2] / stats[1])
    )
    lse_x, ent_x = (
        np.asarray(x)
        for x in (stats_x[0] + jnp.log(stats_x[1]), jnp.log(stats_x[1]) - stats_x[2] / stats_x[1])
    )
    np.testing.assert_allclose(lse, lse_x, rtol=0, atol=2e-3)
    np.testing.assert_allclose(ent, ent_x, rtol=0, atol=2e-3)
    held = np.asarray((t >= 0) & (t < v) & rv)
    z_t = np.asarray(stats[0])[held] + np.asarray(t_rel)[held]
    z_t_x = np.asarray(stats_x[0])[held] + np.asarray(t_rel_x)[held]
    np.testing.assert_allclose(z_t, z_t_x, rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@needs_sm90
def test_gpu_bitwise_deterministic():
    h, w, _, t = _gpu_inputs(4096, 2048, 32768, "vd", jnp.bfloat16, False, seed=1)
    rv = jnp.ones(t.shape, bool)
    f = jax.jit(lambda h, w, t: ffi_linear._forward_call(h, w, None, t, rv, "vd", 1.0))
    first = f(h, w, t)
    for _ in range(2):
        assert_bitwise(first, f(h, w, t))


@pytest.mark.gpu
@needs_sm90
def test_gpu_vmap_and_automatic_choice():
    h, w, _, t = _gpu_inputs(2 * 64, 128, 1000, "vd", jnp.bfloat16, False, seed=2)
    hb, tb = h.reshape(2, 64, 128), t.reshape(2, 64)
    f = lambda h, t: jk.linear_logprobs(h, w, t, backend="ffi")
    batched = jax.jit(jax.vmap(f))(hb, tb)
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(jax.jit(f)(hb, tb)))
    lean = dict(memory="lean")  # the automatic memory mode would be fast: kept_logits' choice
    assert "linear_logprobs: ffi (automatic)" in jk.explain("linear_logprobs", hb, w, tb, **lean)
    f32 = (hb.astype(jnp.float32), w.astype(jnp.float32), tb)
    text = jk.explain("linear_logprobs", *f32, **lean)
    assert "ffi declined:" in text and "float32" in text
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        jk.linear_logprobs(h[:, :60], w[:, :60], t, backend="ffi")


def _distill_kernel_model(target, result, vmap_method=None):
    """``jax.ffi.ffi_call`` for the distillation targets, its results computed in jnp from the
    kernels' contract (csrc/sm90_launch.h: DistillArgs): partials per vocabulary split, and the
    gradient chunk G = coef · ∂d/∂z_s; the unwritten buffer as zeros."""
    from jaxrl_kernels.backends.ffi import distill as fd
    from jaxrl_kernels.formulas import divergence_math as dm

    if target == extension.UNINITIALIZED_TARGET:
        return lambda: jnp.zeros(result.shape, result.dtype)

    def call(hs, ws, ht, wt, *rows, **attrs):
        t, beta = float(attrs["temperature"]), float(attrs["beta"])
        zs = jnp.dot(hs, ws.T, preferred_element_type=jnp.float32) / t
        zt = jnp.dot(ht, wt.T, preferred_element_type=jnp.float32) / t
        if target == fd.STATS_TARGET:
            cuts = np.linspace(0, zs.shape[1], result.shape[0] + 1).astype(int)
            parts = []
            for a, b in zip(cuts[:-1], cuts[1:]):
                if attrs["jsd_sums"]:
                    parts.append(
                        jnp.stack(dm.jsd_tile_sums(zs[:, a:b], zt[:, a:b], *rows, None, beta))
                    )
                else:
                    stats = dm.pair_stats_update(
                        dm.pair_stats_init(zs.shape[:1]), zs[:, a:b], zt[:, a:b], None
                    )
                    parts.append(jnp.stack([*stats, jnp.min(zt[:, a:b], axis=1)]))
            return jnp.stack(parts)
        lse_s, lse_t, row_value, coef, start = rows
        cut = lambda z: jax.lax.dynamic_slice_in_dim(z, start[0], result.shape[1], 1)
        divergence = {v: k for k, v in fd.GRAD_MODES.items()}[int(attrs["mode"])]
        g = dm.student_grad_tile(
            divergence, cut(zs), cut(zt), lse_s, lse_t, row_value, row_value, coef * t, beta, t
        )
        return g.astype(jnp.float16)

    return call


@pytest.mark.parametrize("divergence", ["reverse_kl", "forward_kl", "jsd"])
def test_distill_glue_over_a_model_of_the_kernels(sm90, monkeypatch, divergence):
    """The ffi distillation's Python side (splits merged like vocabulary shards, the row bound
    and coefficients, the chunk loop of XLA GEMMs) over a jnp model of the kernels' results:
    the chunked backend's values, and its gradients within a bfloat16 rounding or two."""
    from jaxrl_kernels.backends.chunked import distill as chunked_distill
    from jaxrl_kernels.backends.ffi import distill as fd

    monkeypatch.setattr(fd.jax.ffi, "ffi_call", _distill_kernel_model)
    rng = np.random.default_rng(3)
    n, ds, dt, v = 37, 16, 24, 301
    h, w, th, tw = (
        jnp.asarray(rng.standard_normal(s) * c, jnp.bfloat16)
        for s, c in (((n, ds), 1.0), ((v, ds), 0.5), ((n, dt), 1.0), ((v, dt), 0.5))
    )
    g = jnp.asarray(rng.standard_normal(n), jnp.float32)
    opts = dict(
        weight_layout="vd",
        teacher_weight_layout="vd",
        divergence=divergence,
        beta=0.3,
        temperature=0.7,
    )
    config = fd.DistillConfig(num_sms=4, chunk_bytes=n * 128 * 2)  # 3 chunks: 128, 128, 45
    got = fd.distill_forward(h, w, None, th, tw, None, config=config, **opts)
    want = chunked_distill.distill_forward(h, w, None, th, tw, None, **opts)
    for x, y in zip(got[:3], want[:3]):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
    grads = fd.distill_backward(h, w, None, th, tw, None, *got, g, config=config, **opts)
    want_grads = chunked_distill.distill_backward(h, w, None, th, tw, None, *want, g, **opts)
    for x, y in zip(grads[:2], want_grads[:2]):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.max(np.abs(x - y)) <= 2 * 2.0**-8 * np.max(np.abs(y))
    assert grads[2] is None
