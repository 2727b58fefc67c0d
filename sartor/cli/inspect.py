"""`sartor inspect PLAN`: what an engine holds, read without binding it to a device.

Reading verifies the file's checksum and signature (and, with a trust store, that a trusted key
signed it) but not its device fingerprint, so an engine built for another machine can still be
inspected (the fingerprint section says whether it matches here).
"""
from __future__ import annotations

from pathlib import Path

from ..data.buckets import preprocess_line
from ..errors import DeviceError
from ..ops.fused_pool import max_pool_label
from ..runtime.capture import describe_eager_layers
from ..runtime.engine_file import FORMAT_VERSION, read_engine
from ..runtime.engine_signature import trust_store
from ..runtime.fingerprint import compare_fingerprints, compatibility_level, describe, device_fingerprint, parse_device
from ..runtime.kernel_store import TENSOR_PREFIX, describe_record, is_embedded, record_entries
from ..runtime.memory_plan import memory_by_profile
from ..runtime.profiles import Profile
from .common import (
    add_trust_arg,
    console,
    describe_precision,
    fmt_bytes,
    fmt_shape,
    key_values,
    print_json,
    table,
    text,
)

DESCRIPTION = "Show an engine's layers, profiles, fingerprint, provenance and memory."


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("inspect", parents=parents, help=DESCRIPTION.rstrip("."), description=DESCRIPTION)
    p.add_argument("plan", metavar="PLAN", help="the engine file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_trust_arg(p)
    p.set_defaults(func=run)


def epilogue(attrs: dict) -> str:
    """What a fused layer does after its main op, in order: "+ residual → Relu", "LeakyRelu(alpha=0.1)",
    "Relu → MaxPool 3x3/2,2/1,1,1,1"."""
    steps = []
    activation = attrs.get("activation")
    if activation:
        params = [f"{k}={attrs[f'activation_{k}']:g}" for k in ("alpha", "beta")
                  if isinstance(attrs.get(f"activation_{k}"), (int, float))]
        activation = f"{activation}({', '.join(params)})" if params else str(activation)
    residual = "residual_after_activation" in attrs
    after = bool(attrs.get("residual_after_activation"))
    added = "+ projected residual" if "projection_strides" in attrs else "+ residual"
    if residual and not after:
        steps.append(added)
    if activation:
        steps.append(activation)
    if residual and after:
        steps.append(added)
    pool = max_pool_label(attrs)
    if pool is not None:
        steps.append(f"MaxPool {pool}")
    return " → ".join(steps)


def tactic_timings(layer: dict) -> str:
    """The timed candidates, fastest (the winner) first, and the rejected ones, in one line:
    "channels_last 0.121, torch 0.154 ms; rejected triton_epilogue (timing cache)"."""
    timings = layer.get("tactic_timings_ms") or {}
    if not timings:
        return ""
    line = ", ".join(f"{name} {ms:.3g}" for name, ms in sorted(timings.items(), key=lambda kv: kv[1])) + " ms"
    if layer.get("tactic_rejected"):
        line += "; rejected " + ", ".join(layer["tactic_rejected"])
    if layer.get("tactic_source") == "timing cache":
        line += " (timing cache)"
    return line


def profile_tactics(layer: dict) -> str:
    """The layer's winner per profile when the profiles' winners differ, else "":
    "profile 0: igemm_64x64x32_w4_s4, profile 1: igemm_128x128x32_w8_s3" (reference: the layer's
    reference kernel, where a profile had nothing to choose between)."""
    chosen = [(entry or {}).get("tactic") or "reference" for entry in layer.get("tactic_by_profile") or []]
    if len(set(chosen)) < 2:
        return ""
    return ", ".join(f"profile {k}: {tactic}" for k, tactic in enumerate(chosen))


def _tactics_line(tactics: dict | None) -> str:
    if not tactics:
        return "not recorded"
    line = (f"builder effort {tactics.get('builder_effort')}: {tactics.get('timed', 0)} layer(s) timed, "
            f"{tactics.get('from_timing_cache', 0)} from timing cache")
    return line + (f" {tactics['timing_cache']}" if tactics.get("timing_cache") else "")


def _drop(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _cosine(value) -> str:
    from ..builder.accuracy_planner import cosine_text  # only engines with a planner record get here
    return cosine_text(value)


def _snr(value) -> str:
    return "nan" if value is None else f"{value:.2f}"


def reduced_precision(record: dict) -> str:
    """The precision a planner record moved layers out of ("int8", "fp8", "fp16", "bf16"); records
    written before float builds were planned name only their quantized format."""
    return record.get("reduced") or record.get("quantized", "int8")


def planner_candidates(record: dict) -> int:
    """The layers the planner could move; older records ranked every one of them."""
    return record.get("candidates", len(record["ranking"]))


def ranked_on(record: dict, word: str) -> str:
    """Where the planner's ranking ran, or why it did not (the default plan met the target)."""
    where = record["sensitivity"]
    if "skipped" in where:
        return f"{word} layers not ranked: {where['skipped']}"
    return f"{word} layers ranked on {where.get('samples', 0)} samples"


def print_label_free_planner(out, planner: dict) -> None:
    """The planner's --min-cosine (--min-snr) target: where it measured, each measured plan with the
    mean and minimum cosine (the SNR) per output, and the layers kept."""
    word = reduced_precision(planner).upper()
    held = planner["held_out"]
    names = list(planner["iterations"][0]["outputs"]) if planner["iterations"] else []
    if planner["target"] == "min_snr":
        goal, stats, shown = f"min SNR {planner['min_snr']:g} dB", ("snr_db",), _snr
    else:
        goal, stats, shown = f"min cosine {planner['min_cosine']:g}", ("mean", "min"), _cosine
    title = (f"{word} planner: {goal} ({planner['statistic']}) on {held['samples']} "
             f"held-out samples of {held['source']}" + (f", outputs grouped by --decoder {planner['decoder']}"
                                                        if planner.get("decoder") else "")
             + f"; {ranked_on(planner, word)}")
    t = table(title, "iteration", f"layers at {planner['precision']}",
              *(f"{n} {stat.replace('snr_db', 'SNR dB')}" for n in names for stat in stats), "target", "seconds")
    for k, it in enumerate(planner["iterations"]):
        cells = [shown(it["outputs"][n][stat]) for n in names for stat in stats]
        t.add_row(str(k), str(it["layers_out"]), *cells, "meets" if it["holds"] else "under", f"{it['seconds']:.1f}")
    out.print(t)
    out.print(text(f"  held-out samples disjoint from calibration: {held['disjoint']}"))
    kept = planner["kept_out"]
    out.print(text(f"  kept out of {word} ({len(kept)} of {planner_candidates(planner)}): {', '.join(kept) or 'none'}"))


def print_planner(out, planner: dict) -> None:
    """The accuracy planner: the budget, each measured plan with its drops, and the layers kept."""
    if planner.get("target") in ("min_cosine", "min_snr"):
        print_label_free_planner(out, planner)
        return
    word = reduced_precision(planner).upper()
    splits = list(planner["iterations"][0]["drops"]) if planner["iterations"] else []
    title = (f"{word} planner: budget {planner['budget']:g} {planner['metric']} drop on {planner['data']} "
             f"({planner['images']} images" + (f", split by {planner['split_by']}" if planner.get("split_by") else "")
             + f"); {ranked_on(planner, word)}")
    t = table(title, "iteration", f"layers at {planner['precision']}", *(f"{s} drop" for s in splits), "budget",
              "seconds")
    for k, it in enumerate(planner["iterations"]):
        t.add_row(str(k), str(it["layers_out"]), *(_drop(it["drops"].get(s)) for s in splits),
                  "holds" if it["holds"] else "over", f"{it['seconds']:.1f}")
    out.print(t)
    kept = planner["kept_out"]
    out.print(text(f"  kept out of {word} ({len(kept)} of {planner_candidates(planner)}): {', '.join(kept) or 'none'}"))


def calibration_line(calibration: dict) -> str:
    """One line for an engine's calibration: method, samples, where from, and auto's choice."""
    line = (f"{calibration.get('method')}, {calibration.get('calib_size')} samples, sha256 "
            f"{str(calibration.get('calib_sha256'))[:12]}…"
            + (f" (from cache {calibration.get('cache')})" if calibration.get("from_cache") else ""))
    auto = calibration.get("auto") or {}
    if auto.get("errors"):
        errors = ", ".join(f"{k} {'inf' if v is None else f'{v:.3g}'}" for k, v in auto["errors"].items())
        line += (f"; auto chose {auto['chosen']} by output error on {auto['held_out_samples']} held-out samples "
                 f"({errors})")
    elif auto.get("reason"):
        line += f"; auto fell back to {auto['chosen']}: {auto['reason']}"
    return line


def print_calibration(out, calibration: dict) -> None:
    """The calibration record, and each calibrated tensor's threshold method."""
    out.print(key_values("Calibration", [("thresholds", calibration_line(calibration))]
                         + [(f"by {a}", ", ".join(f"{v} {n}" for v, n in counts.items()))
                            for a, counts in (calibration.get("splits") or {}).items()]))
    methods = calibration.get("methods") or {}
    if methods:
        t = table("Threshold methods", "tensor", "method")
        for tensor, method in methods.items():
            t.add_row(text(tensor), method)
        out.print(t)


def _fingerprint_here(header: dict) -> dict:
    built_for = header.get("fingerprint") or {}
    try:
        device = parse_device(header.get("device") or built_for.get("kind") or "cpu")
        here = device_fingerprint(device)
    except DeviceError as exc:
        return {"matches": False, "loads": False, "differs_in": ["device"], "refused_for": ["device"],
                "warned_for": [], "here": None, "note": str(exc)}
    check = compare_fingerprints(built_for, here, compatibility_level())
    differing = sorted(check.refused + check.warned)
    return {"matches": not differing, "loads": check.loads, "compatibility": check.level, "differs_in": differing,
            "refused_for": list(check.refused), "warned_for": list(check.warned), "here": here, "note": ""}


def _kernels_summary(header: dict, tensors: dict) -> dict:
    """The compiled kernels the file carries: the header's record and the bytes actually stored."""
    record = header.get("kernels")
    stored = sum(t.numel() for k, t in tensors.items() if k.startswith(TENSOR_PREFIX))
    kind = (header.get("fingerprint") or {}).get("kind", "cuda")
    return {"embedded": is_embedded(record), "entries": len(record_entries(record)),
            "bytes": int(stored), "triton": record.get("triton") if isinstance(record, dict) else None,
            "text": describe_record(record, kind), "record": record}


def print_fallback_where_faster(out, record: dict) -> None:
    """--fallback-where-faster's comparison: the layers faster at the fallback precision, the
    engines' end-to-end times, and which was kept."""
    fallback = record["fallback_precision"]
    lines = [("kept", record["kept"]), ("quantized engine, end to end", f"{record['quantized_ms']:.4g} ms")]
    if "mixed_ms" in record:
        lines.append((f"with the layers below at {fallback}", f"{record['mixed_ms']:.4g} ms"))
    lines.append((f"every layer at {fallback}", f"{record['fallback_ms']:.4g} ms"))
    for name, m in record["candidates"].items():
        lines.append((text(name), f"{fallback} {m['fallback_ms']:.4g} ms against {m['quantized_ms']:.4g} ms"))
    if not record["candidates"]:
        lines.append(("layers faster at " + fallback, f"none by the margin ({record['margin']:g} of the time)"))
    out.print(key_values("Fallback where faster", lines))


def _signature_summary(engine, store) -> dict:
    signer = engine.signature.fingerprint if engine.signature else None
    return {"signed": signer is not None, "fingerprint": signer, "checksum": engine.digest,
            "trust_store": store.describe() if store else None,
            "text": (f"signed by key {signer}" if signer else "not signed")
            + (f" (trusted: {store.describe()})" if store else "")}


def engine_summary(path: str, trust=None) -> dict:
    store = trust_store(trust)
    engine = read_engine(path, store)
    header, tensors = engine.header, engine.tensors
    weight_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("w/"))
    arenas = [p.get("arena_bytes", 0) for p in header.get("memory", {}).get("profiles", [])]
    # Weights a profile's tactic reads in another layout are made at load: counted by Engine, not here.
    by_profile = memory_by_profile(header, weight_bytes)
    config = header.get("build_config", {})
    graph = header.get("graph", {})
    return {
        "path": str(path),
        "file_bytes": Path(path).stat().st_size,
        "format_version": FORMAT_VERSION,
        "device": header.get("device"),
        "precision": config.get("precision"),
        "int8_fallback_precision": header.get("int8_fallback_precision"),
        "fingerprint": header.get("fingerprint"),
        "fingerprint_here": _fingerprint_here(header),
        "inputs": graph.get("inputs", []),
        "outputs": graph.get("outputs", []),
        "profiles": header.get("profiles", []),
        "layers": [dict(layer, epilogue=epilogue(layer.get("attrs") or {})) for layer in header.get("layers", [])],
        "memory": {"weight_bytes": int(weight_bytes), "arena_bytes": arenas,
                   "device_bytes": max((p["total_bytes"] for p in by_profile), default=int(weight_bytes)),
                   "by_profile": by_profile, "profiles": header.get("memory", {}).get("profiles", [])},
        "provenance": header.get("provenance", {}),
        "build_config": config,
        "build_log": header.get("build_log", []),
        "tactics": header.get("tactics"),
        "planner": header.get("planner"),
        "fallback_where_faster": header.get("fallback_where_faster"),
        "preprocess": header.get("preprocess"),
        "preprocess_buckets": header.get("preprocess_buckets"),
        "input_format": header.get("input_format"),
        "nms": header.get("nms"),
        "kernels": _kernels_summary(header, tensors),
        "capture": _capture_summary(header),
        "eager_check": _eager_check_summary(header),
        "pdl": _pdl_summary(header),
        "aux_streams": _aux_streams_summary(header),
        "chains": _chains_summary(header),
        "signature": _signature_summary(engine, store),
    }


def _capture_summary(header: dict) -> dict:
    """Which layers run outside the CUDA graph (the build's trial capture, runtime/capture.py)."""
    record = header.get("capture")
    kind = (header.get("fingerprint") or {}).get("kind", "cuda")
    eager = (record or {}).get("eager_layers") or []
    if kind == "cpu":
        line = "none (CPU engine)"
    elif record is None:
        line = "not checked at build (an engine from before the trial capture)"
    elif not eager:
        line = "one CUDA graph per input shape" + ("" if record.get("checked") else " (the trial capture did not run)")
    else:
        line = f"captured in pieces: {len(eager)} layer(s) run outside the graph: {describe_eager_layers(eager)}"
    return {"eager_layers": eager, "checked": bool((record or {}).get("checked")), "text": line}


def _context_memory(row: dict) -> str:
    return (f"arena {fmt_bytes(row['arena_bytes'])} + inputs {fmt_bytes(row['input_bytes'])} + workspace "
            f"{fmt_bytes(row['workspace_bytes'])} per context; {fmt_bytes(row['total_bytes'])} with the weights")


def _nms_line(record: dict) -> str:
    """The in-engine NMS (`--nms`), as `inspect` shows it."""
    return (f"conf={record['conf']:g} iou={record['iou']:g} max_det={record['max_det']} topk={record['topk']}"
            f"{' agnostic' if record.get('agnostic') else ''} after {record['head_output']} "
            f"({record['classes']} classes)")


def _eager_check_summary(header: dict) -> dict:
    """The build's end-to-end check against the layers on their eager kernels (builder/eager_check.py)."""
    record = header.get("eager_check")
    if record is None:
        return {"profiles": [], "text": "not run (CPU, INT8/FP8, builder effort 0, --no-eager-check, or an older "
                                        "engine)"}
    parts = [f"profile {p['profile']} {p['tuned_ms']:.4g} ms against {p['eager_ms']:.4g} ms eager"
             + (": keeps the eager kernels" if p["kept"] == "eager" else "") for p in record["profiles"]]
    return {"profiles": record["profiles"], "text": "; ".join(parts)}


def _pdl_summary(header: dict) -> dict:
    """Programmatic dependent launch: asked for, refused, or timed at the build (builder/pdl.py)."""
    asked = (header.get("build_config") or {}).get("pdl")
    record = header.get("pdl_check")
    if record is not None and record.get("error"):
        return {"check": record, "text": f"off, the build could not time the engine with it ({record['error']})"}
    if record is not None:
        times = "; ".join(f"profile {p['profile']} {p['with_ms']:.4g} ms with, {p['without_ms']:.4g} ms without"
                          for p in record["profiles"])
        verdict = (f"{record['layers']} layer(s), faster by the build's timing" if record["kept"]
                   else "off, not faster by the build's timing")
        return {"check": record, "text": f"{verdict} ({times})"}
    if asked:
        return {"check": None, "text": "the layers whose kernels take part (--pdl)"}
    why = ("--no-pdl" if asked is False
           else "not timed: no quantized layer, no Hopper, builder effort 0, or an older engine")
    return {"check": None, "text": f"off ({why})"}


def _chains_summary(header: dict) -> dict:
    """The convolution chains run as one kernel (builder/conv_chains.py): how many layers, and the
    whole engines' timing that kept or dropped them."""
    layers = sum(1 for node in (header.get("graph") or {}).get("nodes", []) if node["op"] == "ConvChain")
    record = header.get("chains_check")
    asked = (header.get("build_config") or {}).get("conv_chains")
    if record is None and asked is not None:
        text = (f"{layers} layer(s), each faster than its two layers (--conv-chains: the whole engine not timed)"
                if asked else "none (--no-conv-chains)")
        return {"layers": layers, "check": None, "text": text}
    if record is None:
        return {"layers": layers, "check": None,
                "text": "none (not timed: a CPU engine, builder effort 0, no chain faster than its two layers, or an "
                        "older engine)"}
    if record.get("error"):
        return {"layers": layers, "check": record, "text": f"none, the build could not time them ({record['error']})"}
    def times(profiles: list[dict]) -> str:
        return "; ".join(f"profile {p['profile']} {p['chains_ms']:.4g} ms with, {p['apart_ms']:.4g} ms without"
                         for p in profiles)
    halves = record.get("subsets") or []
    if record.get("kept_chains"):
        (kept,) = [entry for entry in halves if entry["chains"] == record["kept_chains"]]
        return {"layers": layers, "check": record,
                "text": f"{layers} layer(s), the engine faster with them ({times(kept['profiles'])}); with all "
                        f"{sum(len(entry['chains']) for entry in halves)} it was not ({times(record['profiles'])})"}
    verdict = f"{layers} layer(s), the engine faster with them" if record["kept"] else "none, the engine not faster"
    text = f"{verdict} ({times(record['profiles'])})"
    if halves:
        text += "; nor with either half of them (" + " | ".join(times(entry["profiles"]) for entry in halves) + ")"
    return {"layers": layers, "check": record, "text": text}


def _aux_streams_summary(header: dict) -> dict:
    """The auxiliary streams the build chose for the contexts (builder/aux_streams.py)."""
    record = header.get("aux_streams")
    if record is None:
        return {"streams": 0, "check": None,
                "text": "0 (not timed: a CPU engine, builder effort 0, --max-aux-streams 0, no branches to run "
                        "beside each other, or an older engine)"}
    times = ", ".join(f"{count}: {total:.4g} ms" for count, total in record["totals_ms"].items())
    rejected = "".join(f"; {count} not used: {why}" for count, why in record.get("rejected", {}).items())
    return {"streams": record["streams"], "check": record,
            "text": f"{record['streams']} (timed by count, summed over the profiles: {times}{rejected})"}


def run(args) -> int:
    info = engine_summary(args.plan, args.trust)
    if args.json:
        print_json(info)
        return 0
    out = console()
    here = info["fingerprint_here"]
    match = "yes" if here["matches"] else f"no (differs in {', '.join(here['differs_in'])}) {here['note']}".strip()
    if not here["matches"] and here["loads"]:
        match += f"; loads at compatibility '{here['compatibility']}', with a warning"
    out.print(key_values("Engine", [
        ("file", f"{info['path']} ({fmt_bytes(info['file_bytes'])}, format v{info['format_version']})"),
        ("device", info["device"]),
        ("built for", describe(info["fingerprint"] or {})),
        ("matches this machine", match),
        ("precision", describe_precision(info)),
        ("preprocess", preprocess_line({k: info[k] for k in ("preprocess", "preprocess_buckets")})
         or "not recorded (build with --preprocess)"),
        ("input", f"raw frames {info['input_format']['text']} (N×H×W×3), preprocessed by the first layer"
         if info["input_format"] else "the model's own input"),
        ("tactics", _tactics_line(info["tactics"])),
        ("kernels", info["kernels"]["text"]),
        ("cuda graphs", info["capture"]["text"]),
        ("eager check", info["eager_check"]["text"]),
        ("programmatic launch", info["pdl"]["text"]),
        ("auxiliary streams", info["aux_streams"]["text"]),
        ("convolution chains", info["chains"]["text"]),
        ("signature", info["signature"]["text"]),
        *([("nms", _nms_line(info["nms"]))] if info["nms"] else []),
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
    layers = table("Layers", "#", "name", "op", "fused from (ONNX nodes)", "precision", "tactic",
                   "timings (fastest first)", "epilogue")
    for i, layer in enumerate(info["layers"]):
        precision = layer["precision"] + (f" ({layer['reason']})" if layer.get("reason") else "")
        layers.add_row(str(i), text(layer["name"]), text(layer["op"]), text(", ".join(layer.get("origin") or [])),
                       text(precision), text(layer.get("tactic")), text(tactic_timings(layer)),
                       text(layer["epilogue"]))
    out.print(layers)
    differing = [(layer["name"], profile_tactics(layer)) for layer in info["layers"] if profile_tactics(layer)]
    if differing:
        out.print("[bold]Tactics per profile[/] (layers whose profiles run different tactics)")
        for name, line in differing:
            out.print(text(f"  {name}: {line}"))
    memory = info["memory"]
    total = (f"{fmt_bytes(memory['device_bytes'])} (one context; each more adds "
             f"{fmt_bytes(memory['device_bytes'] - memory['weight_bytes'])})")
    out.print(key_values("Memory", [("weights", fmt_bytes(memory["weight_bytes"]))]
                         + [(f"profile {p['profile']} at max shapes", _context_memory(p)) for p in memory["by_profile"]]
                         + [("device total", total)]))
    if info["planner"]:
        print_planner(out, info["planner"])
    if info["fallback_where_faster"]:
        print_fallback_where_faster(out, info["fallback_where_faster"])
    prov = info["provenance"]
    if prov.get("calibration"):
        print_calibration(out, prov["calibration"])
    out.print(key_values("Provenance", [(k, v) for k, v in prov.items() if k != "calibration"]
                         + ([("calibration", "see Calibration above")] if prov.get("calibration") else [])))
    if info["build_log"]:
        out.print("[bold]Build log[/]")
        for line in info["build_log"]:
            out.print(text(f"  {line}"))
    return 0
