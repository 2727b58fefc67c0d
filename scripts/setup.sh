#!/usr/bin/env bash
# Create (or reuse) a venv with torch, torchvision and sartor installed editable. Sourced by the
# other scripts. torch 2.14.1 + torchvision 0.29.1 run on the CPU and on NVIDIA GPUs alike.
#
# Every package is installed at the version requirements.lock names: the versions the suite last
# passed with, so that a fresh machine gets what CI proved and not whatever was released this
# morning. With SARTOR_LATEST=1 (scripts/test.sh --latest) the venv is .venv-latest and nothing
# is pinned but torch: the newest releases pyproject.toml allows, to try an upgrade on purpose.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "${SARTOR_LATEST:-0}" = 1 ]; then
  venv=.venv-latest constraints=()
else
  venv=.venv constraints=(-c requirements.lock)
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
. "$venv/bin/activate"
# pip's wheel cache would hold a second copy of every downloaded wheel (about 1 GB beside a 6.4 GB
# venv); CI machines have run out of disk with it.
export PIP_NO_CACHE_DIR=1
if ! python -c "import torch, torchvision" >/dev/null 2>&1; then
  free_mb=$(df -Pm . | awk 'NR == 2 {print $4}')
  if [ "${free_mb:-0}" -lt 7500 ]; then
    echo "warning: ${free_mb} MB free here; torch, torchvision and the test dependencies need about 7,500 MB" >&2
  fi
  pip install -q "${constraints[@]}" torch==2.14.1 torchvision==0.29.1
fi
pip install -q "${constraints[@]}" -e ".[test]"
if [ "${SARTOR_LATEST:-0}" = 1 ]; then
  # What the newest releases changed against the lock; scripts/lock.sh adopts them once the suite passes.
  mkdir -p out
  pip freeze --exclude-editable | LC_ALL=C sort -f > out/latest-freeze.txt
  echo "newest allowed versions against requirements.lock (< lock, > latest):" >&2
  diff <(grep -v '^#' requirements.lock) out/latest-freeze.txt >&2 || true
fi
# Triton's perf_analyzer, for the serve test that runs it (that test skips without it).
bash scripts/install_perf_analyzer.sh || echo "warning: perf_analyzer is not installed; its serve test will skip" >&2
