#!/usr/bin/env bash
# Launches titan_spec training with torchrun, like torchtitan's run_train.sh.
#   NGPU        processes per node (GPUs on a GPU machine, CPU processes otherwise); default 1
#   CONFIG_FILE TOML config; default train_configs/debug_cpu.toml (the embedded default)
#   LOG_RANK    ranks whose output is shown; default 0
# Extra arguments are config overrides: --section.key value
# Sets up .venv on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_cpu.toml}
LOG_RANK=${LOG_RANK:-0}
PY=$(scripts/ensure_env.sh)
export HF_HUB_OFFLINE=1
# Check the config in one process first: a config error prints one line and never starts a run.
WORLD_SIZE=$NGPU "$PY" -m titan_spec.train --check --config "$CONFIG_FILE" "$@"
if [[ "$("$PY" -c 'import torch; print(torch.cuda.is_available())')" == "False" ]]; then
  # CPU: split the cores between the processes.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
fi
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_spec.train --config "$CONFIG_FILE" "$@"
