#!/usr/bin/env bash
# The prepared GPU check: every GPU-only path of titan_spec in one go, in under 8 minutes with the installs,
# one JSON (bench/results/gpu_check/gpu_check.json) and a table. Steps and what each
# measures: docs/PERFORMANCE.md, "The GPU check". Driver: scripts/gpu_check.py.
# Without CUDA it prints one line and exits 2. On a machine without a registry (the lent one:
# Python 3.12, torch 2.11), run scripts/gpu_wheels.sh here first and carry .gpu_wheels with the
# call: what the image lacks is installed from it (scripts/gpu_site.py) and every step runs
# against the image's torch. On the device: scripts/gpu_check.sh --out-dir "$OUT".
# Usage: scripts/gpu_check.sh [--out-dir DIR] [--budget-s 440] [--only gpu_tests,ttt_attention,...]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False on this machine); run it on a GPU machine" >&2
  exit 2
fi
site=""
if [[ -d .gpu_wheels ]]; then
  # A lent machine has no registry: what its image lacks comes from the wheels
  # scripts/gpu_wheels.sh fetched (carried with the call), into .gpu_site only.
  rm -rf .gpu_site
  "$PY" scripts/gpu_site.py .gpu_wheels .gpu_site || exit 1
  site="$PWD/.gpu_site"
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
exec "$PY" scripts/gpu_check.py "$@"
