"""Shared fixtures: tiny ONNX models written with onnx.helper, and engines built from them."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

# Without a GPU, Triton kernels run in its interpreter; the variable must be set before anything
# imports triton, so it is set here, before the tests import sartor.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IMAGE = 16  # the tiny classifier's input height and width
CLASSES = 10
# The classifier's default profile: batch 1..4, opt 2.
MIN_SHAPES = {"images": (1, 3, IMAGE, IMAGE)}
OPT_SHAPES = {"images": (2, 3, IMAGE, IMAGE)}
MAX_SHAPES = {"images": (4, 3, IMAGE, IMAGE)}


def shape_flag(shapes: dict) -> str:
    """{"images": (1, 3, 16, 16)} → "images:1x3x16x16" (the CLI's syntax)."""
    return ",".join(f"{name}:{'x'.join(map(str, s))}" for name, s in shapes.items())


def _weight(rng: np.random.Generator, name: str, *shape: int) -> onnx.TensorProto:
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    data = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
    return numpy_helper.from_array(data, name)


def initializer_makers(rng: np.random.Generator):
    """(weight(name, *shape), bias(name, n)) drawing from `rng` in call order: weights scaled by
    1/sqrt(fan-in), biases by 0.1."""
    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return _weight(rng, name, *shape)

    def bias(name: str, n: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(n) * 0.1).astype(np.float32), name)
    return weight, bias


def make_model(nodes, inputs, outputs, initializers=(), name="tiny", opset=OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="sartor-tests")
    model.ir_version = 8
    return model


def classifier_model(seed: int = 0) -> onnx.ModelProto:
    """conv → relu → conv → add (residual) → global pool → flatten → gemm, dynamic batch."""
    rng = np.random.default_rng(seed)
    inits = [
        _weight(rng, "conv1.w", 8, 3, 3, 3), numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "conv1.b"),
        _weight(rng, "conv2.w", 8, 8, 3, 3), numpy_helper.from_array(rng.standard_normal(8).astype(np.float32) * 0.1, "conv2.b"),
        _weight(rng, "fc.w", CLASSES, 8), numpy_helper.from_array(rng.standard_normal(CLASSES).astype(np.float32) * 0.1, "fc.b"),
    ]
    nodes = [
        helper.make_node("Conv", ["images", "conv1.w", "conv1.b"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "conv2.w", "conv2.b"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s"], name="add"),
        helper.make_node("GlobalAveragePool", ["s"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten", axis=1),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], name="fc", transB=1),
    ]
    inputs = [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMAGE, IMAGE])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])]
    model = make_model(nodes, inputs, outputs, inits, name="tiny_classifier")
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="session", autouse=True)
def _private_kernel_cache(tmp_path_factory):
    """Engines' kernels install into a directory of the test session, not ~/.cache/sartor."""
    os.environ.setdefault("SARTOR_CACHE_DIR", str(tmp_path_factory.mktemp("sartor_cache")))


@pytest.fixture(scope="session")
def tiny_onnx(tmp_path_factory) -> Path:
    """The tiny classifier as an ONNX file (one per test session)."""
    return save(classifier_model(), tmp_path_factory.mktemp("models") / "tiny.onnx")


@pytest.fixture(scope="session")
def tiny_plan(tiny_onnx, tmp_path_factory) -> Path:
    """The tiny classifier built for the CPU, FP32, batch 1..4 (opt 2). Tests must not modify it:
    copy it first (see `plan_copy`)."""
    import sartor
    out = tmp_path_factory.mktemp("engines") / "tiny.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES)
    return out


@pytest.fixture(scope="session")
def letterbox_plan(tiny_onnx, tmp_path_factory) -> Path:
    """The tiny classifier with its preprocessing stored (letterbox to IMAGE, 0..1, RGB, NCHW): what
    the pipeline's image and video paths read frames for. Tests must not modify it."""
    import sartor
    out = tmp_path_factory.mktemp("engines") / "tiny_letterbox.plan"
    sartor.build(tiny_onnx, out, device="cpu", min_shapes=MIN_SHAPES, opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES,
                 preprocess=f"letterbox={IMAGE},mean=0,std=255,rgb,nchw")
    return out


@pytest.fixture
def plan_copy(tiny_plan, tmp_path) -> Path:
    """A private, writable copy of the tiny engine."""
    copy = tmp_path / "copy.plan"
    copy.write_bytes(tiny_plan.read_bytes())
    return copy


@pytest.fixture(scope="session")
def tiny_engine(tiny_plan):
    import sartor
    return sartor.load(tiny_plan, device="cpu")


@pytest.fixture
def images() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(OPT_SHAPES["images"]).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two outputs, flattened, in float64."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def gaussian_images(seed: int, count: int, size: int = IMAGE) -> np.ndarray:
    """Seeded standard-normal NCHW images: calibration sets and held-out test batches."""
    return np.random.default_rng(seed).standard_normal((count, 3, size, size)).astype(np.float32)


