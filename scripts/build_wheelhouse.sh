#!/usr/bin/env bash
# Collect into .carry/ (git-ignored) what scripts/device_run.sh installs on a GPU machine that has
# only jax (with CUDA), flax and numpy and no network: the server's and `bench serve`'s other
# dependencies as wheels for Python 3.12 on x86-64 Linux, and SmolLM2's tokenizer for the dummy
# model; fails when .carry/ and the working tree exceed the 64 MiB one device call carries
# (scripts/build_wheelhouse.py says how). Run here, with the network; --no-plot leaves matplotlib
# out (device_run then writes no PNG).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" scripts/build_wheelhouse.py "$@"
