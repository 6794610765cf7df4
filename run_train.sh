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
# Checked before anything starts (no Python import): torchrun would fail on it with a traceback.
if [[ ! "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NGPU = '$NGPU' is not allowed; it must be a positive integer (processes per node)" >&2
  exit 2
fi
PY=$(scripts/ensure_env.sh)
export HF_HUB_OFFLINE=1
# Read and check every config of the run in one process first (the default requires an SFT
# warm start and an offline draft run; job.requires): a config error prints one line and
# nothing starts. Runs already finished (DONE in their dump folder) are skipped.
mapfile -t RUNS < <(WORLD_SIZE=$NGPU "$PY" -m titan_spec.train --plan --config "$CONFIG_FILE" "$@" || echo "!")
[[ "${RUNS[-1]}" == "!" ]] && exit 2
if [[ "$("$PY" -c 'import torch; print(torch.cuda.is_available())')" == "False" ]]; then
  # CPU: split the cores between the processes.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
fi
for i in "${!RUNS[@]}"; do
  RUN=${RUNS[$i]}
  # Command-line overrides apply to the requested config (the last run) only.
  ARGS=()
  (( i == ${#RUNS[@]} - 1 )) && ARGS=("$@")
  echo "titan_spec: run $RUN"
  WORLD_SIZE=$NGPU "$PY" -m titan_spec.train --check --config "$RUN" "${ARGS[@]}"
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_spec.train --config "$RUN" "${ARGS[@]}"
done
