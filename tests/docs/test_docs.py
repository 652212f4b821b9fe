"""The repository documents itself: docs/api.md gives every public op's signature as the code
has it (each argument, its default, keyword-only or not); every public op has a docstring with
Args, Returns and a runnable Example; README is short, shows examples/grpo_nnx.py's train step
verbatim and quotes its token-count figures from a result file; explain, docs/api.md and the demo agree;
no page points outside the repository or speaks the language of how it was made."""

from __future__ import annotations

import ast
import dataclasses
import doctest
import inspect
import json
import pathlib
import re
import subprocess

import jax
import jax.numpy as jnp
import pytest

import jaxrl_kernels as jk

ROOT = pathlib.Path(__file__).resolve().parents[2]
API = (ROOT / "docs" / "api.md").read_text()
README = (ROOT / "README.md").read_text()
PAGES = [
    "README.md",
    "benchmarks/README.md",
    "benchmarks/results/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]
# Linked pages another branch adds; each leaves this set when it lands.
PENDING: set[str] = set()
OPS = [name for name in jk.__all__ if inspect.isfunction(getattr(jk, name))]


def documented_signature(name: str) -> dict[str, tuple[str, str | None]]:
    """{argument: (kind, default source)} from the ```python block that opens with ``name(``."""
    match = re.search(rf"```python\n{name}\((.*?)\)(?: -> [^\n]*)?\n```", API, re.S)
    assert match, f"docs/api.md has no signature block for {name}"
    args = ast.parse(f"def f({match.group(1)}): pass").body[0].args
    out = {}
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for arg, default in zip(positional, defaults):
        out[arg.arg] = ("positional", None if default is None else ast.unparse(default))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out[arg.arg] = ("keyword", None if default is None else ast.unparse(default))
    if args.kwarg is not None:
        out[args.kwarg.arg] = ("var_keyword", None)
    return out


def code_signature(name: str) -> dict[str, tuple[str, str | None]]:
    out = {}
    for p in inspect.signature(getattr(jk, name)).parameters.values():
        kind = {p.KEYWORD_ONLY: "keyword", p.VAR_KEYWORD: "var_keyword"}.get(p.kind, "positional")
        default = None if p.default is p.empty else repr(p.default)
        out[p.name] = (kind, default)
    return out


@pytest.mark.parametrize(
    "name", [n for n in OPS if n not in ("use_backend", "explain", "available_backends")]
)
def test_every_argument_is_documented_as_the_code_has_it(name):
    doc, code = documented_signature(name), code_signature(name)
    for arg, (kind, default) in code.items():
        assert arg in doc, f"{name}: argument {arg!r} is not in docs/api.md"
        assert doc[arg][0] == kind, f"{name}({arg}): documented {doc[arg][0]}, code {kind}"
        if default is not None:
            assert doc[arg][1] is not None and ast.literal_eval(doc[arg][1]) == ast.literal_eval(
                default
            ), f"{name}({arg}): documented default {doc[arg][1]}, code {default}"
    positional = lambda sig: [a for a, (kind, _) in sig.items() if kind == "positional"]
    assert positional(doc) == positional(code), f"{name}: positional arguments or their order"


@pytest.mark.parametrize("name", ["available_backends", "use_backend", "explain", "memory_mode"])
def test_dispatch_functions_are_documented(name):
    assert f"jk.{name}(" in API or f"`{name}" in API


@pytest.mark.parametrize("path", PAGES)
def test_nothing_points_outside_the_repository(path):
    text = (ROOT / path).read_text()
    assert "../shared" not in text and "SPEC.md" not in text
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith("http"):
            target = (ROOT / pathlib.Path(path).parent / link).resolve()
            if str(target.relative_to(ROOT)) in PENDING:
                continue
            assert target.exists(), f"{path}: {link} missing"


def test_readme_links_the_api_reference():
    assert "(docs/api.md)" in README


# -- README ----------------------------------------------------------------------------------


def test_readme_is_short():
    assert len(README.splitlines()) <= 150


def test_readme_example_is_the_nnx_example_verbatim():
    source = (ROOT / "examples" / "grpo_nnx.py").read_text()
    region = re.search(r"^# \[train-step\]\n(.*?)^# \[/train-step\]\n", source, re.S | re.M)
    assert region, "examples/grpo_nnx.py lost its # [train-step] markers"
    assert f"```python\n{region.group(1)}```" in README


def test_readme_token_counts_come_from_their_results_file():
    """Every ratio the token-count paragraph quotes (two decimals) is a ratio of its file's
    rows, rounded as shown, and the plot it shows exists."""
    block = re.search(r"<!-- tokens: figures from (\S+) -->(.*?)<!-- /tokens -->", README, re.S)
    assert block, "README lost its delimited token-count paragraph"
    data = json.loads((ROOT / block.group(1)).read_text())
    ratios = {f"{r[k]:.2f}" for r in data["rows"] for k in ("x_floor", "x_jnp") if r.get(k)}
    quoted = re.findall(r"(?<![\d.])\d\.\d\d(?![\d.])", block.group(2))  # not a version
    assert quoted and set(quoted) <= ratios, sorted(set(quoted) - ratios)
    plot = re.search(r"!\[[^]]*\]\((\S+\.svg)\)", block.group(2))
    assert plot and (ROOT / plot.group(1)).exists()


# -- docstrings --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", jk.__all__)
def test_public_op_docstring_and_types(name):
    fn = getattr(jk, name)
    doc = inspect.getdoc(fn) or ""
    if inspect.isclass(fn):  # a config: its fields, typed, and an example
        for section in ("Attributes:", "Example:"):
            assert section in doc, f"{name}: no {section!r} section"
        assert all(f.type is not None for f in dataclasses.fields(fn)), name
        return
    for section in ("Args:", "Returns:", "Example:"):
        assert section in doc, f"{name}: no {section!r} section"
    sig = inspect.signature(fn)
    for param in sig.parameters.values():
        if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            assert param.annotation is not param.empty, f"{name}({param.name}): no type"
    assert sig.return_annotation is not sig.empty, f"{name}: no return type"
    arrays = [p.name for p in sig.parameters.values() if "ArrayLike" in str(p.annotation)]
    if name not in (
        "available_backends",
        "checks",
        "explain",
        "head_grad_pieces",
        "memory_mode",
        "use_backend",
    ):
        assert arrays, f"{name}: no ArrayLike argument"
        assert "jax.Array" in str(sig.return_annotation), name


@pytest.mark.parametrize("name", jk.__all__)
def test_docstring_examples_run(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder(recurse=False).find(getattr(jk, name), name, globs={})
    assert tests and tests[0].examples, f"{name}: no example"
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{name}: its Example does not run as written"


# -- explain, docs/api.md and the demo agree ---------------------------------------------------


def _api_block_after(marker: str) -> list[str]:
    start = API.index(marker)
    block = re.search(r"```\n(.*?)```", API[start:], re.S).group(1)
    return block.rstrip("\n").splitlines()


def test_explain_example_is_what_explain_prints():
    """docs/api.md's example (CPU, float32, 512 tokens, D = 64, V = 32000), line for line; the
    ffi line depends on whether this install built the extension."""
    args = (
        jax.ShapeDtypeStruct((512, 64), jnp.float32),
        jax.ShapeDtypeStruct((32000, 64), jnp.float32),
        jax.ShapeDtypeStruct((512,), jnp.int32),
    )
    if jax.default_backend() != "cpu":
        pytest.skip("the documented example is a CPU one")
    got = jk.explain("linear_logprobs", *args).splitlines()
    want = _api_block_after("**`jk.explain(op, *args, **kwargs) -> str`**")
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        if w.startswith("  - ffi declined:"):
            assert g.startswith("  - ffi declined:"), g
        else:
            assert g == w


def test_requested_backend_applies_to_each_piece_it_serves():
    """docs/api.md: a composite op applies the request to every piece the backend serves
    (log-probs, group advantages, the PPO term) and chooses automatically for the others."""
    hidden, weight = jnp.zeros((4, 8, 16)), jnp.zeros((64, 16))
    actions, tok = jnp.zeros((4, 8), jnp.int32), jnp.zeros((4, 8))
    with jk.use_backend("chunked"):
        grpo = jk.explain(
            "linear_grpo_loss",
            hidden,
            weight,
            actions,
            tok,
            jnp.zeros(4),
            tok,
            groups=jk.Groups(size=2),
        )
        ppo = jk.explain("linear_ppo_loss", hidden, weight, actions, tok, tok, tok)
    with jk.use_backend("ffi"):  # never serves group advantages: chosen automatically
        try:
            jk.explain(
                "linear_grpo_loss",
                hidden,
                weight,
                actions,
                tok,
                jnp.zeros(4),
                tok,
                groups=jk.Groups(size=2),
            )
        except NotImplementedError as err:  # ffi cannot serve the log-probs here
            assert "linear_grpo_loss: backend 'ffi' cannot serve this call" in str(err)
    for line in ("group_advantages: chunked (requested)", "linear_grpo_loss: chunked (requested)"):
        assert line in grpo, grpo
    assert "ppo_loss: chunked (requested)" in ppo, ppo
    paragraph = API[API.index("**Asking for one.**") : API.index("**`jk.available_backends")]
    for words in ("`group_advantages`", "PPO surrogate", "(requested)", "(automatic)"):
        assert words in paragraph, words


def test_one_device_layouts_as_documented():
    """With no mesh, reference is plain jnp and a kernel backend enters custom_partitioning;
    docs/api.md "Many devices" says so in explain's own words."""
    h, w, t = jnp.zeros((8, 16)), jnp.zeros((64, 16)), jnp.zeros(8, jnp.int32)
    auto = jk.explain(
        "linear_logprobs",
        h,
        w,
        t,
    )
    with jk.use_backend("chunked"):
        kernel = jk.explain("linear_logprobs", h, w, t)
    layout = lambda text: next(l for l in text.splitlines() if l.startswith("  layout: "))
    assert layout(auto).startswith("  layout: one device: ")
    assert "custom_partitioning" in layout(kernel)
    section = " ".join(API[API.index("## Many devices") : API.index("## Bad input")].split())
    assert "`layout: one device: ...`" in section
    prefix = layout(kernel)[len("  layout: ") :].split(";")[0]
    assert f"`layout: {prefix};" in section, prefix


def test_demo_configuration_agrees_with_its_help():
    """A dual clip is logged only for the algorithms whose loss takes one (--help names them)."""
    from jaxrl_kernels.demo import ALGOS, Config
    from jaxrl_kernels.demo.__main__ import _parser

    action = next(a for a in _parser()._actions if "--dual-clip" in a.option_strings)
    named = action.help.split("(")[1].split(")")[0].split(", ")
    for algo in ALGOS:
        if algo not in named:
            assert Config(algo=algo).dual_clip is None, algo


# -- no language of how the repository was made --------------------------------------------------

INTERNAL = re.compile(
    r"\bissue \d+|\bsession\b|\blent\b|\bcarried\b|(?:beyond|the) core contract|"
    r"device tool|METHOD\.md",
    re.I,
)


def test_no_internal_language():
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "*.md",
            "*.py",
            "*.sh",
            "*.toml",
            "*.txt",
            "*.cc",
            "*.cu",
            "*.cuh",
            "*.h",
            ".ci/run",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    hits = []
    for name in files:
        if name == "tests/docs/test_docs.py" or name.startswith("benchmarks/results/"):
            continue
        path = ROOT / name
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if INTERNAL.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)
