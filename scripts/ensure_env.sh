#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and prints its python.
# Reused while pyproject.toml is unchanged (its hash is stored in .venv/.pins).
# One environment serves training and tests (the test extra is small: pytest, transformers, ruff).
# Usage: PY=$(scripts/ensure_env.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
want="$(sha256sum < "$root/pyproject.toml" | cut -c1-16)"
if [[ -x "$venv/bin/python" && -f "$venv/.pins" && "$(cat "$venv/.pins")" == "$want" ]]; then
  echo "$venv/bin/python"
  exit 0
fi
# shellcheck source=python_check.sh
source "$root/scripts/python_check.sh"
find_python311 "titan_spec needs" " (set PYTHON=/path/to/python3.11)"
echo "titan_spec: setting up $venv (first use; torch is large, this takes a few minutes)" >&2
rm -rf "$venv"
"$py" -m venv "$venv"
spec="$root[test]"
"$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check -e "$spec" >&2
echo "$want" > "$venv/.pins"
echo "$venv/bin/python"
