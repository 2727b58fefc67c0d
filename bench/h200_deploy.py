"""Issue 31 part 4: how long a deploy's preflight takes on the device, per check, and the takt it
records. Builds ResNet-50 INT8 (random weights, calibrated on scene images) with a provenance bundle
on the GPU, then runs `sartor deploy` twice in fresh processes (release 1, then the same engine as
release 2: its kernels are then already in the engine's private cache) and once more with a
tampered golden output (must fail preflight and leave release 2 current).

One device call:

    PYTHONPATH=. python bench/h200_deploy.py --out $OUT [--batch 8]

Writes deploy.json (and prints it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def deploy(*argv) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "sartor", "deploy", *map(str, argv), "--json"], capture_output=True,
                          text=True, check=False, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - started
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        report = {"stdout": done.stdout[-2000:]}
    report.update(exit=done.returncode, process_wall_s=round(wall, 2), stderr=done.stderr[-2000:])
    return report


def summary(report: dict) -> dict:
    checked = report.get("preflight") or {}
    return {"exit": report.get("exit"), "release": report.get("release"), "passed": report.get("passed"),
            "process_wall_s": report.get("process_wall_s"), "preflight_s": checked.get("seconds"),
            "checks_s": {c["name"]: c["seconds"] for c in checked.get("checks", [])},
            "failed": next((f"{c['name']}: {c['detail']}" for c in checked.get("checks", []) if not c["passed"]), None),
            "takt": checked.get("takt")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import numpy as np
    from h200_int8 import scene_images
    from h200_models import export_classifier, versions

    import sartor
    from sartor.deploy.golden import read_npz
    from sartor.deploy.manifest import write_manifest
    from sartor.runtime.engine_file import npz_bytes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="deploy_"))
    onnx = export_classifier("resnet50", work)
    calib = work / "calib.npy"
    np.save(calib, scene_images(32, 50_000, size=224, imagenet=True))
    shapes = {"input": (args.batch, 3, 224, 224)}
    engine, bundle = work / "resnet50_int8.plan", work / "resnet50_int8.bundle"
    started = time.perf_counter()
    sartor.build(str(onnx), str(engine), device="cuda", precision="int8", calib=str(calib), calib_size=32,
                 min_shapes={"input": (1, 3, 224, 224)}, opt_shapes=shapes, max_shapes=shapes, bundle=str(bundle))
    build_s = time.perf_counter() - started
    root = work / "root"
    root.mkdir()
    runs = {"first": deploy(bundle, "--root", root, "--name", "resnet50"),
            "again": deploy(engine, "--bundle", bundle, "--root", root, "--name", "resnet50")}
    tampered = work / "tampered.bundle"
    shutil.copytree(bundle, tampered)
    stored = read_npz(tampered / "golden" / "engine_outputs.npz")
    (tampered / "golden" / "engine_outputs.npz").write_bytes(npz_bytes({k: -v for k, v in stored.items()}))
    write_manifest(tampered)
    runs["bad_golden"] = deploy(engine, "--bundle", tampered, "--root", root, "--name", "resnet50")
    current = os.readlink(root / "resnet50" / "current")
    results = {"versions": versions(), "batch": args.batch, "build_with_bundle_s": round(build_s, 1),
               "runs": {name: summary(r) for name, r in runs.items()}, "current_after_bad": current,
               "stderr": {name: r["stderr"] for name, r in runs.items() if r.get("exit")}}
    (out / "deploy.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
