#!/usr/bin/env bash
# The test files the GPU check depends on, under torch 2.11.0: the torch of the image the lent
# GPU machine runs (it has no registry, and the pinned 2.14.1 cannot travel with a call), so
# titan_spec/torch_compat.py and the preflight's torch refusals are proved here, on CPU, before
# a device is lent. Not part of CI (it builds a second torch environment).
#
# The environment, .venv-torch2.11, is the trainer's .venv with torch 2.11.0 (and the CUDA
# libraries and triton it pins, as on the image) in place of 2.14.1: every other package at the
# version .venv has, installed without dependencies, then the project itself (--no-deps).
# Reused while .venv's package list is unchanged (its hash is in .venv-torch2.11/.pins).
#
# Each file's result: passed, failed, or refused (a test skipped because the preflight refuses
# what it runs on torch < 2.14: tests/conftest.py, the needs_torch_2_14 marker).
# Writes bench/results/compat_check.json and prints a table.
# Usage: scripts/compat_check.sh [test files...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
PY=$(scripts/ensure_env.sh)
venv="$root/.venv-torch2.11"
torch_pin="torch==2.11.0"
# The files the GPU check's steps run or depend on (scripts/gpu_check.py): the co-training
# step (train, draft, compile, FSDP at dp = 2), the TTT attention, context parallelism, the
# pipeline's tap channel, MoE, the built-in engine, the check's own argument parsing and
# installs, the backfills and refusals themselves.
files=("$@")
if (( ${#files[@]} == 0 )); then
  files=(tests/test_config.py tests/test_attention.py tests/test_numerics.py tests/test_draft.py
         tests/test_draft_kinds.py tests/test_dflash.py tests/test_train.py tests/test_compile.py
         tests/test_cp_train.py tests/test_context_parallel.py tests/test_pipeline.py tests/test_tap_channel.py
         tests/test_moe.py tests/test_rollout_engine.py tests/test_spec_acceptance.py tests/test_gpu_check.py
         tests/test_torch_support.py)
fi
quiet() { "$@" 2> >(grep -v -e "is ignored: it is neither a file nor a directory" -e "^  *!!" >&2); }
others=$("$PY" -m pip freeze --disable-pip-version-check 2>/dev/null \
  | grep -v -i -E '^(#|torch==|triton==|nvidia-|cuda-|-e |titan.spec)' | sort)
want="$(printf '%s\n%s' "$torch_pin" "$others" | sha256sum | cut -c1-16)"
if [[ ! -x "$venv/bin/python" || ! -f "$venv/.pins" || "$(cat "$venv/.pins")" != "$want" ]]; then
  # shellcheck source=python_check.sh
  source scripts/python_check.sh
  find_python311 "compat_check needs"
  echo "compat_check: setting up $venv ($torch_pin and .venv's other packages; a few minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  quiet "$venv/bin/pip" install --quiet --disable-pip-version-check "$torch_pin" >&2
  # shellcheck disable=SC2086
  quiet "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps $others >&2
  quiet "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$root" >&2
  "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.11.0'), torch.__version__" >&2
  echo "$want" > "$venv/.pins"
fi
out="$root/bench/results/compat_check"
mkdir -p "$out"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  echo "compat_check: $f" >&2
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs --junitxml "$out/$name.xml" "$f" > "$out/$name.log" 2>&1 || true
done
"$venv/bin/python" - "$out" "${files[@]}" <<'EOF'
import json, os, sys, time, xml.etree.ElementTree as ET
import torch
out, files = sys.argv[1], sys.argv[2:]
rows = []
for f in files:
    name = os.path.basename(f)[:-3]
    row = {"file": f, "passed": 0, "failed": 0, "refused": 0, "skipped": 0, "failures": [], "seconds": 0.0}
    try:
        suite = ET.parse(os.path.join(out, name + ".xml")).getroot()
    except (OSError, ET.ParseError):
        row["failed"], row["failures"] = 1, ["no junit report: see " + name + ".log"]
        rows.append(row)
        continue
    for case in suite.iter("testcase"):
        row["seconds"] += float(case.get("time", 0))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            row["failed"] += 1
            row["failures"].append(case.get("name"))
        elif skip is not None:
            refused = "refused on torch" in (skip.get("message") or "")
            row["refused" if refused else "skipped"] += 1
        else:
            row["passed"] += 1
    rows.append(row)
report = {"check": "compat_check", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "files": rows}
with open(os.path.join(out, "..", "compat_check.json"), "w") as fh:
    json.dump(report, fh, indent=2)
print(f"compat_check under torch {torch.__version__}")
print(f"{'file':<34} {'passed':>6} {'failed':>6} {'refused':>7} {'skipped':>7} {'s':>6}")
for r in rows:
    print(f"{os.path.basename(r['file']):<34} {r['passed']:>6} {r['failed']:>6} {r['refused']:>7} {r['skipped']:>7} "
          f"{r['seconds']:>6.0f}" + (f"  failed: {', '.join(r['failures'][:4])}" if r["failures"] else ""))
tot = {k: sum(r[k] for r in rows) for k in ("passed", "failed", "refused", "skipped")}
print(f"{'total':<34} {tot['passed']:>6} {tot['failed']:>6} {tot['refused']:>7} {tot['skipped']:>7}")
sys.exit(1 if tot["failed"] else 0)
EOF
