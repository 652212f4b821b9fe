"""The GPU machine's shell scripts (benchmarks/gpu/): they parse, and run.sh takes a prebuilt
extension (prebuild.sh) only where the sources hash as they did when it was built."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks" / "gpu").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.fixture
def tree(tmp_path):
    """A copy of what the scripts read: benchmarks/gpu, csrc, pyproject.toml, and an empty
    package folder for the extension."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copytree(ROOT / "benchmarks" / "gpu", tmp_path / "benchmarks" / "gpu")
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "jaxrl_kernels").mkdir()
    return tmp_path


def sources_hash(tree):
    out = subprocess.run(
        ["bash", str(tree / "benchmarks" / "gpu" / "sources_hash.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", out), out
    return out


def test_sources_hash_follows_the_sources_only(tree):
    first = sources_hash(tree)
    assert sources_hash(tree) == first
    (tree / "csrc" / "__pycache__").mkdir()
    (tree / "csrc" / "__pycache__" / "x.cpython-312.pyc").write_bytes(b"\0")
    assert sources_hash(tree) == first  # the build backend's bytecode is no source
    source = tree / "csrc" / "ffi_kept_gemms.cc"
    source.write_text(source.read_text() + "\n")
    assert sources_hash(tree) != first
    changed = sources_hash(tree)
    (tree / "csrc" / "new.cu").write_text("")
    assert sources_hash(tree) not in (first, changed)  # a new file counts too


def run_install(tree, tmp_path):
    """run.sh with no steps (its staging and install only): (its output, the ``python3``
    command lines it ran). ``python3`` is a stub that records its arguments, so the script
    uninstalls and imports nothing of the machine running the test."""
    out, stub = tmp_path / "out", tmp_path / "bin"
    out.mkdir()
    stub.mkdir()
    calls = tmp_path / "python3_calls.txt"
    (stub / "python3").write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n')
    (stub / "python3").chmod(0o755)
    env = dict(os.environ, OUT=str(out), STEPS="", PATH=f"{stub}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(tree / "benchmarks" / "gpu" / "run.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.stdout + done.stderr, calls.read_text().splitlines()


def test_run_takes_a_prebuilt_extension_of_the_same_sources(tree, tmp_path):
    prebuilt = tree / ".prebuilt"
    prebuilt.mkdir()
    (prebuilt / "_sm90.cpython-312-x86_64-linux-gnu.so").write_bytes(b"not a real library")
    (prebuilt / "SOURCES.sha256").write_text(sources_hash(tree) + "\n")
    (prebuilt / "BUILD.txt").write_text("jaxlib 0.11.2 headers\n")
    log, python_calls = run_install(tree, tmp_path)
    assert "the prebuilt extension (jaxlib 0.11.2 headers), no build" in log, log
    # an earlier call's editable install would shadow the copy; nothing is built
    assert "-m pip uninstall -q -y jaxrl_kernels" in python_calls, python_calls
    assert not any("pip install" in call for call in python_calls), python_calls
    copied = tree / "jaxrl_kernels" / "_sm90.cpython-312-x86_64-linux-gnu.so"
    assert copied.read_bytes() == b"not a real library"
