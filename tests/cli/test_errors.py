"""Every bad input a user can give is refused with one line (a SartorError; exit 2 from the CLI),
and no partial file is left under the output name."""
from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, assert_cli_error, checker_failing_model, classifier_model,
                      cyclic_model, save, shape_flag, unsupported_model, unsupported_ops)

import sartor
from sartor.errors import (ConfigError, DeviceError, EngineFileError, FingerprintMismatchError, GraphError, InputError,
                           ModelLoadError, OutputPathError, ProfileError, SartorError, UnsupportedModelError)
from sartor.runtime.engine_file import FORMAT_VERSION, MAGIC, pack, unpack

SHAPE_ARGS = ["--min-shapes", shape_flag(MIN_SHAPES), "--opt-shapes", shape_flag(OPT_SHAPES),
              "--max-shapes", shape_flag(MAX_SHAPES)]


def one_line(exc_info, cls, *fragments) -> str:
    """The error is exactly `cls`, its message one line and holding every fragment."""
    exc = exc_info.value
    assert type(exc) is cls, f"{type(exc).__name__}: {exc}"
    message = str(exc)
    assert "\n" not in message and message.strip() == message and message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.fixture
def out_dir(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


def assert_nothing_written(directory: Path) -> None:
    """No engine and no temporary file beside where it would have been."""
    assert sorted(p.name for p in directory.iterdir()) == []


# ---- bad models: the API raises one class, the CLI exits 2, nothing is written --------------------

def _truncated(path: Path, tiny: Path) -> None:
    data = tiny.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _text(path: Path, tiny: Path) -> None:
    path.write_text("this is a README, not a model\n" * 20)


def _empty(path: Path, tiny: Path) -> None:
    path.write_bytes(b"")


def _engine_as_model(path: Path, tiny: Path) -> None:
    path.write_bytes(MAGIC + b"\x00" * 64)


BAD_MODELS = {
    "truncated": (_truncated, ModelLoadError, ["bad.onnx", "not a readable ONNX model"]),
    "text file": (_text, ModelLoadError, ["bad.onnx", "not a readable ONNX model"]),
    "empty file": (_empty, ModelLoadError, ["bad.onnx", "is empty"]),
    "engine bytes": (_engine_as_model, ModelLoadError, ["bad.onnx", "not"]),
    "checker": (lambda p, t: save(checker_failing_model(), p), ModelLoadError,
                ["fails the ONNX checker", "relu_two_inputs", "input size 2"]),
    "cycle": (lambda p, t: save(cyclic_model(), p), GraphError, ["cycle", "add_a", "relu_b"]),
    "unsupported ops": (lambda p, t: save(unsupported_model(), p), UnsupportedModelError,
                        ["2 unsupported"] + [f"{op.lower()}_node ({op})" for op in unsupported_ops()]),
}


@pytest.mark.parametrize("case", list(BAD_MODELS))
def test_bad_model_is_refused_in_one_line(case, tmp_path, out_dir, tiny_onnx, cli):
    write, cls, fragments = BAD_MODELS[case]
    model = tmp_path / "bad.onnx"
    write(model, tiny_onnx)
    with pytest.raises(cls) as info:
        sartor.build(model, out_dir / "model.plan", device="cpu", opt_shapes=OPT_SHAPES)
    one_line(info, cls, *fragments)
    assert_nothing_written(out_dir)
    assert_cli_error(cli("build", model, "-o", out_dir / "model.plan", "--device", "cpu",
                         "--opt-shapes", shape_flag(OPT_SHAPES)), *fragments)
    assert_nothing_written(out_dir)


def test_unsupported_ops_are_all_listed_at_once(tmp_path):
    first, second = unsupported_ops()
    assert first != second
    model = save(unsupported_model(), tmp_path / "two.onnx")
    with pytest.raises(UnsupportedModelError) as info:
        sartor.build(model, tmp_path / "two.plan", device="cpu")
    message = one_line(info, UnsupportedModelError)
    assert f"({first})" in message and f"({second})" in message
    assert "relu_ok" not in message  # supported nodes are not listed


def test_missing_model_file(out_dir, cli):
    with pytest.raises(ModelLoadError) as info:
        sartor.build(out_dir.parent / "nope.onnx", out_dir / "x.plan", device="cpu")
    one_line(info, ModelLoadError, "model file not found", "nope.onnx")
    assert_nothing_written(out_dir)


# ---- bad build options --------------------------------------------------------------------------

def test_opt_outside_min_max(tiny_onnx, out_dir, cli):
    kwargs = dict(min_shapes={"images": (2, 3, 16, 16)}, opt_shapes={"images": (1, 3, 16, 16)},
                  max_shapes={"images": (4, 3, 16, 16)})
    with pytest.raises(ProfileError) as info:
        sartor.build(tiny_onnx, out_dir / "x.plan", device="cpu", **kwargs)
    one_line(info, ProfileError, "'images'", "opt shape 1x3x16x16", "min 2x3x16x16", "max 4x3x16x16")
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cpu",
                         "--min-shapes", "images:2x3x16x16", "--opt-shapes", "images:1x3x16x16",
                         "--max-shapes", "images:4x3x16x16"), "opt shape 1x3x16x16 is not within")
    assert_nothing_written(out_dir)


