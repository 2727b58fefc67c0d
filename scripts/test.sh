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
# Two test processes (pytest-xdist): most tests hold one core (Triton's interpreter, Python), and
# CI has two. SARTOR_TEST_WORKERS=0 runs them in this process; more, on a bigger machine.
python -m pytest -q -p no:cacheprovider -n "${SARTOR_TEST_WORKERS:-2}" "$@"
