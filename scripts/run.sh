#!/usr/bin/env bash
# The main job on the tiny CPU profile: set up, then run the pipeline end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/evoharness run "$@"
