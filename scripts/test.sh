#!/usr/bin/env bash
# Set up and run the whole test suite (CPU only; Triton kernels run in its interpreter).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m pytest -q -p no:cacheprovider "$@"
