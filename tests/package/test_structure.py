"""The package's shape, checked: its folders are layers, and imports only go down.

Every module of ``jaxrl_kernels`` has a layer (:data:`LAYERS`, lowest first). A module may
import its own layer or a lower one, never a higher one (function-level imports included:
``dispatch.resolver`` imports the backends on first use, so the backends sit below it); the
import graph has no cycle; no backend imports another; no module is over 400 lines; the demo
and the integrations use the public names, except where :data:`INTERNAL_USES` says why.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "jaxrl_kernels"
MAX_LINES = 400

LAYERS = (
    ("formulas",),
    ("sharding.vma", "sharding._jax_internals"),
    ("head",),
    ("sharding",),
    ("dispatch.contract", "dispatch.trace_log", "dispatch.memory"),
    ("backends",),
    ("dispatch",),
    ("engine",),
    ("validation",),
    ("config",),
    ("ops",),
    ("",),  # the package's __init__: the public names
    ("integrations", "demo"),
)
"""Module-name prefixes (relative to ``jaxrl_kernels``) of each layer, lowest first; a module
belongs to the layer of its longest matching prefix."""

PUBLIC_MODULES = ("", "dispatch")
"""Modules whose names are public: the package (``jaxrl_kernels.<name>``) and
``jaxrl_kernels.dispatch`` (``BACKENDS``, ``select``, ``use_backend``)."""

INTERNAL_USES = {
    (
        "integrations.tunix.losses",
        "engine.head_entry",
    ): "tunix's losses are tunix's formulas (token_math) on the head's log-probs, so they "
    "take the one linear-head entry, as the public linear losses do, for the fused "
    "(memory='fast') gradient",
    ("integrations.tunix.losses", "engine.linear_head"): "the HeadCall that entry takes",
}
"""(importer, imported) pairs where the demo or an integration uses an internal module, and
why."""


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(name: str) -> int:
    best, best_len = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (prefix == "" and name == "") or (
                prefix and (name == prefix or name.startswith(prefix + "."))
            ):
                if len(prefix) > best_len:
                    best, best_len = rank, len(prefix)
    assert best is not None, f"jaxrl_kernels.{name} belongs to no layer of LAYERS"
    return best


EXTENSIONS = ("_sm90",)
"""Compiled modules of the package (csrc/), below every layer."""


def _target(name: str) -> str | None:
    """The module of ``jaxrl_kernels``'s that a dotted import name points at."""
    if name != "jaxrl_kernels" and not name.startswith("jaxrl_kernels."):
        return None
    if name.split(".")[1:2] and name.split(".")[1] in EXTENSIONS:
        return None
    rel = name[len("jaxrl_kernels.") :] if name != "jaxrl_kernels" else ""
    while rel and rel not in MODULES:
        rel = rel.rpartition(".")[0]
    return rel


def _imports(name: str) -> set[str]:
    """Every module of the package that ``name`` imports, anywhere in its body."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(_target(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(
                    ["jaxrl_kernels", *package.split(".")][
                        : len(package.split(".")) + 2 - node.level
                    ]
                )
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for alias in node.names:
                if base == "jaxrl_kernels" and alias.name in EXTENSIONS:
                    continue
                sub = _target(f"{base}.{alias.name}")
                out.add(sub if sub is not None and sub != _target(base) else _target(base))
    out.discard(None)
    out.discard(name)
    return out


GRAPH = {name: _imports(name) for name in MODULES}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
    mine = _layer(name)
    for other in sorted(GRAPH[name]):
        assert _layer(other) <= mine, (
            f"jaxrl_kernels.{name} (layer {LAYERS[mine]}) imports jaxrl_kernels.{other}, of a "
            f"higher layer {LAYERS[_layer(other)]}"
        )


def test_no_import_cycle():
    state: dict[str, int] = {}

    def visit(name, stack):
        state[name] = 1
        for other in sorted(GRAPH[name]):
            if state.get(other) == 1:
                cycle = stack[stack.index(other) :] + [other]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if other not in state:
                visit(other, stack + [other])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("backends.")))
def test_no_backend_imports_another(name):
    mine = name.split(".")[1] if name.count(".") else None
    for other in GRAPH[name]:
        if other.startswith("backends.") and other.count("."):
            assert other.split(".")[1] == mine, f"{name} imports another backend's {other}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_400_lines(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"jaxrl_kernels.{name}: {lines} lines (at most {MAX_LINES})"


@pytest.mark.parametrize(
    "name", sorted(n for n in MODULES if n.startswith(("demo", "integrations")))
)
def test_demo_and_integrations_use_public_names(name):
    own = name.split(".")[0] if name.startswith("demo") else ".".join(name.split(".")[:2])
    for other in sorted(GRAPH[name]):
        if other in PUBLIC_MODULES or other.startswith(own):
            continue
        assert (name, other) in INTERNAL_USES, (
            f"jaxrl_kernels.{name} imports the internal jaxrl_kernels.{other}: use the public "
            f"names (jaxrl_kernels.<name>) or say why in INTERNAL_USES"
        )


def test_the_layers_are_the_folders():
    """Each folder of the package is in LAYERS, and LAYERS names nothing that is gone."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    named = {prefix.split(".")[0] for prefixes in LAYERS for prefix in prefixes if prefix}
    assert folders <= named, f"folders not in LAYERS: {sorted(folders - named)}"
    for prefixes in LAYERS:
        for prefix in prefixes:
            assert prefix == "" or any(
                n == prefix or n.startswith(prefix + ".") for n in MODULES
            ), f"LAYERS names {prefix!r}: no module"
