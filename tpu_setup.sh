#!/usr/bin/env bash
# Sets up a Cloud TPU VM for pallas-kernels and smoke-tests it.
#
#   bash tpu_setup.sh [--dry-run] [--force] [--venv DIR] [--skip-smoke]
#
# Installs, into a virtual environment (default: .venvs/tpu), the pinned TPU
# stack: torch 2.9.0 + torch_xla[tpu,pallas] 2.9.0 (which pins jax/jaxlib
# 0.7.1 and libtpu 0.0.21), torchax, and this package. Then it lists the TPU
# devices, runs every kernel once against its reference on the TPU
# (python -m pallas_kernels), and runs a few steps of the torch_xla FSDP demo.
#
#   --dry-run     print the commands instead of running them
#   --force       skip the TPU check (for testing this script elsewhere)
#   --venv DIR    where to create the environment
#   --skip-smoke  install only
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DRY_RUN=0
FORCE=0
SMOKE=1
VENV="$REPO_ROOT/.venvs/tpu"

TORCH_VERSION="2.9.0"
TORCH_XLA_VERSION="2.9.0"
JAX_VERSION="0.7.1"
TORCHAX_VERSION="0.0.7"

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --force) FORCE=1 ;;
    --skip-smoke) SMOKE=0 ;;
    --venv)
      [[ $# -ge 2 ]] || { echo "tpu_setup.sh: --venv needs a directory" >&2; exit 2; }
      VENV="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "tpu_setup.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

run() {
  if [[ $DRY_RUN -eq 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

has_tpu() {
  compgen -G "/dev/accel*" > /dev/null || compgen -G "/dev/vfio/[0-9]*" > /dev/null
}

if [[ $FORCE -eq 0 ]] && ! has_tpu; then
  cat >&2 <<'MSG'
tpu_setup.sh: no TPU found on this machine (no /dev/accel* or /dev/vfio/N).
This script is for Cloud TPU VMs. On a laptop or CI machine use instead:
  bash scripts/main.sh     # every kernel in interpret mode vs its reference
  bash scripts/test.sh     # the test suite (interpret mode + AOT TPU compiles)
MSG
  exit 2
fi

PY="$VENV/bin/python"
run "${PYTHON:-python3}" -m venv "$VENV"
run "$PY" -m pip install --upgrade pip
run "$PY" -m pip install "torch==$TORCH_VERSION" \
  "torch_xla[tpu,pallas]==$TORCH_XLA_VERSION" \
  "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" \
  "torchax==$TORCHAX_VERSION"
run "$PY" -m pip install --no-deps -e "$REPO_ROOT"

if [[ $SMOKE -eq 1 ]]; then
  run "$PY" -c "import jax; print('TPU devices:', jax.devices('tpu'))"
  run "$PY" -m pallas_kernels --size small
  run env PJRT_DEVICE=TPU "$PY" "$REPO_ROOT/examples/train_vit_fsdp.py" --tpu --steps 5
fi
echo "tpu_setup.sh: done"
