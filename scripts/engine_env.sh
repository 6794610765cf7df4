# Sourced (not run) by scripts/ensure_vllm_env.sh and scripts/ensure_sglang_env.sh.
# A serving engine's environment is large (vLLM ~6 GB, SGLang ~11 GB), so it is built once per
# machine, keyed by a hash of its pins, in the user's cache directory, and shared by every
# clone: <cache>/titan_spec/envs/<name>-<hash>. A flock serializes two clones building the
# same one; the .pins marker is written last, so a half-built environment is never reused.
# Usage: ensure_engine_env NAME "PINS" "REMOVE" "CHECK" ["SETUP"]  -> prints the python.
#   PINS    pip requirements, REMOVE packages uninstalled afterwards, CHECK python run to
#   prove the environment works, SETUP a shell function run with $venv set (optional).
# TITAN_SPEC_ENV_CACHE moves the cache (default ${XDG_CACHE_HOME:-~/.cache}/titan_spec/envs).
ensure_engine_env() {
  local name="$1" pins="$2" remove="$3" check="$4" setup="${5:-}"
  local root cache want venv
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  cache="${TITAN_SPEC_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/titan_spec/envs}"
  want="$(printf '%s|%s|%s' "$pins" "$remove" "$(declare -f "$setup" 2>/dev/null)" | sha256sum | cut -c1-16)"
  venv="$cache/$name-$want"
  if [[ -x "$venv/bin/python" && "$(cat "$venv/.pins" 2>/dev/null)" == "$want" ]]; then
    echo "$venv/bin/python"
    return 0
  fi
  mkdir -p "$cache"
  exec 9>"$cache/$name-$want.lock"
  flock 9
  if [[ -x "$venv/bin/python" && "$(cat "$venv/.pins" 2>/dev/null)" == "$want" ]]; then
    exec 9>&-
    echo "$venv/bin/python"
    return 0
  fi
  # shellcheck source=python_check.sh
  source "$root/scripts/python_check.sh"
  find_python311 "titan_spec: the $name environment needs"
  echo "titan_spec: setting up $venv (first use on this machine; $name is large, this takes minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  # pip names every package its configured file:// index lacks ("... is ignored"): noise.
  _quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
  _quiet "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip >&2
  # shellcheck disable=SC2086
  _quiet "$venv/bin/pip" install --quiet --disable-pip-version-check $pins >&2
  if [[ -n "$remove" ]]; then
    # shellcheck disable=SC2086
    _quiet "$venv/bin/pip" uninstall --quiet -y $remove >&2 || true
  fi
  if [[ -n "$setup" ]]; then
    "$setup" >&2
  fi
  "$venv/bin/python" -c "$check" >&2
  echo "$want" > "$venv/.pins"
  exec 9>&-
  echo "$venv/bin/python"
}
