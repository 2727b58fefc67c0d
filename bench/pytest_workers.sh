# Sourced by the device scripts: with .whl/xdist carried (scripts/device_carry.sh xdist), unpacks pytest-xdist
# and execnet onto PYTHONPATH and sets `workers` to pytest's arguments for $1 processes; else `workers` is empty
# and the tests run in one process. Compiling each test's kernels is most of a GPU test run's time.
#   . bench/pytest_workers.sh 8; python -m pytest "${workers[@]}" ...
workers=()
if ls .whl/xdist/*.whl >/dev/null 2>&1; then
  _xdist_site=$(mktemp -d)
  for _wheel in .whl/xdist/*.whl; do python -m zipfile -e "$_wheel" "$_xdist_site"; done
  export PYTHONPATH="${PYTHONPATH:-.}:$_xdist_site"
  workers=(-n "${1:-8}")
fi
