#!/usr/bin/env bash
# Create .venv and install the project with everything it needs, at the versions constraints.txt pins.
# Idempotent: a stamp keyed by the hash of pyproject.toml, constraints.txt and this script skips the
# install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The venv's python first on PATH: some sdists' build scripts call a bare `python`, which a fresh Debian or
# Ubuntu machine does not have (fast-downward-textworld's setup.py does; it failed there without this).
export PATH="$PWD/.venv/bin:$PATH"
stamp=.venv/.evoharness-installed
want=$(sha256sum pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and exact: 2.13.0 is the CPU build on this disk; anything looser pulls CUDA wheels.
.venv/bin/pip install -q torch==2.13.0
# DeepSpeed builds from source: no CUDA ops, and against the torch above (no isolated build env).
DS_BUILD_OPS=0 .venv/bin/pip install -q --no-build-isolation deepspeed==0.19.8
# Every package at the version in constraints.txt: the same environment on every machine and in a reproduce.
.venv/bin/pip install -q -c constraints.txt -e ".[test]"
echo "$want" > "$stamp"
