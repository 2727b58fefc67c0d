"""`sartor serve --model-repository DIR`: a KServe v2 / Triton-compatible inference server (HTTP/REST,
gRPC, Prometheus metrics) with dynamic batching, version polling and hot swap. See sartor/serve/."""
from __future__ import annotations

import logging
import signal
import sys
import threading

from ..errors import ConfigError, SartorError
from ..serve.notify import UNIT_FLAG, Watchdog, notify, systemd_unit, watchdog_interval
from .common import add_trust_arg, console, print_json, table, text

DESCRIPTION = ("Serve the engines of a Triton-layout model repository (<repo>/<model>/<version>/model.plan, "
               "optional <repo>/<model>/config.pbtxt) or of a release root (`sartor deploy`: "
               "<repo>/<model>/current) over KServe v2 HTTP/REST and gRPC, with dynamic batching and Prometheus "
               "metrics. Under systemd it sends READY=1 once every model is warm, WATCHDOG=1 pings and STOPPING=1 "
               "on SIGTERM ($NOTIFY_SOCKET).")


def _port(text_value: str) -> int | None:
    value = int(text_value)
    return None if value < 0 else value


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("serve", parents=parents, help="Serve engines over KServe v2 HTTP and gRPC",
                              description=DESCRIPTION)
    p.add_argument("--model-repository", required=True, metavar="DIR", help="the model repository")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--http-port", type=_port, default=8000, help="HTTP/REST port (default 8000; 0 any free; -1 off)")
    p.add_argument("--grpc-port", type=_port, default=8001, help="gRPC port (default 8001; 0 any free; -1 off)")
    p.add_argument("--metrics-port", type=_port, default=8002, help="Prometheus /metrics port (default 8002; -1 off)")
    p.add_argument("--device", metavar="cpu|cuda:0,cuda:1",
                   help="devices the instances run on (default: each engine on the kind it was built for, cuda:0)")
    p.add_argument("--poll-interval", type=float, default=5.0, metavar="SECONDS",
                   help="scan the repository for new versions and models this often (default 5; 0 off)")
    p.add_argument("--max-queue-size", type=int, default=1024,
                   help="requests queued per model before new ones are refused with 503/UNAVAILABLE (default 1024)")
    p.add_argument("--request-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="default request timeout; a request's `timeout` parameter (microseconds) overrides it "
                        "(default 60; 0 none)")
    p.add_argument("--max-request-bytes", type=int, default=64 << 20,
                   help="largest request body accepted (default 64 MiB)")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="device memory all models together may take on each device, e.g. 8G (K/M/G/T: powers "
                        "of 1024): a model that would not fit (weights + instance_group count x its context at the "
                        "largest profile) is unavailable with the numbers, the others serve (default: no limit)")
    p.add_argument("--frontends", type=int, default=1, metavar="N",
                   help="HTTP and gRPC in N processes sharing the ports, feeding this one (default 1: in this "
                        "process; 1..64)")
    p.add_argument("--engine-processes", type=int, default=1, metavar="K",
                   help="K processes, each with its own engine instances, batchers and N frontend processes, on "
                        "the same ports: the per-request work of one process spread over K (default 1; 1..16; "
                        "K > 1 needs --frontends 2 or more and holds every engine K times)")
    add_trust_arg(p)
    p.add_argument("--allow-rebuild", action="store_true",
                   help="a release root's model none of whose releases runs on this machine is rebuilt from its "
                        "current release's bundle at start (and preflighted), instead of staying unavailable")
    p.add_argument(UNIT_FLAG, action="store_true",
                   help="print a systemd unit that runs this command (Type=notify, WatchdogSec, Restart=always) "
                        "and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="load and warm up every model, print the repository index, then exit (1 if any model is "
                        "unavailable)")
    p.add_argument("--json", action="store_true",
                   help="with --dry-run: print the repository index as one JSON document (logs go to stderr)")
    p.set_defaults(func=run)


def _devices(spec: str | None) -> list[str] | None:
    if not spec:
        return None
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    if not devices:
        raise ConfigError(f"--device {spec!r} names no device")
    return devices  # checked against this machine by ServeOptions


def _index_table(server):
    rows = table("Models", "model", "version", "state", "reason")
    for row in server.index():
        rows.add_row(text(row["name"]), text(row["version"]), text(row["state"]), text(row["reason"]))
    return rows


def run(args) -> int:
    if args.json and not args.dry_run:
        raise ConfigError("--json goes with --dry-run (a running server reports through its HTTP and gRPC APIs)")
    if args.systemd_unit:
        sys.stdout.write(systemd_unit([str(a) for a in args.argv]))
        return 0
    try:
        from ..serve import Server, ServeOptions
        from ..serve.memory_budget import parse_size
    except ImportError as exc:
        raise SartorError(f"sartor serve needs its extra dependencies ({exc.name} is missing): "
                          f"pip install 'sartor[serve]'") from None
    options = ServeOptions(model_repository=args.model_repository, host=args.host,
                           http_port=None if args.dry_run else args.http_port,
                           grpc_port=None if args.dry_run else args.grpc_port,
                           metrics_port=None if args.dry_run else args.metrics_port,
                           devices=_devices(args.device), poll_interval=args.poll_interval or None,
                           max_queue_size=args.max_queue_size, request_timeout=args.request_timeout or None,
                           max_request_bytes=args.max_request_bytes, frontends=args.frontends,
                           engine_processes=args.engine_processes, trust=args.trust,
                           memory_budget=parse_size(args.memory_budget, "--memory-budget") if args.memory_budget else None,
                           allow_rebuild=args.allow_rebuild)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    out = console()
    server = Server(options)
    if args.dry_run:
        server.repository.load_all()
        index = server.repository.index()
        unavailable = [r for r in index if r["state"] != "READY"]
        if args.json:
            print_json({"schema": "sartor-serve-dry-run/1", "model_repository": str(args.model_repository),
                        "ready": not unavailable, "models": index})
        else:
            out.print(_index_table(server))
        server.repository.shutdown()
        return 1 if unavailable else 0

    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    watchdog = None
    try:
        server.start()  # returns once every model is loaded and warmed up
        out.print(_index_table(server))
        endpoints = [f"{label} {options.host}:{port}" for label, port in
                     (("HTTP", server.http_port), ("gRPC", server.grpc_port), ("metrics", server.metrics_port))
                     if port is not None]
        out.print(text("serving on " + ", ".join(endpoints) + " (Ctrl-C stops)"))
        sys.stdout.flush()
        ready = sum(1 for row in server.index() if row["state"] == "READY")
        notify(f"READY=1\nSTATUS=serving {ready} model version(s) on " + ", ".join(endpoints))
        interval = watchdog_interval()
        if interval is not None:
            watchdog = Watchdog(interval, server.answers).start()
        while not stop.wait(0.5):
            pass
        notify("STOPPING=1\nSTATUS=draining queued requests")
        out.print(text("stopping: draining queued requests"))
    finally:
        if watchdog is not None:
            watchdog.stop()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
