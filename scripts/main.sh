#!/usr/bin/env bash
# The main job: every kernel on this machine vs its reference, as a table.
#   bash scripts/main.sh [--size small|medium|large] [--ops NAME ...] [--help]
# shellcheck source=_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
# --help and bad arguments answer before any environment is built.
python3 "$REPO_ROOT/pallas_kernels/_cli.py" --check "$@" || exit $?
for arg in "$@"; do [[ "$arg" == -h || "$arg" == --help ]] && exit 0; done
ensure_newest_jax_env
cd "$REPO_ROOT" || exit 1
exec "$ENV_PYTHON" -m pallas_kernels "$@"
