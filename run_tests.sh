#!/usr/bin/env bash
# Runs the test suite; sets up .venv on first use.
# Usage: ./run_tests.sh [pytest args]      e.g. ./run_tests.sh -k config -x
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=$(scripts/ensure_env.sh)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# --durations: the slowest tests in every log, so a suite that grows says where.
exec "$PY" -m pytest --durations=20 "$@"