def test_dynamic_input_without_shapes(tiny_onnx, out_dir, cli):
    with pytest.raises(ProfileError) as info:
        sartor.build(tiny_onnx, out_dir / "x.plan", device="cpu")
    one_line(info, ProfileError, "'images'", "dynamic shape batchx3x16x16", "--min-shapes")
    assert_nothing_written(out_dir)


def test_shapes_for_unknown_input_and_bad_syntax(tiny_onnx, out_dir, cli):
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cpu",
                         "--opt-shapes", "imgs:2x3x16x16"), "unknown input(s) imgs", "model inputs: images")
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cpu",
                         "--opt-shapes", "images=2x3x16x16"), "must look like NAME:1x3x224x224")
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cpu",
                         "--opt-shapes", "images:2x3x16"), "opt shape 2x3x16 does not fit", "batchx3x16x16")
    assert_nothing_written(out_dir)


def test_bad_precision_override(tiny_onnx, out_dir, cli):
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cpu", *SHAPE_ARGS,
                         "--layer-precision", "conv1=fp64"), "--layer-precision conv1=fp64", "must be one of")
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cpu", *SHAPE_ARGS,
                         "--op-precision", "Conv"), "--op-precision 'Conv' must look like NAME=fp32")
    assert_nothing_written(out_dir)


def test_unknown_device(tiny_onnx, out_dir, cli):
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "tpu", *SHAPE_ARGS),
                     "'tpu'", "use cpu or cuda")
    if not torch.cuda.is_available():
        assert_cli_error(cli("build", tiny_onnx, "-o", out_dir / "x.plan", "--device", "cuda", *SHAPE_ARGS),
                         "no CUDA GPU is available")
    assert_nothing_written(out_dir)


def test_output_is_the_model_itself(tmp_path, cli):
    model = save(classifier_model(), tmp_path / "m.onnx")
    before = model.read_bytes()
    assert_cli_error(cli("build", model, "-o", model, "--device", "cpu", *SHAPE_ARGS), "is the model file itself")
    assert model.read_bytes() == before


# ---- unwritable outputs ----------------------------------------------------------------------------

def test_output_in_missing_directory(tiny_onnx, tmp_path, cli):
    target = tmp_path / "no" / "such" / "dir" / "x.plan"
    with pytest.raises(OutputPathError) as info:
        sartor.build(tiny_onnx, target, device="cpu", opt_shapes=OPT_SHAPES)
    one_line(info, OutputPathError, str(target), "does not exist")
    assert_cli_error(cli("build", tiny_onnx, "-o", target, "--device", "cpu", *SHAPE_ARGS), "does not exist")
    assert not (tmp_path / "no").exists()


def test_output_under_a_regular_file(tiny_onnx, tmp_path, cli):
    # Tests run as root, for whom no directory is read-only: a path below a FILE fails for anyone.
    blocker = tmp_path / "somefile"
    blocker.write_text("not a directory")
    target = blocker / "out.plan"
    with pytest.raises(OutputPathError) as info:
        sartor.build(tiny_onnx, target, device="cpu", opt_shapes=OPT_SHAPES)
    one_line(info, OutputPathError, str(target), "is a file, not a directory")
    assert_cli_error(cli("build", tiny_onnx, "-o", target, "--device", "cpu", *SHAPE_ARGS), "is a file")
    assert blocker.read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somefile"]


