#!/usr/bin/env bash
# The wheels the GPU check takes to a lent GPU machine: its image has Python 3.12 and torch
# 2.11 (with triton, numpy and transformers' own dependencies) but no registry, and a call
# carries at most 64 MiB (the repository is ~3 MB). Fetched here, for that Python, into the
# ignored .gpu_wheels/; scripts/gpu_check.sh installs there the ones whose modules the image
# lacks (pip --no-index --no-deps --target) and runs every step against the image's torch.
# Each at the version .venv has (the one the suite ran), so .venv is set up first.
#
# Not taken: torch (2.14.1 is a CUDA wheel far over 64 MiB; torch_compat.py backfills 2.11),
# datasets (it needs pyarrow, a 55 MB wheel; torchtitan imports it at module level, titan_spec
# only for Parquet records, so gpu_check.sh puts a module that raises on use in its place where
# the image has none), flash-attn, sglang and vllm (the steps that need them say so).
#
# Usage: scripts/gpu_wheels.sh [--python-version 3.12] [--dest .gpu_wheels]
# Prints each wheel and the total size; exits 1 if it would not fit in one call with the
# repository.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
pyver=3.12
dest=.gpu_wheels
while (( $# )); do
  case "$1" in
    --python-version) pyver=${2:?}; shift 2 ;;
    --dest) dest=${2:?}; shift 2 ;;
    *) echo "gpu_wheels.sh: unknown argument '$1'; allowed: --python-version X.Y, --dest DIR" >&2; exit 2 ;;
  esac
done
if [[ ! "$pyver" =~ ^3\.[0-9]+$ ]]; then
  echo "gpu_wheels.sh: --python-version '$pyver' is not allowed; it must be major.minor, e.g. 3.12" >&2
  exit 2
fi
PY=$(scripts/ensure_env.sh)
# The distributions the trainer, the checks and pytest import, beyond what the image has:
# torchtitan and what it imports at module level, titan_spec's own dependencies, pytest.
names=(torchtitan torchao tyro docstring-parser typeguard typing-extensions spmd-types torchdata
       torch-checkpointing einops tomli safetensors tokenizers tqdm
       math-verify latex2sympy2-extended antlr4-python3-runtime
       tensorboard protobuf absl-py markdown
       pytest pluggy iniconfig pygments packaging)
freeze=$("$PY" -m pip freeze --disable-pip-version-check 2>/dev/null)
pins=()
for n in "${names[@]}"; do
  want=$(echo "$n" | tr '_' '-' | tr '[:upper:]' '[:lower:]')
  pin=$(echo "$freeze" | awk -F'==' -v w="$want" '{k=tolower($1); gsub("_","-",k)} k==w {print $1"=="$2}')
  if [[ -z "$pin" ]]; then
    echo "gpu_wheels.sh: $n is not in .venv (scripts/ensure_env.sh sets it up); its version is the one to take" >&2
    exit 1
  fi
  pins+=("$pin")
done
tag=${pyver/./}
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$pyver" --implementation cp --abi "cp$tag" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$dest.tmp" "${pins[@]}" \
  2> >(grep -v -e "is ignored: it is neither a file nor a directory" >&2)
rm -rf "$dest"
mv "$dest.tmp" "$dest"
printf '%s\n' "${pins[@]}" > "$dest/PINS"
total=0
for w in "$dest"/*.whl; do
  size=$(stat -c %s "$w")
  total=$(( total + size ))
  printf '%8.2f MB  %s\n' "$(echo "$size / 1000000" | bc -l)" "$(basename "$w")"
done
repo=$(git ls-files -z | xargs -0 stat -c %s | awk '{s+=$1} END {print s}')
limit=$(( 64 * 1024 * 1024 ))
printf '%8.2f MB  %d wheels for Python %s in %s; with the repository (%.2f MB): %.2f of %.2f MB a call carries\n' \
  "$(echo "$total / 1000000" | bc -l)" "$(ls "$dest"/*.whl | wc -l)" "$pyver" "$dest" \
  "$(echo "$repo / 1000000" | bc -l)" "$(echo "($total + $repo) / 1000000" | bc -l)" "$(echo "$limit / 1000000" | bc -l)"
(( total + repo < limit )) || { echo "gpu_wheels.sh: the wheels and the repository are over the 64 MiB a call carries" >&2; exit 1; }
