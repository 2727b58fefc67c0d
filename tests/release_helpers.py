"""Shared by the release and service tests: bundles of the tiny classifier, `sartor` subprocesses
(deploy, serve) and what their output says."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import MAX_SHAPES, MIN_SHAPES, OPT_SHAPES, classifier_model, save

HOST = "127.0.0.1"
PROFILE = {"min": MIN_SHAPES, "opt": OPT_SHAPES, "max": MAX_SHAPES}


def build_bundle(directory: Path, name: str, seed: int) -> tuple[Path, Path]:
    """(engine, bundle) of the tiny classifier with weights `seed`, built for the CPU."""
    import sartor
    directory.mkdir(parents=True, exist_ok=True)
    onnx_path = save(classifier_model(seed=seed), directory / f"{name}.onnx")
    engine, bundle = directory / f"{name}.plan", directory / f"{name}.bundle"
    sartor.build(onnx_path, engine, device="cpu", profiles=[PROFILE], bundle=bundle)
    return engine, bundle


def sartor_process(*argv, env: dict | None = None, **kwargs) -> subprocess.Popen:
    environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "sartor", *map(str, argv)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment, **kwargs)


def run_sartor(*argv, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "sartor", *map(str, argv)], capture_output=True, text=True, check=False,
                          env=environment, timeout=timeout)


def wait_for_line(stream, pattern: str, process: subprocess.Popen, timeout: float = 120) -> re.Match:
    """Read `stream` until a line matches `pattern` (the process must not end first)."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} (exit {process.poll()}): {''.join(seen)[-3000:]}")


def start_server(root: Path, *extra, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """A real `sartor serve` over `root` (HTTP only, any free port); returns it and its HTTP port."""
    process = sartor_process("serve", "--model-repository", root, "--http-port", 0, "--grpc-port", -1,
                             "--metrics-port", -1, *extra, env=env)
    match = wait_for_line(process.stdout, r"serving on HTTP 127\.0\.0\.1:(\d+)", process)
    return process, int(match.group(1))


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(30)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def served_version(port: int, model: str) -> str | None:
    try:
        status, body = get_json(f"http://{HOST}:{port}/v2/models/{model}")
    except OSError:
        return None
    return (body.get("versions") or [None])[0] if status == 200 else None