def first_output_on_cpu(plan: Path, images: np.ndarray) -> np.ndarray:
    """The first output of a CPU engine on `images` (the tiny models' input is "images")."""
    import sartor
    outputs = sartor.load(plan, device="cpu").context().run({"images": images})
    return next(iter(outputs.values()))


# ---- models that must be refused -----------------------------------------------------------------

def _io(name: str, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def checker_failing_model() -> onnx.ModelProto:
    """A Relu with two inputs: well-formed protobuf that the ONNX checker rejects."""
    model = make_model([helper.make_node("Relu", ["x", "x"], ["y"], name="relu_two_inputs")],
                       [_io("x", [1, 4])], [_io("y", [1, 4])], name="bad_checker")
    return model


def cyclic_model() -> onnx.ModelProto:
    """add_a reads relu_b's output and relu_b reads add_a's: a cycle."""
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="add_a"),
             helper.make_node("Relu", ["a"], ["b"], name="relu_b")]
    return make_model(nodes, [_io("x", [1, 4])], [_io("a", [1, 4])], name="cyclic")


# Float-in, float-out ops an inference compiler has little reason to implement (random ones first);
# the tests use the first two the registry lacks, so adding ops to sartor does not break them.
UNSUPPORTED_CANDIDATES = ("Bernoulli", "RandomUniformLike", "RandomNormalLike", "Shrink", "LpNormalization", "Det")


def unsupported_ops() -> tuple[str, str]:
    from sartor.ops import default_registry
    known = set(default_registry().onnx_op_types())
    missing = [op for op in UNSUPPORTED_CANDIDATES if op not in known]
    assert len(missing) >= 2, "every candidate op is supported now: add other candidates"
    return missing[0], missing[1]


def unsupported_model() -> onnx.ModelProto:
    """Two different ops sartor does not implement (and one it does, between them); the nodes are
    named after their op: `<op>_node`."""
    first, second = unsupported_ops()
    nodes = [helper.make_node(first, ["x"], ["u"], name=f"{first.lower()}_node"),
             helper.make_node("Relu", ["x"], ["r"], name="relu_ok"),
             helper.make_node(second, ["r"], ["s"], name=f"{second.lower()}_node")]
    model = make_model(nodes, [_io("x", [3, 3])], [_io("u", [] if first == "Det" else [3, 3]), _io("s", [] if second == "Det" else [3, 3])], name="unsupported")
    onnx.checker.check_model(model)
    return model


def two_input_model() -> onnx.ModelProto:
    """y = relu(a) * b, both inputs with a dynamic batch dim."""
    nodes = [helper.make_node("Relu", ["a"], ["r"], name="relu"), helper.make_node("Mul", ["r", "b"], ["y"], name="mul")]
    model = make_model(nodes, [_io("a", ["n", 4]), _io("b", ["n", 4])], [_io("y", ["n", 4])], name="two_inputs")
    onnx.checker.check_model(model)
    return model


# ---- the command line, in process ----------------------------------------------------------------

class CliResult:
    def __init__(self, code: int, out: str, err: str) -> None:
        self.code, self.out, self.err = code, out, err

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith(("error:", "internal error:"))]

    def __repr__(self) -> str:
        return f"CliResult(code={self.code}, out={self.out[-2000:]!r}, err={self.err[-2000:]!r})"


@pytest.fixture
def cli(capsys):
    """cli("build", model, "-o", out) → CliResult(code, out, err), running sartor.cli.main in process."""
    from sartor.cli.main import main

    def invoke(*argv) -> CliResult:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)
    return invoke


def assert_cli_error(result: CliResult, *fragments: str) -> str:
    """Exit 2, exactly one `error:` line on stderr (its last line), no traceback; returns the message."""
    assert result.code == 2, result
    assert len(result.error_lines) == 1, result
    line = result.error_lines[0]
    assert result.err.rstrip("\n").splitlines()[-1] == line, result
    assert "Traceback" not in result.err, result
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def save_photos(folder: Path, names: list[str]) -> Path:
    """scikit-image's photos `names` as RGB JPEGs (quality 90) in `folder`: real images, shipped in
    a package, for the tests that run folders of files (sartor infer, Ray Data)."""
    from PIL import Image
    from skimage import data as skimage_data
    for name in names:
        pixels = getattr(skimage_data, name)()
        if pixels.ndim == 2:
            pixels = np.stack([pixels] * 3, axis=-1)
        Image.fromarray(pixels[..., :3]).save(folder / f"{name}.jpg", quality=90)
    return folder


@pytest.fixture(scope="module")
def local_ray():
    """A Ray of this process on 2 CPUs, quiet, for a test module; skips without Ray."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()
