"""The one dispatch function: available_backends, use_backend, the env variable, explain, and
the automatic choice. Large problems are only traced (jax.make_jaxpr / explain on
ShapeDtypeStructs), so nothing big is allocated.

Which backend ran is observed through the traced program: the jaxpr of ``backend=None``
must equal the jaxpr of the backend that the rules of docs/api.md select.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxrl_kernels as jk

S = jax.ShapeDtypeStruct
F32, I32 = jnp.float32, jnp.int32
ALL = ("ffi", "pallas", "chunked", "reference")
ENV = "JAXRL_KERNELS_BACKEND"
THRESHOLD = 256 * 2**20
ON_CPU = jax.default_backend() == "cpu"


def specs(op, n_rows, vocab, d=8):
    """(args, kwargs) of ShapeDtypeStructs for op with N = n_rows tokens and vocabulary V."""
    b, t = 1, n_rows
    tok = S((b, t), F32)
    if op == "token_logprobs":
        return (S((n_rows, vocab), F32), S((n_rows,), I32)), {}
    if op == "linear_logprobs":
        return (S((n_rows, d), F32), S((vocab, d), F32), S((n_rows,), I32)), {}
    if op == "ratio_kl":
        return (S((b, t, vocab), F32), S((b, t, vocab), F32), S((b, t), I32), tok, tok), {}
    if op == "grpo_loss":
        return (
            (S((b, t, vocab), F32), S((b, t, vocab), F32), S((b, t), I32), tok, S((b,), F32), tok),
            {"group_size": 1},
        )
    if op == "linear_ppo_loss":
        return (S((b, t, d), F32), S((vocab, d), F32), S((b, t), I32), tok, S((b,), F32), tok), {}
    if op == "linear_grpo_loss":
        return (
            (S((b, t, d), F32), S((vocab, d), F32), S((b, t), I32), tok, S((b,), F32), tok),
            {"group_size": 1},
        )
    if op == "ppo_loss":
        return (tok, tok, tok, tok), {}
    raise KeyError(op)


VOCAB_OPS = [
    "token_logprobs",
    "linear_logprobs",
    "ratio_kl",
    "grpo_loss",
    "linear_ppo_loss",
    "linear_grpo_loss",
]
BACKEND_OPS = VOCAB_OPS + ["ppo_loss"]  # the ops whose documented signature has backend=


def jaxpr(op, args, kwargs, backend):
    fn = getattr(jk, op)
    return str(jax.make_jaxpr(lambda *a: fn(*a, backend=backend, **kwargs))(*args))


def auto_is(op, args, kwargs, name):
    return jaxpr(op, args, kwargs, None) == jaxpr(op, args, kwargs, name)


def picked_line(op, args, kwargs, name):
    """explain() has a line naming the op and the backend it picked (and not only as declined)."""
    text = jk.explain(op, *args, **kwargs)
    ok = any(op in line and name in line and "declined" not in line for line in text.splitlines())
    assert ok, f"explain does not say {op} -> {name}:\n{text}"
    return ok


SMALL = (16, 7)
ABOVE = (2048, 32769)  # 4 * N * V = 256 MiB + 8 KiB
AT = (2048, 32768)  # 4 * N * V = 256 MiB exactly (not above)


# ----------------------------------------------------------------------------- available_backends


@pytest.mark.parametrize("op", BACKEND_OPS + ["group_advantages"])
def test_available_backends(op):
    got = jk.available_backends(op)
    assert isinstance(got, tuple) and all(isinstance(x, str) for x in got)
    assert "reference" in got and "chunked" in got
    assert set(got) <= set(ALL) and len(set(got)) == len(got)
    if ON_CPU:
        assert "ffi" not in got


@pytest.mark.skipif(not ON_CPU, reason="CPU selection rules")
@pytest.mark.parametrize("op", BACKEND_OPS + ["group_advantages"])
def test_available_backends_on_cpu_in_the_order_automatic_choice_uses(op):
    """reference (ordinary sizes), then chunked (large vocabularies, or asked for), then pallas
    (interpret mode, only when asked for)."""
    got = jk.available_backends(op)
    want = ("reference", "chunked", "pallas") if "pallas" in got else ("reference", "chunked")
    assert got == want
    if op == "group_advantages":
        return
    args, kwargs = specs(op, *SMALL)
    assert auto_is(op, args, kwargs, got[0])
    if op in VOCAB_OPS:
        args, kwargs = specs(op, *ABOVE)
        assert auto_is(op, args, kwargs, got[1])


def test_every_backend_name_is_listed_in_dispatch():
    from jaxrl_kernels import dispatch

    assert set(dispatch.BACKENDS) == set(ALL)


def test_available_backends_unknown_op():
    with pytest.raises(ValueError, match="token_logprobs"):
        jk.available_backends("no_such_op")


# ----------------------------------------------------------------------------- automatic choice


@pytest.mark.skipif(not ON_CPU, reason="CPU selection rules")
@pytest.mark.parametrize("op", BACKEND_OPS)
def test_automatic_small_is_reference(op):
    args, kwargs = specs(op, *SMALL)
    assert auto_is(op, args, kwargs, "reference")
    assert picked_line(op, args, kwargs, "reference")


@pytest.mark.skipif(not ON_CPU, reason="CPU selection rules")
@pytest.mark.parametrize("op", VOCAB_OPS)
def test_automatic_large_vocab_is_chunked(op):
    """Above 256 MiB of float32 [N, V] the vocabulary ops switch to chunked; at it, they do not."""
    assert 4 * ABOVE[0] * ABOVE[1] > THRESHOLD and 4 * AT[0] * AT[1] == THRESHOLD
    args, kwargs = specs(op, *ABOVE)
    assert auto_is(op, args, kwargs, "chunked")
    assert not auto_is(op, args, kwargs, "reference")
    assert picked_line(op, args, kwargs, "chunked")
    args, kwargs = specs(op, *AT)
    assert auto_is(op, args, kwargs, "reference")


@pytest.mark.skipif(not ON_CPU, reason="CPU selection rules")
def test_eval_shape_large_allocates_nothing():
    """jax.eval_shape of a >1 GiB-logits problem runs without allocating it."""
    args, kwargs = specs("linear_ppo_loss", 8192, 32768)
    loss, metrics = jax.eval_shape(lambda *a: jk.linear_ppo_loss(*a, **kwargs), *args)
    assert loss.shape == () and loss.dtype == jnp.float32
    assert all(v.shape == () for v in metrics.values())


def test_explain_names_declined_backends_with_reasons():
    args, kwargs = specs("token_logprobs", *SMALL)
    text = jk.explain("token_logprobs", *args, **kwargs)
    if ON_CPU:
        for better in ("ffi", "pallas", "chunked"):
            assert better in text, f"{better} not explained:\n{text}"
        assert "256" in text, f"the chunked threshold is not given as the reason:\n{text}"


def test_explain_unknown_op():
    with pytest.raises(ValueError, match="token_logprobs"):
        jk.explain("no_such_op")


# ----------------------------------------------------------------------------- overrides


def test_use_backend_scopes_the_default():
    args, kwargs = specs("token_logprobs", *SMALL)
    with jk.use_backend("chunked"):
        assert auto_is("token_logprobs", args, kwargs, "chunked")
        assert picked_line("token_logprobs", args, kwargs, "chunked")
        with jk.use_backend(None):
            assert auto_is("token_logprobs", args, kwargs, "reference") or not ON_CPU
        assert auto_is("token_logprobs", args, kwargs, "chunked")
        # an explicit argument beats the scope
        assert jaxpr("token_logprobs", args, kwargs, "reference") != jaxpr(
            "token_logprobs", args, kwargs, None
        )
    if ON_CPU:
        assert auto_is("token_logprobs", args, kwargs, "reference")


def test_use_backend_restores_after_exception():
    args, kwargs = specs("token_logprobs", *SMALL)
    before = jaxpr("token_logprobs", args, kwargs, None)
    with pytest.raises(RuntimeError):
        with jk.use_backend("chunked"):
            raise RuntimeError("boom")
    assert jaxpr("token_logprobs", args, kwargs, None) == before


def test_use_backend_applies_inside_jit():
    """The scope in force when a function is traced decides (here under jax.jit)."""
    logits = jnp.zeros((3, 5))
    targets = jnp.zeros((3,), I32)
    with jk.use_backend("chunked"):
        a = jax.jit(lambda l: jk.token_logprobs(l, targets))(logits)
    b = jk.token_logprobs(logits, targets, backend="chunked")
    assert jnp.allclose(a, b)


def test_env_variable(monkeypatch):
    args, kwargs = specs("linear_logprobs", *SMALL)
    monkeypatch.setenv(ENV, "chunked")
    assert auto_is("linear_logprobs", args, kwargs, "chunked")
    with jk.use_backend("reference"):  # a scope beats the process-wide variable
        assert auto_is("linear_logprobs", args, kwargs, "reference")
    assert picked_line("linear_logprobs", args, kwargs, "chunked")
    monkeypatch.setenv(ENV, "reference")
    assert auto_is("linear_logprobs", args, kwargs, "reference")


def test_env_variable_invalid(monkeypatch):
    monkeypatch.setenv(ENV, "bogus")
    with pytest.raises(ValueError, match=ENV) as err:
        jk.token_logprobs(jnp.zeros((2, 3)), jnp.zeros((2,), I32))
    assert "reference" in str(err.value) and "chunked" in str(err.value)


def test_unknown_backend_names_are_rejected():
    with pytest.raises(ValueError) as err:
        jk.token_logprobs(jnp.zeros((2, 3)), jnp.zeros((2,), I32), backend="cuda")
    msg = str(err.value)
    assert "backend" in msg and "reference" in msg and "chunked" in msg
    with pytest.raises(ValueError) as err:
        with jk.use_backend("cuda"):
            pass
    assert "reference" in str(err.value)


# ----------------------------------------------------------------------------- explicit backends


@pytest.mark.skipif(not ON_CPU, reason="ffi can serve on a GPU")
@pytest.mark.parametrize("op", BACKEND_OPS)
def test_explicit_ffi_on_cpu_raises_with_reason(op):
    args, kwargs = specs(op, *SMALL)
    with pytest.raises(NotImplementedError) as err:
        jaxpr(op, args, kwargs, "ffi")
    msg = str(err.value)
    assert "ffi" in msg and len(msg) > 30, msg


@pytest.mark.parametrize("op", BACKEND_OPS)
def test_explicit_unavailable_pallas_raises(op):
    """Asked for explicitly, a backend that cannot run here raises NotImplementedError."""
    if "pallas" in jk.available_backends(op):
        pytest.skip("pallas can run here")
    args, kwargs = specs(op, *SMALL)
    with pytest.raises(NotImplementedError, match="pallas"):
        jaxpr(op, args, kwargs, "pallas")


@pytest.mark.parametrize("op", BACKEND_OPS)
def test_every_available_backend_can_be_asked_for(op):
    """Each backend available_backends lists serves an ordinary small call when asked for."""
    args, kwargs = specs(op, *SMALL)
    for name in jk.available_backends(op):
        if name == "ffi" and op != "linear_logprobs":
            continue
        jaxpr(op, args, kwargs, name)


def test_automatic_never_raises_for_unavailable_backends(monkeypatch):
    """Automatic choice falls through ffi/pallas to a backend that serves."""
    monkeypatch.delenv(ENV, raising=False)
    out = jk.linear_logprobs(jnp.ones((3, 4)), jnp.ones((5, 4)), jnp.zeros((3,), I32))
    assert out.shape == (3,)
