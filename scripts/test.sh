#!/usr/bin/env bash
# Set up and run the whole test suite (CPU only; Triton kernels run in its interpreter).
#   bash scripts/test.sh [pytest args]            the versions of requirements.lock, in .venv (what CI runs)
#   bash scripts/test.sh --latest [pytest args]   the newest versions pyproject.toml allows, in .venv-latest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "${1:-}" = --latest ]; then
  shift
  export SARTOR_LATEST=1
fi
. scripts/setup.sh
python -m pytest -q -p no:cacheprovider "$@"
