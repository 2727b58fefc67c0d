#!/usr/bin/env bash
# Install Triton's load generator perf_analyzer into .cache/perf_analyzer/ and link it into .venv/bin.
#
# PyPI's `perf-analyzer` package is an empty placeholder. The binary itself ships in the Linux x86_64
# wheels of tritonclient up to 2.41 (bin/perf_analyzer); it needs libb64 (Debian's libb64-0d) and
# libcudart.so.12 (PyPI's nvidia-cuda-runtime-cu12), even with shared memory off, because it is
# linked against them. All three are unpacked next to the binary rather than installed, so that the
# installed tritonclient (the newer Python client the tests use) stays as it is, and so that the one
# folder can be copied to a machine without internet (bench/serve_throughput.py looks there).
#
# Usage: bash scripts/install_perf_analyzer.sh   (idempotent; exit 1 with one line when it cannot)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TRITONCLIENT_VERSION=2.41.1
DEST=.cache/perf_analyzer
STAMP="$DEST/VERSION"
if [ "$(uname -sm)" != "Linux x86_64" ]; then
  echo "perf_analyzer: only Linux x86_64 wheels ship it; not installed" >&2
  exit 1
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

if [ "$(cat "$STAMP" 2>/dev/null)" != "$TRITONCLIENT_VERSION" ] || ! "$DEST/perf_analyzer" --version >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
      -d "$work" "tritonclient==$TRITONCLIENT_VERSION"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      -d "$work" "nvidia-cuda-runtime-cu12>=12.0,<13"
  # apt-get download needs no root, only the package lists; refresh them once when they are missing.
  if ! (cd "$work" && apt-get download -q libb64-0d >/dev/null 2>&1); then
    apt-get update -q >/dev/null 2>&1 || true
    (cd "$work" && apt-get download -q libb64-0d >/dev/null)
  fi
  rm -rf "$DEST.new" && mkdir -p "$DEST.new/bin" "$DEST.new/lib"
  dpkg-deb -x "$work"/libb64-0d_*.deb "$work/b64"
  cp -L "$work"/b64/usr/lib/x86_64-linux-gnu/libb64.so.0d "$DEST.new/lib/"
  "$PY" - "$work" "$DEST.new" <<'EOF'
import glob, os, sys, zipfile
work, dest = sys.argv[1], sys.argv[2]
wanted = {"tritonclient": ("/bin/perf_analyzer", "bin/perf_analyzer"),
          "nvidia_cuda_runtime": ("/lib/libcudart.so.12", "lib/libcudart.so.12")}
for prefix, (suffix, target) in wanted.items():
    (wheel,) = glob.glob(os.path.join(work, prefix + "*.whl"))
    with zipfile.ZipFile(wheel) as z:
        (member,) = [n for n in z.namelist() if n.endswith(suffix)]
        with open(os.path.join(dest, target), "wb") as out:
            out.write(z.read(member))
os.chmod(os.path.join(dest, "bin/perf_analyzer"), 0o755)
EOF
  cat > "$DEST.new/perf_analyzer" <<'EOF'
#!/usr/bin/env bash
# perf_analyzer with the libraries unpacked beside it (see scripts/install_perf_analyzer.sh).
here="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$here/bin/perf_analyzer" "$@"
EOF
  chmod +x "$DEST.new/perf_analyzer"
  echo "$TRITONCLIENT_VERSION" > "$DEST.new/VERSION"
  if ! "$DEST.new/perf_analyzer" --version >/dev/null 2>&1; then
    echo "perf_analyzer: unpacked but it does not start: $("$DEST.new/perf_analyzer" --version 2>&1 | head -1)" >&2
    exit 1
  fi
  rm -rf "$DEST" && mv "$DEST.new" "$DEST"
fi
if [ -d .venv/bin ]; then
  ln -sfn "$(pwd)/$DEST/perf_analyzer" .venv/bin/perf_analyzer
fi
"$DEST/perf_analyzer" --version | head -1
