# Sourced (not run) by scripts/ensure_env.sh and scripts/ensure_vllm_env.sh: both build their
# virtual environment from the same Python 3.11, found the same way.
# Usage: find_python311 "MESSAGE PREFIX" ["HINT"]  -> sets $py, or prints
#   "MESSAGE PREFIX Python 3.11; found <version>HINT" to stderr and exits the caller with 1.
find_python311() {
  py="${PYTHON:-python3.11}"
  command -v "$py" >/dev/null 2>&1 || py=python3
  if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
    echo "$1 Python 3.11; found $("$py" --version 2>&1)${2:-}" >&2
    exit 1
  fi
}
