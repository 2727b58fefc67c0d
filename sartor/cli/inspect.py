"""`sartor inspect PLAN`: what an engine holds, read without binding it to a device.

Reading verifies the file's integrity but not its device fingerprint, so an engine built for
another machine can still be inspected (the fingerprint section says whether it matches here).
"""
from __future__ import annotations

from pathlib import Path

from ..errors import DeviceError
from ..runtime.engine_file import FORMAT_VERSION, read_engine_file
from ..runtime.fingerprint import describe, device_fingerprint, parse_device
from ..runtime.profiles import Profile
from .common import console, fmt_bytes, fmt_shape, key_values, print_json, table, text

DESCRIPTION = "Show an engine's layers, profiles, fingerprint, provenance and memory."


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("inspect", parents=parents, help=DESCRIPTION.rstrip("."), description=DESCRIPTION)
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def epilogue(attrs: dict) -> str:
    """What a fused layer does after its main op, in order: "+ residual → Relu", "LeakyRelu(alpha=0.1)"."""
    steps = []
    activation = attrs.get("activation")
    if activation:
        params = [f"{k}={attrs[f'activation_{k}']:g}" for k in ("alpha", "beta")
                  if isinstance(attrs.get(f"activation_{k}"), (int, float))]
        activation = f"{activation}({', '.join(params)})" if params else str(activation)
    residual = "residual_after_activation" in attrs
    after = bool(attrs.get("residual_after_activation"))
    if residual and not after:
        steps.append("+ residual")
    if activation:
        steps.append(activation)
    if residual and after:
        steps.append("+ residual")
    return " → ".join(steps)


def _fingerprint_here(header: dict) -> dict:
    built_for = header.get("fingerprint") or {}
    try:
        device = parse_device(header.get("device") or built_for.get("kind") or "cpu")
        here = device_fingerprint(device)
    except DeviceError as exc:
        return {"matches": False, "differs_in": ["device"], "here": None, "note": str(exc)}
    differing = sorted(k for k in set(built_for) | set(here) if built_for.get(k) != here.get(k))
    return {"matches": not differing, "differs_in": differing, "here": here, "note": ""}


def engine_summary(path: str) -> dict:
    header, tensors = read_engine_file(path)
    weight_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("w/"))
    arenas = [p.get("arena_bytes", 0) for p in header.get("memory", {}).get("profiles", [])]
    config = header.get("build_config", {})
    graph = header.get("graph", {})
    return {
        "path": str(path),
        "file_bytes": Path(path).stat().st_size,
        "format_version": FORMAT_VERSION,
        "device": header.get("device"),
        "precision": config.get("precision"),
        "fingerprint": header.get("fingerprint"),
        "fingerprint_here": _fingerprint_here(header),
        "inputs": graph.get("inputs", []),
        "outputs": graph.get("outputs", []),
        "profiles": header.get("profiles", []),
        "layers": [dict(layer, epilogue=epilogue(layer.get("attrs") or {})) for layer in header.get("layers", [])],
        "memory": {"weight_bytes": int(weight_bytes), "arena_bytes": arenas,
                   "device_bytes": int(weight_bytes + max(arenas, default=0)),
                   "profiles": header.get("memory", {}).get("profiles", [])},
        "provenance": header.get("provenance", {}),
        "build_config": config,
        "build_log": header.get("build_log", []),
        "preprocess": header.get("preprocess"),
    }


def run(args) -> int:
    info = engine_summary(args.plan)
    if args.json:
        print_json(info)
        return 0
    out = console()
    here = info["fingerprint_here"]
    match = "yes" if here["matches"] else f"no (differs in {', '.join(here['differs_in'])}) {here['note']}".strip()
    out.print(key_values("Engine", [
        ("file", f"{info['path']} ({fmt_bytes(info['file_bytes'])}, format v{info['format_version']})"),
        ("device", info["device"]),
        ("built for", describe(info["fingerprint"] or {})),
        ("matches this machine", match),
        ("precision", info["precision"]),
        ("preprocess", (info["preprocess"] or {}).get("text") or "not recorded (build with --preprocess)"),
    ]))
    io_table = table("Bindings", "kind", "name", "dtype", "shape")
    for kind in ("inputs", "outputs"):
        for v in info[kind]:
            io_table.add_row(kind[:-1], text(v["name"]), v["dtype"], fmt_shape(v["shape"]))
    out.print(io_table)
    profiles = table("Profiles", "profile", "input", "min", "opt", "max")
    for k, p in enumerate(info["profiles"]):
        for name, r in Profile.from_json(p).shapes.items():
            profiles.add_row(str(k), text(name), fmt_shape(r.min), fmt_shape(r.opt), fmt_shape(r.max))
    out.print(profiles)
    layers = table("Layers", "#", "name", "op", "fused from (ONNX nodes)", "precision", "tactic", "epilogue")
    for i, layer in enumerate(info["layers"]):
        precision = layer["precision"] + (f" ({layer['reason']})" if layer.get("reason") else "")
        layers.add_row(str(i), text(layer["name"]), text(layer["op"]), text(", ".join(layer.get("origin") or [])),
                       text(precision), text(layer.get("tactic")), text(layer["epilogue"]))
    out.print(layers)
    memory = info["memory"]
    out.print(key_values("Memory", [("weights", fmt_bytes(memory["weight_bytes"]))]
                         + [(f"activation arena, profile {k}", f"{fmt_bytes(a)} at max shapes")
                            for k, a in enumerate(memory["arena_bytes"])]
                         + [("device total", fmt_bytes(memory["device_bytes"]))]))
    prov = info["provenance"]
    out.print(key_values("Provenance", [(k, v) for k, v in prov.items()]))
    if info["build_log"]:
        out.print("[bold]Build log[/]")
        for line in info["build_log"]:
            out.print(text(f"  {line}"))
    return 0
