#!/usr/bin/env bash
# Write requirements.lock from a venv whose suite passed: `bash scripts/lock.sh` (.venv) or
# `bash scripts/lock.sh .venv-latest` after `bash scripts/test.sh --latest` passed. Commit the
# result on its own, saying in the message which versions changed and that the suite passed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${1:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "lock: no venv at $venv (run scripts/test.sh first)" >&2
  exit 2
fi
{
  echo "# The exact versions the test suite last passed with (pip constraints). scripts/setup.sh installs"
  echo "# these; scripts/test.sh --latest tries the newest allowed ones; scripts/lock.sh rewrites this file."
  echo "# Python $("$venv/bin/python" -c 'import platform; print(platform.python_version(), platform.machine())')"
  "$venv/bin/python" -m pip freeze --exclude-editable | LC_ALL=C sort -f
} > requirements.lock.tmp
mv requirements.lock.tmp requirements.lock
git --no-pager diff --stat -- requirements.lock || true
