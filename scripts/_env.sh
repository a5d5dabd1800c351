#!/usr/bin/env bash
# shellcheck shell=bash
# Sourced by the other scripts: creates/updates a virtual environment.
# ensure_env NAME REQUIREMENTS_FILE -> sets ENV_PYTHON
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENVS="${PALLAS_KERNELS_VENVS:-$REPO_ROOT/.venvs}"

# find_python MIN_MINOR: the oldest Python >= 3.MIN_MINOR that runs, looked up
# as python3.MIN_MINOR, python3.(MIN_MINOR+1), ... on PATH, then under pyenv's
# versions, then python3 itself; empty if none.
find_python() {
  local min_minor="$1" candidate minor
  for minor in 10 11 12 13 14 15; do
    (( minor < min_minor )) && continue
    candidate="$(command -v "python3.$minor" 2>/dev/null || true)"
    if [[ -n "$candidate" ]] && "$candidate" -c 'import sys' >/dev/null 2>&1; then
      echo "$candidate"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local root
    root="$(pyenv root)"
    for candidate in $(find "$root/versions" -mindepth 1 -maxdepth 1 -name "3.*" 2>/dev/null | sort -V); do
      minor="$(basename "$candidate" | cut -d. -f2)"
      if [[ "$minor" =~ ^[0-9]+$ ]] && (( minor >= min_minor )) \
          && [[ -x "$candidate/bin/python3" ]]; then
        echo "$candidate/bin/python3"; return 0
      fi
    done
  fi
  python3 -c "import sys; sys.exit(sys.version_info < (3, $min_minor))" \
    2>/dev/null && command -v python3
  return 0
}

# ensure_env NAME REQUIREMENTS_FILE [PYTHON]: the venv is created with PYTHON
# (default: $PYTHON or python3); a venv made by another interpreter version
# is rebuilt.
ensure_env() {
  local name="$1" requirements="$2" python="${3:-${PYTHON:-python3}}"
  local venv="$VENVS/$name"
  local stamp="$venv/.requirements.sha256"
  local want
  want="$(cat "$requirements" "$REPO_ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  local want_version
  want_version="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [[ -x "$venv/bin/python" ]] && [[ "$("$venv/bin/python" -c \
      'import sys; print("%d.%d" % sys.version_info[:2])')" != "$want_version" ]]; then
    echo "[setup] $venv was built with another Python; rebuilding with $want_version" >&2
    rm -rf "$venv"
  fi
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "[setup] creating $venv with Python $want_version ($python)" >&2
    "$python" -m venv "$venv"
  fi
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    local size
    size="$(sed -n 's/^# size: //p' "$requirements" | head -n 1)"
    echo "[setup] 1/3 pip itself, in $venv" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
    echo "[setup] 2/3 $(basename "$requirements") (${size:-size unknown}; pip's progress follows)" >&2
    "$venv/bin/python" -m pip install --progress-bar on --disable-pip-version-check \
      -r "$requirements" >&2
    echo "[setup] 3/3 this repository, editable" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$REPO_ROOT" >&2
    echo "$want" > "$stamp"
    echo "[setup] done: $venv" >&2
  fi
  # shellcheck disable=SC2034  # read by the scripts that source this file
  ENV_PYTHON="$venv/bin/python"
}

# ensure_newest_jax_env: the newest-jax venv ("jax") on a Python >= 3.12
# (jax 0.12 needs it); without one, jax 0.10.2 on python3, with a warning.
ensure_newest_jax_env() {
  local python
  python="$(find_python 12)"
  if [[ -n "$python" ]]; then
    ensure_env jax "$REPO_ROOT/requirements/jax-latest.txt" "$python"
  else
    echo "[setup] WARNING: no Python >= 3.12 on PATH or in pyenv; the newest-jax" \
      "environment falls back to jax 0.10.2 on $(python3 --version 2>&1)" >&2
    ensure_env jax "$REPO_ROOT/requirements/jax-py311.txt" python3
  fi
}