def test_output_is_a_directory(tiny_onnx, out_dir, cli):
    assert_cli_error(cli("build", tiny_onnx, "-o", out_dir, "--device", "cpu", *SHAPE_ARGS), "it is a directory")
    assert_nothing_written(out_dir)


def test_run_output_unwritable_fails_before_running(tiny_plan, tmp_path, cli):
    blocker = tmp_path / "somefile"
    blocker.write_text("x")
    result = cli("run", tiny_plan, "--output", blocker / "out.npz")
    assert_cli_error(result, "out.npz", "is a file, not a directory")
    assert "Outputs" not in result.out


# ---- bad inputs at run time -----------------------------------------------------------------------

@pytest.fixture
def ctx(tiny_engine):
    return tiny_engine.context()


def test_wrong_input_name(ctx, images, tmp_path, tiny_plan, cli):
    with pytest.raises(InputError) as info:
        ctx.run({"image": images})
    one_line(info, InputError, "unknown input name(s) image", "inputs are images")
    np.save(tmp_path / "x.npy", images)
    assert_cli_error(cli("run", tiny_plan, "--input", f"image={tmp_path / 'x.npy'}"), "unknown input name(s) image")


def test_missing_input(ctx):
    with pytest.raises(InputError) as info:
        ctx.run({})
    one_line(info, InputError, "missing input(s) images")


def test_wrong_rank(ctx, images, tmp_path, tiny_plan, cli):
    with pytest.raises(InputError) as info:
        ctx.run({"images": images[0]})
    one_line(info, InputError, "'images'", "rank 3", "3x16x16", "expects rank 4")
    np.save(tmp_path / "x.npy", images[0])
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'x.npy'}"), "rank 3")


def test_wrong_dtype(ctx, images, tmp_path, tiny_plan, cli):
    with pytest.raises(InputError) as info:
        ctx.run({"images": images.astype(np.float64)})
    one_line(info, InputError, "'images'", "dtype float64", "expects float32")
    with pytest.raises(InputError) as info:
        ctx.run({"images": torch.from_numpy(images).half()})
    one_line(info, InputError, "dtype float16")
    with pytest.raises(InputError) as info:
        ctx.run({"images": images.tolist()})
    one_line(info, InputError, "numpy array or torch tensor", "list")
    np.save(tmp_path / "x.npy", images.astype(np.int64))
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'x.npy'}"), "dtype int64")


@pytest.mark.parametrize("shape", [(8, 3, 16, 16), (2, 3, 17, 16), (2, 1, 16, 16)])
def test_shape_outside_every_profile(ctx, tiny_plan, tmp_path, cli, shape):
    text = "x".join(map(str, shape))
    with pytest.raises(ProfileError) as info:
        ctx.run({"images": np.zeros(shape, np.float32)})
    one_line(info, ProfileError, f"images {text}", "outside the allowed ranges",
             "profile 0: images 1x3x16x16..4x3x16x16 (opt 2x3x16x16)")
    np.save(tmp_path / "x.npy", np.zeros(shape, np.float32))
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'x.npy'}"), f"images {text}",
                     "1x3x16x16..4x3x16x16")


def test_bad_input_files(tiny_plan, tmp_path, cli):
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'none.npy'}"), "file not found")
    (tmp_path / "text.npy").write_text("not numpy")
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'text.npy'}"), "not a .npy/.npz")
    with open(tmp_path / "obj.npy", "wb") as handle:
        np.save(handle, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'obj.npy'}"), "not a .npy/.npz")
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 16, 16), np.float32))
    assert_cli_error(cli("run", tiny_plan, "--input", f"images={tmp_path / 'x.npy'}",
                         "--input", f"images={tmp_path / 'x.npy'}"), "given twice")


def test_profile_index_out_of_range(tiny_engine):
    with pytest.raises(ProfileError) as info:
        tiny_engine.context(profile=1)
    one_line(info, ProfileError, "profile 1 does not exist", "1 profile(s)")


