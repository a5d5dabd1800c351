#!/usr/bin/env bash
# Builds the user guide (docs/, mkdocs.yml) as a static site under build/site.
# Installs the newest-jax environment (which holds mkdocs) on first use.
# shellcheck source=_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$REPO_ROOT" || exit 1
ensure_newest_jax_env
"$ENV_PYTHON" -m mkdocs build --strict --site-dir build/site "$@"
echo "the guide: $REPO_ROOT/build/site/index.html"
