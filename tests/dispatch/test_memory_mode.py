"""The default of ``memory=``: ``jk.memory_mode`` scopes and ``JAXRL_KERNELS_MEMORY``.

The mode is the argument when given, else the innermost scope's, else the variable's, else
"lean"; explain names the source. Checked through explain's memory line, the compiled temp
memory and bfloat16 gradients (which differ between "lean" and "fast"), under jax.jit too.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_kernels as jk

ENV = "JAXRL_KERNELS_MEMORY"
B, T, D, V = 2, 4, 8, 64
KEPT = B * T * V * 2  # the bfloat16 [B, T, V] buffer "fast" keeps
KIB = f"{KEPT / 1024:.1f} KiB"

_k = jax.random.split(jax.random.key(0), 3)
HIDDEN = jax.random.normal(_k[0], (B, T, D), jnp.bfloat16)
WEIGHT = jax.random.normal(_k[1], (V, D), jnp.bfloat16)
ACTIONS = jax.random.randint(_k[2], (B, T), 0, V)
TOKENS, MASK = jnp.zeros((B, T)), jnp.ones((B, T))

ARGS = {  # every public op that takes memory=
    "linear_logprobs": ((HIDDEN, WEIGHT, ACTIONS), {}),
    "linear_ppo_loss": ((HIDDEN, WEIGHT, ACTIONS, TOKENS, TOKENS, MASK), {}),
    "linear_grpo_loss": (
        (HIDDEN, WEIGHT, ACTIONS, TOKENS, jnp.arange(B, dtype=jnp.float32), MASK),
        {"group_size": 2},
    ),
    "linear_policy_gradient_loss": ((HIDDEN, WEIGHT, ACTIONS, TOKENS, MASK), {}),
    "linear_distill_loss": ((HIDDEN, WEIGHT, HIDDEN, WEIGHT, MASK), {}),
}


@pytest.fixture(autouse=True)
def no_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def memory_line(op="linear_logprobs", **kwargs):
    """explain's one memory line for ``op``: its own line for "fast", under the backend's for
    "lean"."""
    args, extra = ARGS[op]
    text = jk.explain(op, *args, **extra, **kwargs)
    lines = [
        l for l in text.splitlines() if l.startswith((f"{op}: memory fast (", "  memory: lean ("))
    ]
    assert len(lines) == 1, text
    return lines[0]


def fast(source, op="linear_logprobs"):
    return f"{op}: memory fast ({source}"


def lean(source):
    return f"  memory: lean ({source}"


def grads(memory=None):
    def loss(h, w):
        return jnp.sum(jk.linear_logprobs(h, w, ACTIONS, memory=memory) * jnp.arange(T))

    return jax.grad(loss, argnums=(0, 1))(HIDDEN, WEIGHT)


def assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def assert_differ(got, want):
    assert any(
        not np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        for g, w in zip(got, want)
    )


# -- precedence ----------------------------------------------------------------------------------

AUTO_ON_CPU = "memory='auto': the device reports no memory size)"
"""The default's reason where the device reports no memory size (CPU): lean."""


def test_auto_takes_fast_when_the_logits_fit_an_eighth_of_the_device(monkeypatch):
    """``"auto"`` (the default): a budget of 1/8 of the device's memory (mocked here: CPU
    reports none), so the same op is fast on a large device and lean on a small one; a
    call's own ``backend=`` takes lean, as under a scope, not an error."""
    from jaxrl_kernels.dispatch import memory as memory_lib

    monkeypatch.setattr(memory_lib, "device_memory", lambda: 64 * 2**30)
    line = memory_line()
    assert "memory fast (memory='auto': 1/8 of the device's 64.0 GiB: a budget of 8.0 GiB" in line
    monkeypatch.setattr(memory_lib, "device_memory", lambda: 1024)
    assert memory_line().startswith(lean("memory='auto': 1/8 of the device's 1.0 KiB: a budget"))
    monkeypatch.setattr(memory_lib, "device_memory", lambda: 64 * 2**30)
    request = memory_lib.Request("auto", 2**30, (4096, 131072), jnp.bfloat16)
    assert memory_lib.choose(request, None).mode == "fast"
    note = memory_lib.choose(request, "chunked")
    assert note.mode == "lean" and "backend='chunked' given" in note.text


@pytest.mark.parametrize("op", list(ARGS))
def test_every_op_defaults_to_none_and_follows_the_scope(op):
    assert inspect.signature(getattr(jk, op)).parameters["memory"].default is None
    assert memory_line(op).startswith(lean(AUTO_ON_CPU))
    with jk.memory_mode("fast"):
        assert memory_line(op).startswith(fast("jk.memory_mode('fast'))", op))
        assert memory_line(op, memory="lean").startswith(lean("memory='lean')"))
    assert memory_line(op).startswith(lean(AUTO_ON_CPU))


