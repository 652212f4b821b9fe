#!/usr/bin/env bash
# One sha256 over the files the CUDA extension is built from (csrc/, pyproject.toml), by path
# and content: prebuild.sh records it, run.sh compares it.
cd "$(dirname "$0")/../.."
find csrc pyproject.toml -type f -not -name '*.pyc' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1
