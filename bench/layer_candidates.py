"""Every candidate the builder timed for one convolution shape, FP16 and INT8 side by side (issue 33:
the sample detector's INT8 falls short of 1.4× FP16 in its 3×3 layers of 24 and 40 channels).

The convolution (3×3 by default, SiLU after it, as in the detector's blocks) is built inside a small
ONNX graph at each precision, so it reads and writes the precision's own activations as it does in
the network, in one of two places:
- `chain`: the middle of three such convolutions (its input a whole tensor of C channels);
- `c2f`: the first 3×3 of a C2f block's bottleneck: a 1×1 convolution to 2C channels, Split in
  halves, the second half through two 3×3 convolutions and added back, the three concatenated and
  a 1×1, and one more layer after the block (the detector's worst INT8 layers read such a half: a
  channel slice of INT8 codes, pixels 2C apart).
Calibration is random input (a kernel's speed does not depend on its scales). Printed: the layer's
timed candidates, fastest first, each precision's winner and the INT8 / FP16 ratio of the winners.

A third context, `stem`, is a detector's first layer reading the graph's float image at stride 2
(`--shape 32x3x640x640 --context stem`: YOLO's stem at batch 32).

    PYTHONPATH=. python bench/layer_candidates.py --shape 32x40x40x40 [--shape 32x24x80x80] [--context chain,c2f]"""
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

TIMED_LAYER = "timed"  # the convolution whose candidates are printed


class Graph:
    def __init__(self) -> None:
        self.nodes, self.inits = [], []
        self.rng = np.random.default_rng(0)

    def conv_silu(self, name: str, x: str, cin: int, cout: int, kernel: int, stride: int = 1) -> str:
        w = self.rng.standard_normal((cout, cin, kernel, kernel)) / np.sqrt(cin * kernel * kernel)
        self.inits += [numpy_helper.from_array(w.astype(np.float32), f"{name}.w"),
                       numpy_helper.from_array(self.rng.standard_normal(cout).astype(np.float32) * 0.1, f"{name}.b")]
        self.nodes += [helper.make_node("Conv", [x, f"{name}.w", f"{name}.b"], [f"{name}.c"], name=name,
                                        kernel_shape=[kernel, kernel], pads=[kernel // 2] * 4,
                                        strides=[stride, stride]),
                       helper.make_node("Sigmoid", [f"{name}.c"], [f"{name}.s"], name=f"{name}.sigmoid"),
                       helper.make_node("Mul", [f"{name}.c", f"{name}.s"], [f"{name}.y"], name=f"{name}.silu")]
        return f"{name}.y"

    def model(self, cin: int, out: str, cout: int) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "layer_candidates",
                                  [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", cin, "h", "w"])],
                                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["n", cout, "h", "w"])],
                                  self.inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_chain(channels: int, kernel: int, hidden: int | None = None) -> onnx.ModelProto:
    """Three convolutions of C channels (`hidden` is the c2f block's alone)."""
    g = Graph()
    y = g.conv_silu("first", "input", channels, channels, kernel)
    y = g.conv_silu(TIMED_LAYER, y, channels, channels, kernel)
    return g.model(channels, g.conv_silu("last", y, channels, channels, kernel), channels)


def c2f_block(channels: int, kernel: int, hidden: int | None = None) -> onnx.ModelProto:
    """The graph's input has 2C channels; the timed layer reads the second half of a Split and
    writes `hidden` channels (C by default; YOLO11n's C3k2 bottlenecks halve them: 16 → 8 → 16)."""
    hidden = hidden or channels
    g = Graph()
    y = g.conv_silu("cv1", "input", 2 * channels, 2 * channels, 1)
    g.inits.append(numpy_helper.from_array(np.array([channels, channels], dtype=np.int64), "halves"))
    g.nodes.append(helper.make_node("Split", [y, "halves"], ["a", "b"], name="split", axis=1))
    m = g.conv_silu(TIMED_LAYER, "b", channels, hidden, kernel)
    m = g.conv_silu("m.cv2", m, hidden, channels, kernel)
    g.nodes += [helper.make_node("Add", ["b", m], ["m.out"], name="m.add"),
                helper.make_node("Concat", ["a", "b", "m.out"], ["cat"], name="concat", axis=1)]
    y = g.conv_silu("cv2", "cat", 3 * channels, 2 * channels, 1)
    # A last layer after the block, so that cv2 is no output head (kept out of INT8) and the block's
    # Split and Concat stay INT8, as inside the detector.
    return g.model(2 * channels, g.conv_silu("next", y, 2 * channels, 2 * channels, 1), 2 * channels)


def stem(channels: int, kernel: int, hidden: int | None = None) -> onnx.ModelProto:
    """A detector's first layer: the graph's float image of C channels into `hidden` (16 by default)
    at stride 2, as YOLO's 3 → 16, then one more layer so that it is no output head."""
    hidden = hidden or 16
    g = Graph()
    y = g.conv_silu(TIMED_LAYER, "input", channels, hidden, kernel, stride=2)
    return g.model(channels, g.conv_silu("next", y, hidden, hidden, kernel), hidden)


CONTEXTS = {"chain": conv_chain, "c2f": c2f_block, "stem": stem}


def timed_layer(result) -> dict:
    return next((layer for layer in result.header["layers"] if layer["name"] == TIMED_LAYER), {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", required=True, help="NxCxHxW")
    parser.add_argument("--kernel", type=int, default=3)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--effort", type=int, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", default="chain", help="chain, c2f or stem, or several (comma-separated)")
    parser.add_argument("--precisions", default="fp16,int8")
    parser.add_argument("--hidden", type=int, default=None,
                        help="c2f: the channels the timed layer writes (its bottleneck's inner width; C by "
                             "default); stem: its output channels (16 by default)")
    parser.add_argument("--unaligned", action="store_true",
                        help="the implicit-GEMM kernel given its input's and residual's own pointers, as "
                             "before aligned_start (decision 0061): that change's A/B")
    args = parser.parse_args()
    if args.unaligned:
        from sartor.kernels.conv import igemm
        igemm.aligned_start = lambda x4: (x4, 0)
    work = Path(tempfile.mkdtemp(prefix="layer_candidates_"))
    for spec, context in ((s, c) for s in args.shape for c in args.context.split(",")):
        half = tuple(int(v) for v in spec.split("x"))
        shape = half if context in ("chain", "stem") else (half[0], 2 * half[1]) + half[2:]
        spec = f"{spec} {context}"
        model = work / f"{context}_{half[1]}.onnx"
        onnx.save(CONTEXTS[context](half[1], args.kernel, args.hidden), model)
        np.save(work / "calib.npy", np.random.default_rng(1).standard_normal((16,) + shape[1:]).astype(np.float32))
        best = {}
        for precision in args.precisions.split(","):
            calib = {"calib": str(work / "calib.npy"), "calib_size": 16} if precision == "int8" else {}
            try:
                plan = work / f"{context}_{half[1]}_{precision}.plan"
                result = sartor.build(str(model), str(plan), device=args.device,
                                      precision=precision, min_shapes={"input": shape}, opt_shapes={"input": shape},
                                      max_shapes={"input": shape}, builder_effort=args.effort, **calib)
            except Exception as exc:  # noqa: BLE001 - the other builds are still worth timing
                print(f"== {spec} {args.kernel}x{args.kernel} {precision}: failed: {type(exc).__name__}: {exc}")
                continue
            layer = timed_layer(result)
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