def test_argument_beats_scope_beats_variable(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    assert memory_line().startswith(fast(f"{ENV}=fast)"))
    with jk.memory_mode("lean"):
        assert memory_line().startswith(lean("jk.memory_mode('lean'))"))
        assert memory_line(memory="fast").startswith(fast("memory='fast')"))
    monkeypatch.setenv(ENV, "lean")
    assert memory_line().startswith(lean(f"{ENV}=lean)"))
    with jk.memory_mode("fast"):
        assert memory_line().startswith(fast("jk.memory_mode('fast'))"))


def test_nested_scopes_innermost_wins_and_each_restores():
    with jk.memory_mode("fast"):
        with jk.memory_mode("lean"):
            assert memory_line().startswith(lean("jk.memory_mode('lean'))"))
        assert memory_line().startswith(fast("jk.memory_mode('fast'))"))
        with pytest.raises(RuntimeError):
            with jk.memory_mode("lean"):
                raise RuntimeError("boom")
        assert memory_line().startswith(fast("jk.memory_mode('fast'))"))
    assert memory_line().startswith(lean(AUTO_ON_CPU))


def test_none_inside_a_scope_is_as_outside_every_scope(monkeypatch):
    with jk.memory_mode("fast"), jk.memory_mode(None):
        assert memory_line().startswith(lean(AUTO_ON_CPU))
    monkeypatch.setenv(ENV, "fast")
    with jk.memory_mode("lean"), jk.memory_mode(None):
        assert memory_line().startswith(fast(f"{ENV}=fast)"))


def test_byte_budgets_from_the_scope_and_the_variable(monkeypatch):
    with jk.memory_mode(KEPT):
        assert memory_line().startswith(fast(f"jk.memory_mode({KEPT}): a budget of {KIB} >= "))
    with jk.memory_mode(np.int64(KEPT - 1)):
        line = memory_line()
    assert line.startswith(lean(f"jk.memory_mode({KEPT - 1}): a budget of ")), line
    assert f"< the {KIB} of logits 'fast' keeps" in line
    monkeypatch.setenv(ENV, str(KEPT))
    assert memory_line().startswith(fast(f"{ENV}={KEPT}: a budget of {KIB} >= "))
    monkeypatch.setenv(ENV, "0")
    assert memory_line().startswith(lean(f"{ENV}=0: a budget of 0 bytes < "))


# -- bad values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["medium", "FAST", -1, True, 1.5, jnp.int32(5)])
def test_a_bad_scope_fails_on_entry_as_the_argument_does(bad):
    with pytest.raises(ValueError) as from_argument:
        jk.linear_logprobs(HIDDEN, WEIGHT, ACTIONS, memory=bad)
    with pytest.raises(ValueError) as from_scope:
        with jk.memory_mode(bad):
            pytest.fail("entered a scope with a bad mode")
    assert str(from_scope.value) == str(from_argument.value)
    assert str(from_scope.value).startswith(
        (
            "memory: expected 'lean', 'fast', 'auto' or a byte budget",
            "memory: a byte budget must be >= 0",
        )
    )


@pytest.mark.parametrize("bad", ["medium", "FAST", "-1", "1.5", "1e6", " fast"])
def test_a_bad_variable_fails_when_an_op_reads_it(monkeypatch, bad):
    monkeypatch.setenv(ENV, bad)
    with pytest.raises(
        ValueError, match=f"^{ENV}: expected 'lean', 'fast', 'auto' or a byte budget"
    ):
        jk.linear_logprobs(HIDDEN, WEIGHT, ACTIONS)
    jk.linear_logprobs(HIDDEN, WEIGHT, ACTIONS, memory="lean")  # not read: the argument decides


def test_an_explicit_backend_takes_lean_under_a_fast_scope():
    """A scope is a default; a call's own ``backend=`` serves 'lean' and wins over it, with
    no error. The call's own ``memory="fast"`` with ``backend=`` stays an error."""
    with jk.memory_mode("fast"):
        np.testing.assert_array_equal(
            jk.linear_logprobs(HIDDEN, WEIGHT, ACTIONS, backend="chunked"),
            jk.linear_logprobs(HIDDEN, WEIGHT, ACTIONS, backend="chunked", memory="lean"),
        )
        with pytest.raises(ValueError, match=r"serves memory='lean' only.*memory='fast'"):
            jk.linear_logprobs(HIDDEN, WEIGHT, ACTIONS, backend="chunked", memory="fast")


# -- under jit and grad --------------------------------------------------------------------------


def test_the_scope_decides_the_compiled_memory_under_jit():
    def temp(memory=None):
        def loss(h, w):
            return jnp.sum(jk.linear_logprobs(h, w, ACTIONS, memory=memory))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(HIDDEN, WEIGHT).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    lean_bytes, fast_bytes = temp("lean"), temp("fast")
    assert lean_bytes != fast_bytes
    with jk.memory_mode("fast"):
        assert temp() == fast_bytes
        with jk.memory_mode("lean"):
            assert temp() == lean_bytes


def test_gradients_with_the_scope_are_those_of_the_argument(monkeypatch):
    with_fast, with_lean = grads("fast"), grads("lean")
    assert_differ(with_fast, with_lean)  # bfloat16: the kept logits are rounded
    with jk.memory_mode("fast"):
        assert_same(grads(), with_fast)
        assert_same(jax.jit(grads)(), with_fast)
    monkeypatch.setenv(ENV, "fast")
    assert_same(grads(), with_fast)
    with jk.memory_mode("lean"):
        assert_same(grads(), with_lean)


def test_a_function_traced_in_the_scope_keeps_its_mode():
    traces = []

    @jax.jit
    def step(h, w):
        traces.append(None)
        return jax.grad(
            lambda h, w: jnp.sum(jk.linear_logprobs(h, w, ACTIONS) * jnp.arange(T)), argnums=(0, 1)
        )(h, w)

    with jk.memory_mode("fast"):
        inside = step(HIDDEN, WEIGHT)
    outside = step(HIDDEN, WEIGHT)  # the trace of the scope, not a new one
    assert len(traces) == 1
    assert_same(inside, grads("fast"))
    assert_same(outside, grads("fast"))
