"""`sartor build --json`: the build summary as one JSON document (schema "sartor-build-summary/1"):
the engine file and its size, device, precision, profiles, each layer with its precision and
tactic, stage seconds and the tactics stage's seconds by tactic family, the build log and its warnings, and a bundle when one was written."""
from __future__ import annotations

from pathlib import Path

SCHEMA = "sartor-build-summary/1"


def summary_json(result, bundle: dict | None = None) -> dict:
    header = result.header
    path = Path(result.path)
    memory = header.get("memory", {}).get("profiles", [])
    return {
        "schema": SCHEMA,
        "output": str(result.path),
        "bytes": path.stat().st_size if path.is_file() else 0,
        "device": header["device"],
        "precision": header["build_config"]["precision"],
        "int8_fallback_precision": header.get("int8_fallback_precision"),
        "onnx_nodes": result.onnx_nodes,
        "layer_count": result.layers,
        "profiles": header["profiles"],
        "activation_arena_bytes": [p.get("arena_bytes", 0) for p in memory],
        "seconds": result.seconds,
        "stage_seconds": dict(result.stage_seconds),
        "tactic_seconds": dict(result.tactic_seconds),
        "layers": [{"name": layer["name"], "op": layer["op"], "origin": layer.get("origin") or [],
                    "precision": layer["precision"], "reason": layer.get("reason", ""),
                    "tactic": layer.get("tactic"), "tactic_source": layer.get("tactic_source"),
                    "tactic_timings_ms": layer.get("tactic_timings_ms") or {}}
                   for layer in header["layers"]],
        "log": list(result.log),
        "warnings": list(result.warnings),
        "bundle": bundle,
    }