# ---- bad engine files: load (run/compare/bench) and inspect refuse them, one line --------------------

def _with_checksum(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def _other_version(data: bytes) -> bytes:
    body = bytearray(data[:-32])
    struct.pack_into("<I", body, len(MAGIC), FORMAT_VERSION + 1)
    return _with_checksum(bytes(body))


def _flip_weight_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(data) - 100] ^= 0x01  # inside the weights
    return bytes(flipped)


def _flip_header_byte(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(MAGIC) + 12 + 40] ^= 0x20  # inside the JSON header
    return bytes(flipped)


def _pickle(data: bytes) -> bytes:
    return pickle.dumps({"weights": np.zeros(4)})


def _torch_save(data: bytes) -> bytes:
    import io
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buffer)
    return buffer.getvalue()


BAD_ENGINES = {
    "truncated half": (lambda d: d[: len(d) // 2], ["truncated (", " bytes"]),
    "truncated to 10 bytes": (lambda d: d[:10], ["truncated (10 bytes)"]),
    "digest cut off": (lambda d: d[:-1], ["truncated"]),
    "empty": (lambda d: b"", ["is empty"]),
    "trailing bytes": (lambda d: d + b"\x00\x00", ["2 unexpected trailing bytes"]),
    "weight byte flipped": (_flip_weight_byte, ["integrity check", "SHA-256"]),
    "header byte flipped": (_flip_header_byte, ["integrity check"]),
    "other format version": (_other_version, [f"format version {FORMAT_VERSION + 1}", f"reads version {FORMAT_VERSION}",
                                              "rebuild"]),
    "pickle": (_pickle, ["pickle", "never unpickles"]),
    "torch.save zip": (_torch_save, ["pickle/zip"]),
    "onnx file": (lambda d: classifier_model().SerializeToString(), ["not a sartor engine (bad magic)"]),
}


@pytest.mark.parametrize("case", list(BAD_ENGINES))
def test_bad_engine_file_is_refused(case, tiny_plan, tmp_path, cli):
    corrupt, fragments = BAD_ENGINES[case]
    data = tiny_plan.read_bytes()
    fragments = [f.replace("{size}", str(len(data))) for f in fragments]
    bad = tmp_path / "bad.plan"  # a pickle renamed .plan is the classic case
    bad.write_bytes(corrupt(data))
    with pytest.raises(EngineFileError) as info:
        sartor.load(bad, device="cpu")
    one_line(info, EngineFileError, str(bad), *fragments)
    for argv in (["run", bad], ["inspect", bad], ["inspect", bad, "--json"], ["bench", bad, "--iterations", "1"]):
        result = cli(*argv)
        assert_cli_error(result, *fragments)
        assert result.out == ""


def test_every_single_byte_flip_is_caught(tiny_plan):
    data = tiny_plan.read_bytes()
    for position in list(range(0, 64)) + list(range(64, len(data), 97)) + [len(data) - 1]:
        flipped = bytearray(data)
        flipped[position] ^= 0x10
        with pytest.raises(EngineFileError) as info:
            unpack(bytes(flipped), "engine")
        assert "\n" not in str(info.value)


def test_engine_file_not_found(tmp_path, cli):
    with pytest.raises(EngineFileError) as info:
        sartor.load(tmp_path / "none.plan")
    one_line(info, EngineFileError, "engine file not found", "none.plan")
    assert_cli_error(cli("inspect", tmp_path / "none.plan"), "engine file not found")


def _other_machine(plan: Path, dest: Path) -> Path:
    header, tensors = unpack(plan.read_bytes())
    header["fingerprint"].update(cpu="Imaginary CPU 9000", arch="imaginary64")  # the arch refuses the load
    dest.write_bytes(pack(header, tensors))
    return dest


def test_other_device_fingerprint(tiny_plan, tmp_path, cli):
    other = _other_machine(tiny_plan, tmp_path / "other.plan")
    with pytest.raises(FingerprintMismatchError) as info:
        sartor.load(other, device="cpu")
    one_line(info, FingerprintMismatchError, "Imaginary CPU 9000", "differs in arch", "rebuild it here",
             "sartor build", "--max-shapes images:4x3x16x16")
    assert_cli_error(cli("run", other), "Imaginary CPU 9000")
    assert_cli_error(cli("compare", tmp_path / "m.onnx", other), "differs in arch")


def test_inspect_does_not_fail_on_fingerprint_mismatch(tiny_plan, tmp_path, cli):
    other = _other_machine(tiny_plan, tmp_path / "other.plan")
    result = cli("inspect", other)
    assert result.code == 0, result
    assert "Imaginary CPU 9000" in result.out
    assert "no (differs in arch, cpu)" in result.out
    result = cli("inspect", other, "--json")
    assert result.code == 0, result
    info = json.loads(result.out)
    assert info["fingerprint"]["cpu"] == "Imaginary CPU 9000"
    assert info["fingerprint_here"]["matches"] is False
    assert info["fingerprint_here"]["differs_in"] == ["arch", "cpu"]
    assert info["fingerprint_here"]["refused_for"] == ["arch"] and info["fingerprint_here"]["loads"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_engine_on_a_machine_without_gpu(tiny_plan, tmp_path, cli):
    header, tensors = unpack(tiny_plan.read_bytes())
    header["fingerprint"] = {"kind": "cuda", "gpu": "NVIDIA H200", "compute_capability": "9.0"}
    header["device"] = "cuda:0"
    plan = tmp_path / "gpu.plan"
    plan.write_bytes(pack(header, tensors))
    with pytest.raises(DeviceError) as info:
        sartor.load(plan)
    one_line(info, DeviceError, "no CUDA GPU is available")
    with pytest.raises(FingerprintMismatchError):  # forcing the CPU: the engine was built for another device
        sartor.load(plan, device="cpu")
    result = cli("inspect", plan)
    assert result.code == 0, result
    assert "no CUDA GPU" in result.out


def test_engine_without_fingerprint(tiny_plan, tmp_path):
    header, tensors = unpack(tiny_plan.read_bytes())
    del header["fingerprint"]
    plan = tmp_path / "nofp.plan"
    plan.write_bytes(pack(header, tensors))
    with pytest.raises(EngineFileError) as info:
        sartor.load(plan)
    one_line(info, EngineFileError, "no device fingerprint")


# ---- the error policy of the command line ------------------------------------------------------------

def test_usage_errors_exit_2(cli, tiny_plan):
    for argv in ([], ["frobnicate"], ["build"], ["run", tiny_plan, "--bogus"], ["bench", tiny_plan, "--iterations", "x"],
                 ["build", "m.onnx", "-o", "x.plan", "--precision", "fp64"]):
        result = cli(*argv)
        assert result.code == 2, (argv, result)
        assert "usage:" in result.err


def test_help_and_version_exit_0(cli):
    assert cli("--help").code == 0
    result = cli("--version")
    assert result.code == 0 and sartor.__version__ in result.out


def test_verbose_shows_the_traceback(cli, tmp_path):
    quiet = cli("inspect", tmp_path / "none.plan")
    assert_cli_error(quiet, "engine file not found")
    for argv in (["--verbose", "inspect", tmp_path / "none.plan"], ["inspect", tmp_path / "none.plan", "--verbose"]):
        loud = cli(*argv)
        assert loud.code == 2
        assert "Traceback" in loud.err and "EngineFileError" in loud.err
        assert loud.err.rstrip().splitlines()[-1].startswith("error: ")


def test_internal_error_exits_3_in_one_line(cli, monkeypatch, tiny_plan):
    from sartor.cli import inspect as inspect_cmd

    def broken(path, trust=None):
        raise RuntimeError("boom\nsecond line")
    monkeypatch.setattr(inspect_cmd, "engine_summary", broken)
    result = cli("inspect", tiny_plan)
    assert result.code == 3, result
    assert result.error_lines == [line for line in result.err.splitlines() if line]
    assert result.error_lines[0].startswith("internal error: RuntimeError: boom second line")
    assert "Traceback" not in result.err
    loud = cli("inspect", tiny_plan, "--verbose")
    assert loud.code == 3 and "Traceback" in loud.err


def test_sartor_errors_are_one_line_by_construction():
    assert str(SartorError("a\n  b\tc ")) == "a b c"
    assert issubclass(ConfigError, SartorError)
