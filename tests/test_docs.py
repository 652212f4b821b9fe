"""The repository documents itself: docs/api.md gives every public op's signature as the code
has it (each argument, its default, keyword-only or not), and nothing points outside the
repository."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import jaxrl_kernels as jk

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
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
    return out


def code_signature(name: str) -> dict[str, tuple[str, str | None]]:
    out = {}
    for p in inspect.signature(getattr(jk, name)).parameters.values():
        kind = "keyword" if p.kind is p.KEYWORD_ONLY else "positional"
        default = None if p.default is p.empty else repr(p.default)
        out[p.name] = (kind, default)
    return out


@pytest.mark.parametrize("name", [n for n in OPS if n not in ("use_backend", "explain",
                                                               "available_backends")])
def test_every_argument_is_documented_as_the_code_has_it(name):
    doc, code = documented_signature(name), code_signature(name)
    for arg, (kind, default) in code.items():
        assert arg in doc, f"{name}: argument {arg!r} is not in docs/api.md"
        assert doc[arg][0] == kind, f"{name}({arg}): documented {doc[arg][0]}, code {kind}"
        if default is not None:
            assert doc[arg][1] is not None and ast.literal_eval(doc[arg][1]) == ast.literal_eval(
                default), f"{name}({arg}): documented default {doc[arg][1]}, code {default}"
    positional = lambda sig: [a for a, (kind, _) in sig.items() if kind == "positional"]
    assert positional(doc) == positional(code), f"{name}: positional arguments or their order"


@pytest.mark.parametrize("name", ["available_backends", "use_backend", "explain"])
def test_dispatch_functions_are_documented(name):
    assert f"jk.{name}(" in API or f"`{name}" in API


@pytest.mark.parametrize("path", ["README.md", "docs/api.md"])
def test_nothing_points_outside_the_repository(path):
    text = (ROOT / path).read_text()
    assert "../shared" not in text and "SPEC.md" not in text
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith("http"):
            assert (ROOT / pathlib.Path(path).parent / link).exists(), f"{path}: {link} missing"


def test_readme_links_the_api_reference():
    assert "(docs/api.md)" in (ROOT / "README.md").read_text()
