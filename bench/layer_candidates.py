"""Every candidate the builder timed for one convolution shape, FP16 and INT8 side by side (issue 33:
the sample detector's INT8 falls short of 1.4× FP16 in its 3×3 layers of 24 and 40 channels).

A chain of three identical convolutions (3×3 by default, SiLU after each, as in the detector's
blocks) is written as ONNX and built at each precision, so the middle one reads and writes the
precision's own activations as it does inside the network. Calibration is random input (a kernel's
speed does not depend on its scales). Printed: the middle layer's timed candidates, fastest first,
and each precision's winner, with the INT8 / FP16 ratio of the winners.

    PYTHONPATH=. python bench/layer_candidates.py --shape 32x40x40x40 [--shape 32x24x80x80] [--rows 12]"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sartor  # noqa: E402

LAYERS = 3


def conv_chain(channels: int, kernel: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, name = [], [], "input"
    for k in range(LAYERS):
        w = (rng.standard_normal((channels, channels, kernel, kernel)) / np.sqrt(channels * kernel * kernel))
        inits += [numpy_helper.from_array(w.astype(np.float32), f"w{k}"),
                  numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32) * 0.1, f"b{k}")]
        nodes += [helper.make_node("Conv", [name, f"w{k}", f"b{k}"], [f"c{k}"], name=f"conv{k}",
                                   kernel_shape=[kernel, kernel], pads=[kernel // 2] * 4),
                  helper.make_node("Sigmoid", [f"c{k}"], [f"s{k}"], name=f"sigmoid{k}"),
                  helper.make_node("Mul", [f"c{k}", f"s{k}"], [f"y{k}"], name=f"silu{k}")]
        name = f"y{k}"
    graph = helper.make_graph(nodes, "conv_chain",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", channels, "h", "w"])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", channels, "h", "w"])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def middle_layer(result) -> dict:
    convs = [layer for layer in result.header["layers"] if "conv1" in layer["name"]]
    return convs[0] if convs else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", required=True, help="NxCxHxW")
    parser.add_argument("--kernel", type=int, default=3)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--effort", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="layer_candidates_"))
    for spec in args.shape:
        shape = tuple(int(v) for v in spec.split("x"))
        model = work / f"chain_{spec}.onnx"
        onnx.save(conv_chain(shape[1], args.kernel), model)
        np.save(work / "calib.npy", np.random.default_rng(1).standard_normal((16,) + shape[1:]).astype(np.float32))
        best = {}
        for precision in ("fp16", "int8"):
            calib = {"calib": str(work / "calib.npy"), "calib_size": 16} if precision == "int8" else {}
            try:
                result = sartor.build(str(model), str(work / f"{spec}_{precision}.plan"), device=args.device,
                                      precision=precision, min_shapes={"input": shape}, opt_shapes={"input": shape},
                                      max_shapes={"input": shape}, builder_effort=args.effort, **calib)
            except Exception as exc:  # noqa: BLE001 - the other builds are still worth timing
                print(f"== {spec} {args.kernel}x{args.kernel} {precision}: failed: {type(exc).__name__}: {exc}")
                continue
            layer = middle_layer(result)
            timings = sorted((layer.get("tactic_timings_ms") or {}).items(), key=lambda kv: kv[1])
            print(f"== {spec} {args.kernel}x{args.kernel} {precision}: {layer.get('name')} chose "
                  f"{layer.get('tactic')}; {len(timings)} timed")
            for tactic, ms in timings[:args.rows]:
                print(f"  {ms:8.4f}  {tactic}")
            for tactic, why in list((layer.get("tactic_rejected") or {}).items())[:4]:
                print(f"  rejected {tactic}: {str(why)[:120]}")
            if timings:
                best[precision] = timings[0][1]
        if len(best) == 2:
            print(f"== {spec}: INT8 / FP16 speed {best['fp16'] / best['int8']:.2f}x "
                  f"({best['fp16']:.4f} / {best['int8']:.4f} ms)", flush=True)


if __name__ == "__main__":
    main()
