"""The scripts in examples/ run, briefly: a couple of train steps in each head layout."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (flax.linen modules) look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["grpo_nnx", "grpo_linen"])
def test_flax_examples_train_in_both_layouts(name, capsys):
    load(name).main(["--steps", "2", "--layout", "both"])
    out = capsys.readouterr().out
    for layout in ("vd", "dv"):
        assert f"[{layout}] step   1  loss" in out and f"[{layout}] mean reward" in out, out
    if name == "grpo_nnx":
        assert "linear_grpo_loss: reference (automatic)" in out, out  # jk.explain's report


def test_tunix_example_matches_tunix(capsys):
    pytest.importorskip("tunix", reason="the tunix extra is not installed")
    load("tunix_grpo").main(["--steps", "1"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("step 0: loss"))
    losses = line.split("loss ")[1].split(",")[0].split(" / ")
    assert abs(float(losses[0]) - float(losses[1])) <= 1e-5, line
    gap = float(out.split("largest parameter difference after 1 steps: ")[1].split()[0])
    assert gap < 1e-5, out
