"""bench/preprocess_kernel.py runs as a real process (through Triton's interpreter where there is no
GPU) on tiny frames and writes the JSON the lead reads: every path timed, the kernel's pixels
against the CPU reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sartor.kernels.preprocess.letterbox import PREPROCESS_TILES

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_writes_its_json(tmp_path):
    out = tmp_path / "nested" / "prep.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "preprocess_kernel.py"), "--out", str(out),
                           "--frames", "2", "--size", "12x20", "--spec", "letterbox=8,mean=0,std=255,bgr,nhwc,dtype=float16",
                           "--repeats", "1", "--warmup", "0", "--cpu-repeats", "1", "--tiles", "1"],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["frames"] == 2 and report["frame_size"] == [12, 20]
    assert set(report["timings"]) == {"kernel_prepare_batch", f"kernel_alone.chw.{PREPROCESS_TILES[0].name}",
                                      f"kernel_alone.hwc.{PREPROCESS_TILES[0].name}", "torch_prepare_batch",
                                      "cpu_reference_preprocess_batch"}
    assert all(t["median_ms"] > 0 for t in report["timings"].values())
    assert report["agreement"]["kernel_vs_cpu_reference"]["max_levels"] <= 1.01
    assert "kernel" in done.stdout and "cpu reference" in done.stdout
