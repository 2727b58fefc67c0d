"""`sartor infer PLAN INPUT... -o RESULTS.parquet|.jsonl [--ray]`: an engine over image files, in this
process or over every GPU of a Ray cluster, results (detections or outputs by name) to one file.

Both ways run the same `SartorPredictor` (sartor.integrations.ray_data) over the same batches, so a
`--ray` run writes what the single process writes (docs/decisions/0046-infer-on-ray.md)."""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..extras import require_extra
from ..integrations.ray_data import DECODERS, SartorPredictor
from ..integrations.ray_infer import INDEX, path_blocks
from ..pipeline.benchmark import IMAGE_SUFFIXES
from ..runtime.engine_file import check_writable, read_engine, write_atomic
from ..runtime.fingerprint import ENVIRONMENT as FINGERPRINT_ENVIRONMENT
from ..runtime.profiles import Profile
from .common import add_trust_arg, console, text

DESCRIPTION = ("Run an engine over image files (folders, files, .txt listings) in this process, or with --ray "
               "over every GPU of a Ray cluster, and write each image's detections or outputs to Parquet or JSON "
               "Lines.")
FORMATS = (".parquet", ".jsonl")
DEFAULT_BATCH = 32  # the Pipeline's own default (choose_batch), so that both paths cut the same batches


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("infer", parents=parents, help=DESCRIPTION.split(",")[0], description=DESCRIPTION)
    p.add_argument("plan", metavar="PLAN", help="the engine file (with --ray: at the same path on every node)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="an image file, a folder (its images, below it too, sorted) or a .txt listing (one path a "
                        "line, relative to the listing's folder)")
    p.add_argument("-o", "--output", required=True, metavar="RESULTS",
                   help="a .parquet or .jsonl file (written atomically): one row per image, its path, then "
                        "boxes/scores/classes (detections) or each output by name")
    p.add_argument("--batch-size", type=int, metavar="N",
                   help=f"images per engine run (default: the engine's max batch, at most {DEFAULT_BATCH})")
    p.add_argument("--decoder", choices=DECODERS, default="auto",
                   help="auto: detections when the engine was built with --nms, else outputs; yolo: decode a raw "
                        "YOLO head with --conf/--iou/--max-det; none: outputs as they come")
    p.add_argument("--conf", type=float, default=0.25, help="--decoder yolo: score threshold (default 0.25)")
    p.add_argument("--iou", type=float, default=0.7, help="--decoder yolo: NMS IoU threshold (default 0.7)")
    p.add_argument("--max-det", type=int, default=300, help="--decoder yolo: detections per image (default 300)")
    p.add_argument("--skip-bad", action="store_true",
                   help="write an unreadable image as a row with its error (and no outputs) instead of stopping")
    p.add_argument("--device", help="cpu or cuda[:N], in this process (default: CUDA when there is a GPU); with "
                                    "--ray each actor runs the engine's own device kind")
    add_trust_arg(p)
    ray = p.add_argument_group("Ray (needs the ray extra)")
    ray.add_argument("--ray", action="store_true",
                     help="run on a Ray cluster through Ray Data: one actor per GPU for a CUDA engine "
                          "(num_gpus=1), per CPU for a CPU engine")
    ray.add_argument("--ray-address", metavar="ADDR",
                     help="the cluster (e.g. 10.0.0.5:6379, or 'local' for a new one here; default: $RAY_ADDRESS, "
                          "else a running local cluster, else a new one)")
    ray.add_argument("--concurrency", type=int, metavar="N", help="actors (default: one per GPU, or per CPU)")
    ray.add_argument("--ray-batches", type=int, default=8, metavar="K",
                     help="engine batches per Ray batch (default 8): an actor decodes the next batch while one "
                          "runs only inside a Ray batch")
    p.set_defaults(func=run)


def image_paths(inputs: list[str]) -> list[str]:
    """Every image the inputs name, in order; a missing input or none at all is refused."""
    paths: list[str] = []
    for name in inputs:
        where = Path(name)
        if where.is_dir():
            found = sorted(str(p) for p in where.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
            if not found:
                raise ConfigError(f"{name}: no image files ({', '.join(IMAGE_SUFFIXES)}) in this folder")
            paths += found
        elif where.suffix.lower() == ".txt" and where.is_file():
            lines = [line.strip() for line in where.read_text().splitlines()]
            listed = [str(where.parent / line) for line in lines if line and not line.startswith("#")]
            if not listed:
                raise ConfigError(f"{name}: the listing names no image")
            paths += listed
        elif where.is_file():
            paths.append(name)
        else:
            raise ConfigError(f"{name}: no such file or folder")
    return paths


def default_batch(header: dict) -> int:
    """The batch every profile admits, at most DEFAULT_BATCH (the driver of a --ray run may have no GPU
    to load a CUDA engine on and ask it, so it reads the profiles)."""
    highest = [r.max[0] for p in header["profiles"] for r in Profile.from_json(p).shapes.values() if len(r.max) == 4]
    return min([DEFAULT_BATCH, *highest])


def run(args) -> int:
    suffix = Path(args.output).suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(f"--output {args.output}: write .parquet or .jsonl")
    if suffix == ".parquet":
        require_extra("ray", "writing .parquet", ("pyarrow",))
    check_writable(args.output)
    if args.batch_size is not None and args.batch_size < 1 or args.ray_batches < 1:
        raise ConfigError("--batch-size and --ray-batches count from 1")
    if not args.ray and (args.ray_address or args.concurrency):
        raise ConfigError("--ray-address and --concurrency choose a Ray cluster's actors: add --ray")
    paths = image_paths(args.inputs)
    header = read_engine(args.plan, None).header  # a missing or corrupt engine is refused here, once
    batch = args.batch_size or default_batch(header)
    rows_per_batch = batch * args.ray_batches
    options = {"column": "path", "batch_size": batch, "decoder": args.decoder, "conf": args.conf, "iou": args.iou,
               "max_det": args.max_det, "skip_bad": args.skip_bad, "trust": args.trust,
               "compatibility": os.environ.get(FINGERPRINT_ENVIRONMENT)}
    out = console(stderr=True)
    started = time.perf_counter()
    if args.ray:
        from ..integrations.ray_infer import actors_for, cluster, infer_on_ray
        ray = cluster(args.ray_address)
        kind = (header.get("fingerprint") or {}).get("kind", "cuda")
        actors, gpus = actors_for(ray, kind, args.concurrency)
        out.print(text(f"{len(paths)} images over {actors} {'GPU' if gpus else 'CPU'} actor(s) of the Ray cluster"))
        batches = infer_on_ray(ray, str(Path(args.plan).resolve()), [str(Path(p).resolve()) for p in paths],
                               rows_per_batch=rows_per_batch, actors=actors, gpus_per_actor=gpus,
                               predictor_options=options)
    else:
        predictor = SartorPredictor(args.plan, device=args.device, **options)
        batches = [predictor({"path": np.array(block, dtype=object), INDEX: index})
                   for block, index in path_blocks(paths, rows_per_batch)]
    seconds = time.perf_counter() - started
    rows = sorted((row for b in batches for row in _records(b)), key=lambda r: r[INDEX])
    for row in rows:
        row["path"] = paths[row.pop(INDEX)]  # as listed, not the absolute name the actors read
    write_atomic(args.output, (_parquet if suffix == ".parquet" else _jsonl)(rows))
    failed = sum(1 for r in rows if r.get("error"))
    out.print(text(f"wrote {len(rows)} row(s) to {args.output}" + (f", {failed} image(s) failed" if failed else "")
                   + f": {len(rows) / seconds:.1f} images/s over {seconds:.1f} s"))
    return 0


def _records(batch: dict) -> list[dict]:
    """A batch of columns as one dict per row, path first; a failed row's outputs None."""
    names = ["path", *(n for n in batch if n != "path")]
    count = len(batch[INDEX])
    rows = [{name: batch[name][i] for name in names if name in batch} for i in range(count)]
    for row in rows:
        if "error" in row and not isinstance(row["error"], str):
            row["error"] = None  # Ray brings a column of None back as NaN
        if row.get("error") is not None:
            row.update({name: None for name in row if name not in ("path", "error", INDEX)})
    return rows


def _plain(value):
    """A row's value as JSON/Arrow take it: arrays as (nested) lists, numpy scalars as Python's."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps({k: _plain(v) for k, v in row.items()}) + "\n" for row in rows).encode()


def _parquet(rows: list[dict]) -> bytes:
    """Arrays as list columns of their own dtype (float32 stays float32), nested as deep as they are."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    columns = {}
    for name in (rows[0] if rows else {}):
        values = [row[name] for row in rows]
        sample = next((v for v in values if isinstance(v, np.ndarray)), None)
        kind = None
        if sample is not None:
            kind = pa.from_numpy_dtype(sample.dtype)
            for _ in range(sample.ndim):
                kind = pa.list_(kind)
        columns[name] = pa.array([_plain(v) for v in values], type=kind)
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()
