"""`sartor deploy ENGINE_OR_BUNDLE --root DIR --name MODEL`: a new release on this device,
preflighted, swapped in atomically, watched and rolled back on failure (sartor/deploy/update.py);
`sartor deploy --check --root DIR --name MODEL`: make `current` a release that runs on this machine.

Exit status: 0 the release is current (and passed its watch); 1 it failed preflight (never swapped
in: the previous release keeps serving) or its health watch (rolled back), or --check found no
release that runs here; 2 a usage error (no such file, not a bundle, another deploy running).
"""
from __future__ import annotations

import math

from ..deploy.golden import DEFAULT_MIN_COSINE
from ..deploy.preflight import DEFAULT_TAKT_RUNS
from ..deploy.releases import ReleaseError
from ..deploy.update import DeployOptions, check_current, deploy
from ..errors import ConfigError
from .common import add_trust_arg, console, print_json, table, text

DESCRIPTION = ("Deploy an engine (or a provenance bundle) as a new release of a model under --root: copied into "
               "DIR/MODEL/releases/<id>/, preflighted on this device (signature, fingerprint, load, warm-up, golden "
               "outputs, steady-state takt), swapped in as DIR/MODEL/current by one rename, then, with --server "
               "and --watch, watched on the running `sartor serve` and rolled back if it fails. `sartor serve "
               "--model-repository DIR` serves each model's current release.")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("deploy", parents=parents, help="Deploy a release with preflight, swap and rollback",
                              description=DESCRIPTION)
    p.add_argument("source", nargs="?", metavar="ENGINE_OR_BUNDLE",
                   help="an engine file, or a bundle from `sartor build --bundle` (directory or .tar)")
    p.add_argument("--root", required=True, metavar="DIR", help="the release root (a model repository)")
    p.add_argument("--name", required=True, metavar="MODEL", help="the model's name (its directory under --root)")
    p.add_argument("--engine", metavar="PLAN", help="a bundle's engine file (default: the file engine.json names, "
                                                     "beside the bundle directory)")
    p.add_argument("--bundle", metavar="BUNDLE", help="an engine's bundle: its golden outputs are then checked")
    p.add_argument("--check", action="store_true",
                   help="deploy nothing: make current a release that runs on this machine (itself, the one known "
                        "good for this fingerprint, or the newest that runs here), as at start-up")
    p.add_argument("--allow-rebuild", action="store_true",
                   help="when no release runs here (--check) or a bundle comes without its engine: build the "
                        "engine here from the bundle, then preflight it")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the kind the engine was built for)")
    add_trust_arg(p)
    p.add_argument("--min-cosine", type=float, default=DEFAULT_MIN_COSINE, metavar="C",
                   help=f"the tolerance of the golden check: every golden output's cosine against the bundle's "
                        f"stored output must reach C (default {DEFAULT_MIN_COSINE})")
    p.add_argument("--takt-runs", type=int, default=DEFAULT_TAKT_RUNS, metavar="N",
                   help=f"steady-state inferences timed by preflight (default {DEFAULT_TAKT_RUNS})")
    p.add_argument("--server", metavar="URL", help="the running `sartor serve` (its HTTP address, e.g. "
                                                   "127.0.0.1:8000) whose health decides the release")
    p.add_argument("--watch", type=float, default=0.0, metavar="SECONDS",
                   help="after the swap, the server must serve the new release, ready, for this long; else the "
                        "previous release is restored (needs --server; default 0: no watch)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def _options(args) -> DeployOptions:
    if not 0.0 < args.min_cosine <= 1.0:
        raise ConfigError(f"--min-cosine {args.min_cosine:g} must be in (0, 1]")
    if args.takt_runs < 1:
        raise ConfigError(f"--takt-runs {args.takt_runs} must be at least 1")
    if not (math.isfinite(args.watch) and args.watch >= 0):
        raise ConfigError(f"--watch {args.watch:g} must be a number of seconds ≥ 0")
    return DeployOptions(device=args.device, trust=args.trust, compatibility=getattr(args, "compatibility", None),
                         min_cosine=args.min_cosine, takt_runs=args.takt_runs, server=args.server,
                         watch_seconds=args.watch, allow_rebuild=args.allow_rebuild)


def run(args) -> int:
    options = _options(args)
    out = console()
    say = (lambda line: None) if args.json else (lambda line: out.print(text(line), soft_wrap=True))
    if args.check:
        if args.source:
            raise ConfigError("--check deploys nothing: give no ENGINE_OR_BUNDLE")
        try:
            result = check_current(args.root, args.name, options, say)
        except ReleaseError as exc:
            if args.json:
                print_json({"passed": False, "error": str(exc)})
            else:
                out.print(text(f"FAIL: {exc}"), soft_wrap=True)
            return 1
        if args.json:
            print_json({"passed": True, "release": result.release, "note": result.note})
        else:
            out.print(text(result.note or f"{args.name}: current release {result.release} runs on this machine"),
                      soft_wrap=True)
        return 0
    if not args.source:
        raise ConfigError("give ENGINE_OR_BUNDLE to deploy, or --check")
    report = deploy(args.source, args.root, args.name, options, engine=args.engine, bundle=args.bundle, say=say)
    if args.json:
        print_json(report.to_json())
        return 0 if report.passed else 1
    checked = report.preflight
    if checked is not None:
        rows = table(f"Preflight of release {report.release} on {checked.device or 'this device'} "
                     f"({checked.seconds:.1f} s)", "check", "result", "s", "detail")
        for check in checked.checks:
            rows.add_row(text(check.name), "[green]PASS[/]" if check.passed else "[red]FAIL[/]",
                         f"{check.seconds:.2f}", text(check.detail))
        out.print(rows)
    if checked is not None and not checked.passed:
        failure = checked.failure
        kept = f"release {report.previous} stays current" if report.previous else "nothing was swapped in"
        out.print(text(f"FAIL: release {report.release} failed preflight ({failure.name}: {failure.detail}); {kept}"),
                  soft_wrap=True)
        return 1
    if report.watch is not None and not report.watch.passed:
        restored = (f"rolled back to release {report.previous}" if report.rolled_back else
                    "no previous release to roll back to: it stays current")
        out.print(text(f"FAIL: release {report.release} failed its health watch ({report.watch.detail}); "
                       f"{restored}"), soft_wrap=True)
        return 1
    watched = f"; {report.watch.detail}" if report.watch is not None else ""
    out.print(text(f"PASS: {args.name} release {report.release} is current{watched}"
                   + ("; known good for this machine" if report.known_good else "")), soft_wrap=True)
    return 0
