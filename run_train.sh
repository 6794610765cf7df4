#!/usr/bin/env bash
# Launches titan_spec training with torchrun, like torchtitan's run_train.sh.
#   NGPU        processes per node (GPUs on a GPU machine, CPU processes otherwise); default 1
#   CONFIG_FILE TOML config; default train_configs/debug_cpu.toml (the embedded default)
#   LOG_RANK    ranks whose output is shown (local ranks, on every node); default 0
# More than one machine: run this on every node with the same settings and
#   NNODES        nodes in the job; default 1
#   NODE_RANK     this node's index, 0 .. NNODES-1 (node 0 hosts the rendezvous); default 0
#   RDZV_ENDPOINT host:port of node 0 for torchrun's c10d rendezvous; required when NNODES > 1
#   RDZV_ID       the job's rendezvous id, the same on every node; default titan_spec
# (scripts/multinode_trainer.slurm does this under SLURM). The dump folder must be on a
# filesystem every node sees.
# Extra arguments are config overrides: --section.key value
# Sets up .venv on first use.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
NGPU=${NGPU:-1}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_cpu.toml}
LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
RDZV_ID=${RDZV_ID:-titan_spec}
# Checked before anything starts (no Python import): torchrun would fail on them with a
# traceback, or wait for nodes that never come.
if [[ ! "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NGPU = '$NGPU' is not allowed; it must be a positive integer (processes per node)" >&2
  exit 2
fi
if [[ ! "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_train.sh: NNODES = '$NNODES' is not allowed; it must be a positive integer (nodes in the job)" >&2
  exit 2
fi
if [[ ! "$NODE_RANK" =~ ^(0|[1-9][0-9]*)$ ]] || (( NODE_RANK >= NNODES )); then
  echo "run_train.sh: NODE_RANK = '$NODE_RANK' is not allowed; it must be an integer from 0 to NNODES-1 = $(( NNODES - 1 )) (this node's index)" >&2
  exit 2
fi
if (( NNODES > 1 )) && { [[ ! "$RDZV_ENDPOINT" =~ ^([A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]):[1-9][0-9]{0,4}$ ]] || (( ${RDZV_ENDPOINT##*:} > 65535 )); }; then
  echo "run_train.sh: RDZV_ENDPOINT = '$RDZV_ENDPOINT' is not allowed; with NNODES = $NNODES it must be host:port, node 0's address and a port free there (e.g. 10.0.0.1:29500), the same on every node" >&2
  exit 2
fi
if [[ ! "$RDZV_ID" =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "run_train.sh: RDZV_ID = '$RDZV_ID' is not allowed; it must be letters, digits, '.', '_' or '-', the same on every node" >&2
  exit 2
fi
# One node: a private rendezvous on a free port. More: torchrun's c10d rendezvous, as
# torchtitan's multinode_trainer.slurm starts it. c10d numbers the nodes itself (torchrun
# ignores --node_rank there, with a warning), so NODE_RANK names the node that hosts the
# rendezvous store instead; left to torchrun, every node whose address matches the endpoint
# tries to (on one machine, all of them). Each run of a job.requires chain gets its own id: a
# node still closing the previous run's rendezvous cannot close the next one's.
if (( NNODES == 1 )); then
  RDZV=(--standalone)
else
  RDZV=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT"
        --rdzv_conf "is_host=$(( NODE_RANK == 0 ))")
fi
# SIGTERM / SIGINT (a scheduler, Ctrl-C, kill PID) are forwarded to the command running now
# and this script waits for it to exit, then stops: a bash script running a command in the
# foreground neither passes the signal on nor returns before the command does, and without a
# trap it dies at once and leaves torchrun running orphaned. So every Python runs as `child`
# (in the background, waited for). torchrun passes the signal to every rank and waits for them
# (SIGKILL after 30 s). A rerun of the same command skips the runs that finished (DONE) and
# resumes the stopped one from its last verified checkpoint (training/checkpoint.py: a save
# the signal cut short has no manifest and is passed over).
CHILD=""
SIGNAL=""
# A background command of a script ignores SIGINT (bash), so SIGTERM is what is passed on.
forward() {
  SIGNAL=$1
  if [[ -n "$CHILD" ]]; then kill -s TERM "$CHILD" 2>/dev/null || true; fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
# child CMD...: runs CMD in the background and waits until it has exited, through any number
# of forwarded signals; its exit status. A trapped signal ends `wait` early (status > 128),
# not the command, so after one it waits again; a last `wait` collects a status bash reaped
# meanwhile (127: none left to collect, the one already read stands).
child() {
  local rc=0 again=0
  "$@" &
  CHILD=$!
  wait "$CHILD" || rc=$?
  while [[ -n "$SIGNAL" ]] && kill -0 "$CHILD" 2>/dev/null; do
    rc=0
    wait "$CHILD" || rc=$?
  done
  if [[ -n "$SIGNAL" ]]; then
    wait "$CHILD" 2>/dev/null || again=$?
    (( again == 127 )) || rc=$again
  fi
  CHILD=""
  return "$rc"
}
stop_if_signalled() {
  [[ -z "$SIGNAL" ]] && return 0
  echo "run_train.sh: stopped by SIG$SIGNAL; every process of the run has exited; rerun the same command to resume from the last verified checkpoint" >&2
  [[ "$SIGNAL" == INT ]] && exit 130
  exit 143
}
PY=$(scripts/ensure_env.sh)
stop_if_signalled  # a signal during the set-up waited for it (a command substitution)
export HF_HUB_OFFLINE=1
# Read and check every config of the run in one process first (the default requires an SFT
# warm start and an offline draft run; job.requires): a config error prints one line and
# nothing starts. Runs already finished (DONE in their dump folder) are skipped.
PLAN=$(mktemp)
trap 'rm -f "$PLAN"' EXIT
PLAN_RC=0
WORLD_SIZE=$(( NGPU * NNODES )) child "$PY" -m titan_spec.train --plan --config "$CONFIG_FILE" "$@" > "$PLAN" || PLAN_RC=$?
stop_if_signalled
(( PLAN_RC == 0 )) || exit 2
mapfile -t RUNS < "$PLAN"
# CPU (no NVIDIA device node, or TITAN_SPEC_DEVICE=cpu): split the cores between the
# processes. Read from the device nodes, not from torch: every Python start that imports
# torch costs seconds before the first step.
FORCED=${TITAN_SPEC_DEVICE:-}
if [[ "${FORCED,,}" == cpu || ! -e /dev/nvidia0 ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}
fi
for i in "${!RUNS[@]}"; do
  RUN=${RUNS[$i]}
  # Command-line overrides apply to the requested config (the last run) only.
  ARGS=()
  (( i == ${#RUNS[@]} - 1 )) && ARGS=("$@")
  echo "titan_spec: run $RUN"
  RC=0
  # The plan checked the first run against the files as they are; a later run's inputs were
  # checked against what the runs before it promised to write. Each rank reads them again
  # before it builds anything (titan_spec.train: the same checks), so a later run whose
  # inputs are not what was promised stops there with the same one line and exit 2, and no
  # separate checking process (a Python start with torch, seconds) runs between the runs.
  # titan_spec.train.launch is torchrun without its multi-line report of a rank that already said
  # in one line why it stopped.
  ID=()
  (( NNODES > 1 )) && ID=(--rdzv_id "$RDZV_ID-$i")
  child "$PY" -m titan_spec.train.launch "${RDZV[@]}" "${ID[@]}" --nproc_per_node="$NGPU" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m titan_spec.train --config "$RUN" "${ARGS[@]}" || RC=$?
  stop_if_signalled
  (( RC == 0 )) || exit "$RC"
done
