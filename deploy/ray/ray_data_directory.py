"""Run an engine over every image of a directory (or a Parquet listing of paths) on a Ray cluster,
one actor per GPU, and write the results as Parquet.

    python deploy/ray/ray_data_directory.py yolov8n.plan frames/ results/            # every GPU
    python deploy/ray/ray_data_directory.py model.plan listing.parquet results/ --column path
    python deploy/ray/ray_data_directory.py model.plan frames/ results/ --num-cpus 2  # local, CPU

On a cluster, start it where `ray.init()` finds the cluster (RAY_ADDRESS); the engine file must be
readable at the same path on every node (a shared volume) and here (it is checked before the
run), and built for the nodes' GPU."""
from __future__ import annotations

import argparse
import re
import sys

import ray

from sartor.errors import SartorError
from sartor.integrations.ray_data import SartorPredictor
from sartor.runtime.engine_file import read_engine


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine")
    parser.add_argument("source", help="a directory of images, or a Parquet file with a column of paths")
    parser.add_argument("output", help="a directory for the Parquet results")
    parser.add_argument("--column", default="path", help="the Parquet listing's column of paths")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--actors", type=int, default=None, help="default: one per GPU (or 1 on the CPU)")
    parser.add_argument("--num-cpus", type=int, default=None, help="start a local Ray with this many CPUs")
    args = parser.parse_args(argv)
    read_engine(args.engine)  # a missing or corrupt engine is refused here, not once per actor
    if args.num_cpus is not None:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    actors = args.actors or max(gpus, 1)
    if args.source.endswith(".parquet"):
        ds = ray.data.read_parquet(args.source, columns=[args.column])
    else:
        # Paths only: each actor reads its own files, so the driver never holds the images.
        ds = ray.data.read_binary_files(args.source, include_paths=True).drop_columns(["bytes"])
        args.column = "path"
    ds = ds.map_batches(SartorPredictor, fn_constructor_args=(args.engine,),
                        fn_constructor_kwargs={"column": args.column, "batch_size": args.batch_size},
                        batch_size=args.batch_size, concurrency=actors, num_gpus=1 if gpus else 0,
                        batch_format="numpy")
    ds.write_parquet(args.output)
    print(f"wrote {args.output} with {actors} actor(s) on {gpus or 'no'} GPU(s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SartorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (ray.exceptions.RayError, ray.data.exceptions.UserCodeException) as exc:
        # Raised inside an actor (a bad image, a batch size the engine refuses): Ray passes it on as
        # text inside its own error, whose last sartor line is the one to show.
        found = re.findall(r"sartor\.errors\.\w+: (.+)", str(exc))
        if not found:
            raise
        print(f"error: {found[-1]}", file=sys.stderr)
        sys.exit(2)
