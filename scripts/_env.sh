#!/usr/bin/env bash
# shellcheck shell=bash
# Sourced by the other scripts: creates/updates a virtual environment.
# ensure_env NAME REQUIREMENTS_FILE -> sets ENV_PYTHON
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENVS="${PALLAS_KERNELS_VENVS:-$REPO_ROOT/.venvs}"

ensure_env() {
  local name="$1" requirements="$2"
  local venv="$VENVS/$name"
  local stamp="$venv/.requirements.sha256"
  local want
  want="$(cat "$requirements" "$REPO_ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "[setup] creating $venv" >&2
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "[setup] installing $(basename "$requirements") into $venv (first run takes minutes)" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$REPO_ROOT" >&2
    echo "$want" > "$stamp"
  fi
  # shellcheck disable=SC2034  # read by the scripts that source this file
  ENV_PYTHON="$venv/bin/python"
}
