"""Installs that fit: each install (`pip install sartor`, `sartor[build]`, `sartor[serve]`, ...) does
what sartor/extras.py says it does, proved in subprocesses where every installed package outside
that install's dependencies cannot be imported, as on a machine where it was never installed.

Which packages an install has is read from pyproject.toml and the installed packages' own metadata
(each requirement followed to the packages it requires), so a new import of an undeclared package
in the runtime fails here, not on a user's device. A command whose extra is missing says which one
in one line. The CPU build of torch, installed from scratch, is scripts/cpu_install.sh's (the last
test here, when $SARTOR_CPU_TORCH names the torch to install)."""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import classifier_model, save

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+
try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip's own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

# Set in each subprocess before anything else imports: the modules listed in $SARTOR_TEST_UNINSTALLED
# read as never installed (`import` raises ModuleNotFoundError, find_spec finds nothing). Modules
# already imported while Python started (.pth files) stay.
SITECUSTOMIZE = """
import json, os, sys
for _name in json.loads(os.environ.get("SARTOR_TEST_UNINSTALLED", "[]")):
    sys.modules.setdefault(_name, None)
"""


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(extras: tuple) -> list[Requirement]:
    """sartor's own requirements for `extras` (its base dependencies always), self-references
    (`sartor[serve]`) followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted, seen, found = list(extras), set(), [Requirement(r) for r in project["dependencies"]]
    while wanted:
        extra = wanted.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in project["optional-dependencies"][extra]:
            requirement = Requirement(text)
            if _canonical(requirement.name) == "sartor":
                wanted.extend(requirement.extras)
            else:
                found.append(requirement)
    return found


def installed_with(extras: tuple) -> set[str]:
    """The distributions (canonical names) an install of sartor with `extras` has here: its
    requirements followed through each installed package's metadata, environment markers evaluated."""
    closure: set[str] = set()
    pending = [(r, ()) for r in _requirements(extras)]
    visited: set[tuple] = set()
    while pending:
        requirement, _ = pending.pop()
        name = _canonical(requirement.name)
        key = (name, tuple(sorted(requirement.extras)))
        if key in visited:
            continue
        visited.add(key)
        try:
            distribution = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (another platform's, or an optional one)
        closure.add(name)
        for text in distribution.requires or ():
            nested = Requirement(text)
            if nested.marker is None:
                pending.append((nested, ()))
                continue
            environments = [dict(default_environment(), extra="")] + [
                dict(default_environment(), extra=extra) for extra in requirement.extras]
            if any(nested.marker.evaluate(environment) for environment in environments):
                pending.append((nested, ()))
    return closure


def uninstalled_for(extras: tuple) -> list[str]:
    """The top-level modules of every installed distribution that an install with `extras` lacks."""
    closure = installed_with(extras)
    owners = importlib.metadata.packages_distributions()
    return sorted(module for module, dists in owners.items()
                  if module.isidentifier() and module not in sys.stdlib_module_names and module != "sartor"
                  and not any(_canonical(d) in closure for d in dists))


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("site")
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


def install_env(site_dir: Path, extras: tuple) -> dict:
    """The environment of a subprocess that sees only the install of sartor with `extras`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_dir), str(ROOT)]), PYTHONUNBUFFERED="1",
                SARTOR_TEST_UNINSTALLED=json.dumps(uninstalled_for(extras)))


def python(env: dict, code: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def sartor_cli(env: dict, *argv, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sartor", *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def test_the_runtime_install_lacks_what_compiling_and_serving_need():
    # The check below is only as good as this list: the compiler's and server's packages are on it.
    uninstalled = set(uninstalled_for(()))
    for module in ("onnx", "onnxruntime", "pycocotools", "aiohttp", "grpc", "tritonclient", "pytest", "torchvision"):
        if importlib.util.find_spec(module) is not None:
            assert module in uninstalled, module
    for module in ("onnx", "ml_dtypes"):  # onnx brings ml_dtypes; the runtime must do without
        assert module in uninstalled, module
    for module in ("torch", "numpy", "safetensors", "rich", "PIL", "cryptography"):
        assert module not in uninstalled, module
    assert installed_with(("build",)) >= {"onnx", "onnxruntime", "pycocotools", "ml-dtypes"}
    assert "grpcio" in installed_with(("ray",)) or importlib.util.find_spec("ray") is None


_RUN = r"""
import sys
import numpy as np
import sartor
inputs, jpeg, letterbox_plan, *plans = sys.argv[1:]
for plan in plans:
    engine = sartor.load(plan, device="cpu")
    np.savez(plan + ".out.npz", **engine.context().run(dict(np.load(inputs))))
# JPEG to class scores through the engine's stored preprocessing: Pillow's decode on the host.
result, = sartor.Pipeline(sartor.load(letterbox_plan, device="cpu")).run([jpeg])
assert result.error is None, result.error
np.save(letterbox_plan + ".out.npy", result.outputs["logits"])
heavy = sorted(m for m in ("onnx", "onnxruntime", "ml_dtypes", "aiohttp", "grpc", "tritonclient", "torchvision",
                           "pycocotools") if sys.modules.get(m) is not None)
print("imported:", heavy)
"""


@pytest.fixture(scope="module")
def quantized_plans(tiny_onnx, tmp_path_factory) -> list[Path]:
    """The tiny classifier built INT8 and FP8 for the CPU (each with its scales and packed weights)."""
    import sartor
    from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES
    calib = np.random.default_rng(1).standard_normal((8, 3, 16, 16)).astype(np.float32)
    plans = []
    for precision in ("int8", "fp8"):
        plan = tmp_path_factory.mktemp("engines") / f"tiny_{precision}.plan"
        sartor.build(tiny_onnx, plan, device="cpu", precision=precision, calib=calib, min_shapes=MIN_SHAPES,
                     opt_shapes=OPT_SHAPES, max_shapes=MAX_SHAPES, builder_effort=0)
        plans.append(plan)
    return plans


def test_the_runtime_install_loads_and_runs_engines(site_dir, tiny_plan, quantized_plans, letterbox_plan, tmp_path):
    import shutil

    from PIL import Image

    import sartor
    plans = [shutil.copy(p, tmp_path / p.name) for p in (tiny_plan, *quantized_plans)]
    letterbox = shutil.copy(letterbox_plan, tmp_path / "letterbox.plan")
    feeds = {"images": np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)}
    np.savez(tmp_path / "inputs.npz", **feeds)
    jpeg = tmp_path / "frame.jpg"
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (24, 40, 3), dtype=np.uint8)).save(jpeg)
    result = python(install_env(site_dir, ()), _RUN, tmp_path / "inputs.npz", jpeg, letterbox, *plans)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("imported: []")
    for plan in plans:  # what this process, with every package, computes
        expected = sartor.load(plan, device="cpu").context().run(feeds)
        got = np.load(f"{plan}.out.npz")
        assert set(got.files) == set(expected) and all(np.array_equal(got[k], expected[k]) for k in expected), plan
    expected, = sartor.Pipeline(sartor.load(letterbox, device="cpu")).run([jpeg])
    assert np.array_equal(np.load(f"{letterbox}.out.npy"), expected.outputs["logits"])


def test_the_runtime_install_runs_the_device_side_commands(site_dir, tiny_plan, letterbox_plan, tmp_path):
    from PIL import Image
    from release_helpers import build_bundle
    _, bundle = build_bundle(tmp_path / "built", "tiny", seed=0)  # on the build machine
    (tmp_path / "root").mkdir()
    env = install_env(site_dir, ())
    np.save(tmp_path / "x.npy", np.ones((2, 3, 16, 16), np.float32))
    Image.fromarray(np.random.default_rng(2).integers(0, 255, (24, 40, 3), dtype=np.uint8)).save(tmp_path / "f.jpg")
    for argv in (("run", tiny_plan, "--input", f"images={tmp_path / 'x.npy'}", "--output", tmp_path / "out.npz"),
                 ("inspect", tiny_plan, "--json"),
                 ("bench", tiny_plan, "--iterations", 3, "--warmup", 1),
                 ("keygen", "-o", tmp_path / "key"),
                 ("sign", tiny_plan, "--key", tmp_path / "key", "--output", tmp_path / "signed.plan"),
                 ("run", tmp_path / "signed.plan", "--trust", tmp_path / "key.pub"),
                 ("infer", letterbox_plan, tmp_path / "f.jpg", "-o", tmp_path / "results.jsonl"),
                 # a release from the bundle: preflight (golden outputs, takt), swap; then the check
                 ("deploy", bundle, "--root", tmp_path / "root", "--name", "tiny", "--takt-runs", 2),
                 ("deploy", "--check", "--root", tmp_path / "root", "--name", "tiny")):
        result = sartor_cli(env, *argv)
        assert result.returncode == 0, (argv, result.stderr[-3000:])
    assert json.loads(sartor_cli(env, "inspect", tiny_plan, "--json").stdout)["fingerprint_here"]["loads"]
    assert len(json.loads((tmp_path / "results.jsonl").read_text())["logits"]) > 0


# (argv, the feature the error line names, the extra it names); `{onnx}`, `{plan}` filled in.
MISSING = [
    (("build", "{onnx}", "-o", "{out}"), "sartor build", "build"),
    (("build", "--help"), "sartor build", "build"),
    (("rebuild", "{out}"), "sartor rebuild", "build"),
    (("sensitivity", "{onnx}"), "sartor sensitivity", "build"),
    (("compare", "{onnx}", "{plan}"), "the ONNX Runtime FP32 reference", "build"),
    (("serve", "--model-repository", "{out}"), "sartor serve", "serve"),
    (("infer", "{plan}", "{plan}", "-o", "{out}.jsonl", "--ray"), "sartor infer --ray", "ray"),
    (("infer", "{plan}", "{plan}", "-o", "{out}.parquet"), "writing .parquet", "ray"),
]


@pytest.mark.parametrize("argv, feature, extra", MISSING, ids=[" ".join(m[0][:2]) for m in MISSING])
def test_a_command_whose_extra_is_missing_names_it_in_one_line(site_dir, tiny_onnx, tiny_plan, tmp_path, argv,
                                                                feature, extra):
    env = install_env(site_dir, ())
    fill = {"{onnx}": str(tiny_onnx), "{plan}": str(tiny_plan), "{out}": str(tmp_path / "out")}
    result = sartor_cli(env, *(functools.reduce(lambda text, k: text.replace(k, fill[k]), fill, a) for a in argv))
    assert result.returncode == 2, result
    module = {"build": "onnx(runtime)?", "serve": "aiohttp", "ray": "(ray|pyarrow)"}[extra]
    assert re.fullmatch(rf"error: {re.escape(feature)} needs the {extra} extra: pip install 'sartor\[{extra}\]' "
                        rf"\(No module named '{module}'\)\n", result.stderr), result.stderr
    assert result.stdout == ""


_PYTHON_API = r"""
import sys
import sartor
from sartor.errors import MissingExtraError, SartorError
for what in ("sartor.build", "sartor.serve", "sartor.integrations.ray_serve", "sartor.deploy.rebuild"):
    try:
        if what == "sartor.build":
            sartor.build(sys.argv[1], sys.argv[2], device="cpu")
        elif what == "sartor.deploy.rebuild":
            from sartor.deploy import rebuild
        else:
            __import__(what)
        print(what, "imported")
    except MissingExtraError as exc:
        assert isinstance(exc, ImportError) and isinstance(exc, SartorError)
        print(what, "->", exc)
from sartor.deploy.releases import RELEASES  # the device side of deploy needs no extra
from sartor.integrations.ray_data import SartorPredictor  # Ray calls it; it imports no Ray itself
print("device side imported")
"""


def test_the_python_api_names_the_missing_extra(site_dir, tiny_onnx, tmp_path):
    result = python(install_env(site_dir, ()), _PYTHON_API, tiny_onnx, tmp_path / "x.plan")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "sartor.build -> sartor.build needs the build extra: pip install 'sartor[build]' (No module named 'onnx')",
        "sartor.serve -> sartor serve needs the serve extra: pip install 'sartor[serve]' (No module named 'aiohttp')",
        "sartor.integrations.ray_serve -> sartor.integrations.ray_serve needs the ray extra: pip install "
        "'sartor[ray]' (No module named 'ray')",
        "sartor.deploy.rebuild -> building an engine needs the build extra: pip install 'sartor[build]' "
        "(No module named 'onnx')",
        "device side imported",
    ]
    assert not (tmp_path / "x.plan").exists()


def test_the_build_install_builds_and_compares(site_dir, tmp_path):
    env = install_env(site_dir, ("build",))
    onnx_path = save(classifier_model(seed=3), tmp_path / "model.onnx")
    plan = tmp_path / "model.plan"
    shapes = [a for flag in ("min", "opt", "max") for a in (f"--{flag}-shapes", "images:2x3x16x16")]
    result = sartor_cli(env, "build", onnx_path, "-o", plan, "--device", "cpu", "--builder-effort", 0, *shapes)
    assert result.returncode == 0, result.stderr[-3000:]
    result = sartor_cli(env, "compare", onnx_path, plan)
    assert result.returncode == 0, result.stderr[-3000:]
    result = sartor_cli(env, "serve", "--model-repository", tmp_path)
    assert result.returncode == 2 and "sartor serve needs the serve extra" in result.stderr


def test_the_serve_install_serves(site_dir, tiny_plan, tmp_path):
    from release_helpers import get_json, start_server, stop
    from serve_helpers import BATCHING, add_model
    add_model(tmp_path / "repo", "tiny", tiny_plan, BATCHING)
    env = install_env(site_dir, ("serve",))
    server, port = start_server(tmp_path / "repo", env={k: env[k] for k in ("PYTHONPATH", "SARTOR_TEST_UNINSTALLED")})
    try:
        assert get_json(f"http://127.0.0.1:{port}/v2/health/ready")[0] == 200
        status, body = get_json(f"http://127.0.0.1:{port}/v2/models/tiny")
        assert status == 200 and body["name"] == "tiny"
    finally:
        stop(server)


def test_the_ray_install_imports_the_serve_deployment(site_dir):
    pytest.importorskip("ray")
    result = python(install_env(site_dir, ("ray",)), "import sartor.integrations.ray_serve as m; print(m.sartor_app)")
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_cpu_only_install_from_scratch(tmp_path):
    """scripts/cpu_install.sh: a fresh venv with the CPU build of torch named by $SARTOR_CPU_TORCH
    (e.g. `torch==2.14.1+cpu`, or a wheel file), sartor's runtime, then its build extra; an engine
    built and run there, and run again once the build extra's packages are uninstalled. It installs
    about 1 GB, so it runs only where that variable is set."""
    torch_requirement = os.environ.get("SARTOR_CPU_TORCH")
    if not torch_requirement:
        pytest.skip("set SARTOR_CPU_TORCH to the CPU torch to install (e.g. torch==2.14.1+cpu)")
    result = subprocess.run(["bash", str(ROOT / "scripts" / "cpu_install.sh"), str(tmp_path / "venv"),
                             torch_requirement], capture_output=True, text=True, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "cpu install: PASS" in result.stdout
