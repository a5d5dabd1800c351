#!/usr/bin/env bash
# The test suite, in both supported environments; fails if either fails.
#   newest jax (+ libtpu for AOT TPU compiles): the JAX suite
#   torch 2.9 + torch_xla 2.9 + jax 0.7.1 + torchax: the torch_bridge tests
#   and the compatibility tier (-m compat: every op on every CPU backend,
#   vmap, sharding, AOT per generation) on the oldest supported jax
# Extra arguments go to pytest (e.g. -k nms). With --runslow the oldest-jax
# environment runs the whole suite too.
# shellcheck source=_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO_ROOT" || exit 1
workers="${PYTEST_WORKERS:-2}"
status=0

ensure_newest_jax_env
echo "=== [1/2] newest jax: $("$ENV_PYTHON" -c 'import jax; print(jax.__version__)')"
"$ENV_PYTHON" -m pytest -n "$workers" --dist worksteal -p no:cacheprovider \
  tests "$@" || status=1

ensure_env torch "$REPO_ROOT/requirements/torch-xla.txt"
echo "=== [2/2] torch_xla env, jax $("$ENV_PYTHON" -c 'import jax; print(jax.__version__)')"
tier=(-m compat)
for arg in "$@"; do [[ "$arg" == "--runslow" ]] && tier=(); done
PK_TEST_TIER="${tier[*]:+compat}" PJRT_DEVICE=CPU "$ENV_PYTHON" -m pytest \
  -n "$workers" --dist worksteal -p no:cacheprovider "${tier[@]}" tests "$@" \
  || status=1

if [[ $status -ne 0 ]]; then echo "FAILED in at least one environment"; fi
exit $status
