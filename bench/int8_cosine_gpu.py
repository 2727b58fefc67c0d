"""bench/int8_cosine.py's INT8 engines rebuilt on a GPU from the CPU run's files (issue 4): the
same exported model and calibration cache (so the same scales), scored on the same evaluation
crops against ONNX Runtime FP32, and compared with the CPU engine's outputs.

    # on the CPU (scikit-image photos, Ultralytics export, calibration):
    PYTHONPATH=. python bench/int8_cosine.py --out DIR --models yolov8n --methods mse --calib 128 --test 16
    # on the GPU machine, with DIR carried (no photos, no Ultralytics, no calibration needed there):
    PYTHONPATH=. python bench/int8_cosine_gpu.py --from DIR --out OUT --models yolov8n --methods mse

Per model and method: cosine (over all outputs, per sample mean/min, and for YOLOv8n the centred
box and class cosines, as int8_cosine.py reports them) of the GPU engine against ONNX Runtime FP32,
the same for the CPU engine's saved outputs, and the GPU engine against the CPU engine. The
reference here is ONNX Runtime (CPU) rather than a sartor FP32 engine: the device machine has it,
and it is the reference the rest of the benchmarks use. Writes results.json under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sartor  # noqa: E402
from int8_cosine import cosine, measures, model_io, normalise, run  # noqa: E402  (the benches' own folder is on sys.path)


def onnxruntime_outputs(onnx_path: Path, name: str, x: np.ndarray, batch: int) -> np.ndarray:
    import onnxruntime
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {name: x[k:k + batch]})[0] for k in range(0, len(x), batch)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--from", dest="source", required=True, help="bench/int8_cosine.py's --out directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="yolov8n")
    parser.add_argument("--methods", default="mse")
    parser.add_argument("--yolo-size", type=int, default=320)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--effort", type=int, default=1)
    args = parser.parse_args()
    source, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": args.device, "rows": []}
    for model in args.models.split(","):
        file_name, name, size, spec = model_io(model, args.yolo_size)
        onnx_path = source / file_name
        test = normalise(np.load(source / f"{model}_test_crops.npy"), model)
        ref = onnxruntime_outputs(onnx_path, name, test, args.batch)
        profile = {"min": {name: (1, 3, size, size)}, "opt": {name: (args.batch, 3, size, size)},
                   "max": {name: (args.batch, 3, size, size)}}
        for method in args.methods.split(","):
            plan = out / f"{model}_int8_{method}_{args.device.split(':')[0]}.plan"
            started = time.perf_counter()
            result = sartor.build(onnx_path, plan, precision="int8", calib_method=method,
                                  calib_cache=source / f"{model}_{method}.calib.json", device=args.device,
                                  profiles=[profile], preprocess=spec, builder_effort=args.effort)
            build_s = time.perf_counter() - started
            got = run(plan, name, test, args.batch)
            cpu = np.load(source / f"{model}_int8_{method}.output.npy")
            row = dict(model=model, size=size, method=method, device=args.device, build_s=round(build_s, 1),
                       int8_layers=sum(layer["precision"] == "int8" for layer in result.header["layers"]),
                       gpu_vs_onnxruntime=measures(model, ref, got), cpu_vs_onnxruntime=measures(model, ref, cpu),
                       gpu_vs_cpu={"cosine": cosine(cpu, got), "max_abs_diff": float(np.abs(cpu - got).max()),
                                   "max_abs": float(np.abs(cpu).max()),
                                   "elements_differing": int((cpu != got).sum()), "elements": int(cpu.size)})
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
