"""`sartor rebuild BUNDLE -o OUT`: rebuild a bundle's engine on this machine.

Exit status 0 when the rebuild is the bundle's engine byte for byte (same machine) or, after a
toolkit or device change, when every golden output agrees with the stored one (cosine at least
--min-cosine) and, for bundles with labelled validation data, the task metric dropped by at most
--max-drop; 1 when not; 2 for a bundle that is missing, malformed or modified.
"""
from __future__ import annotations

from ..deploy import rebuild as run_rebuild
from ..deploy.accuracy import DEFAULT_MAX_DROP
from ..deploy.golden import DEFAULT_MIN_COSINE
from ..errors import ConfigError
from ..progress import ProgressReport
from .common import console, fmt_float, print_json, table, text

DESCRIPTION = ("Rebuild the engine of a provenance bundle (`sartor build --bundle`) on this machine, from its "
               "model, options, calibration cache and timing cache; on the machine that made it the engine is "
               "the same file, elsewhere its golden outputs are compared with the stored ones.")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("rebuild", parents=parents, help="Rebuild a bundle's engine on this machine",
                              description=DESCRIPTION)
    p.add_argument("bundle", metavar="BUNDLE", help="the bundle `sartor build --bundle` wrote (a directory, or its .tar)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.plan", help="where to write the rebuilt engine")
    p.add_argument("--device", help="cpu or cuda[:N] (default: the bundle's build option, else cuda when available)")
    p.add_argument("--min-cosine", type=float, default=DEFAULT_MIN_COSINE, metavar="C",
                   help=f"after a toolkit or device change: every golden output's cosine against the stored "
                        f"engine's must reach C (default {DEFAULT_MIN_COSINE})")
    p.add_argument("--max-drop", type=float, default=DEFAULT_MAX_DROP, metavar="X",
                   help=f"bundles with labelled validation data: the rebuilt engine's task metric may be at most X "
                        f"below the bundled engine's, overall and per split (default {DEFAULT_MAX_DROP})")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 0.0 < args.min_cosine <= 1.0:  # also refuses NaN
        raise ConfigError(f"--min-cosine {args.min_cosine:g} must be in (0, 1]")
    if not 0.0 <= args.max_drop < float("inf"):
        raise ConfigError(f"--max-drop {args.max_drop:g} must be a finite value ≥ 0")
    with ProgressReport("rebuild") as progress:  # the build's stages and layers, on stderr
        report = run_rebuild(args.bundle, args.output, device=args.device, min_cosine=args.min_cosine,
                             max_drop=args.max_drop, progress=progress, warn=progress.print)
    if args.json:
        print_json(report.to_json())
        return 0 if report.passed else 1
    out = console()
    if report.same_machine:
        out.print(text(f"same machine: every tactic from the bundle's timing cache ({report.timed} layer(s) timed)"))
        verdict = ("identical to the bundle's engine" if report.identical else
                   f"DIFFERS from the bundle's engine ({report.bundle_sha256[:16]}…) in "
                   f"{', '.join(report.differing_fields)}")
        out.print(text(f"{report.output}: sha256 {report.sha256[:16]}… {verdict}"))
    else:
        out.print(text(f"re-timed {report.timed} layer(s): {report.why_retimed}"))
        out.print(text(f"{report.output}: sha256 {report.sha256[:16]}… (the bundle's engine: "
                       f"{report.bundle_sha256[:16]}…)"))
    rows = table(f"Golden outputs ({report.golden_inputs}): rebuilt engine vs the bundle's, min cosine "
                 f"{report.min_cosine:g}", "output", "max abs", "cosine", "vs FP32 max abs", "vs FP32 cosine",
                 "bundle's vs FP32 cosine", "result")
    for row in report.agreement:
        rows.add_row(text(row.name), fmt_float(row.max_abs), fmt_float(row.cosine, ".6f"),
                     fmt_float(row.reference_max_abs), fmt_float(row.reference_cosine, ".6f"),
                     fmt_float(row.stored_reference_cosine, ".6f"),
                     "[green]PASS[/]" if row.passed else "[red]FAIL[/]")
    out.print(rows)
    accuracy = report.accuracy
    if accuracy is not None:
        out.print(text(f"validation {accuracy.metric}: rebuilt {fmt_float(accuracy.rebuilt, '.4f')}, bundled "
                       f"{fmt_float(accuracy.bundled, '.4f')}, FP32 {fmt_float(accuracy.reference, '.4f')}; drop "
                       f"{fmt_float(accuracy.drop, '.4f')} (max {accuracy.max_drop:g})"
                       + "".join(f"; {name} {fmt_float(s['rebuilt'], '.4f')} (bundled {fmt_float(s['bundled'], '.4f')})"
                                 for name, s in accuracy.splits.items())))
    if report.passed:
        out.print(text("PASS: " + ("the same engine file" if report.same_machine else
                                   f"all {len(report.agreement)} golden output(s) agree")))
        return 0
    failed = [row.name for row in report.agreement if not row.passed]
    if report.same_machine and not report.identical:
        out.print(text("FAIL: the rebuilt engine is not the bundle's byte for byte"))
    if failed:
        out.print(text(f"FAIL: {len(failed)} golden output(s) below cosine {report.min_cosine:g}: {', '.join(failed)}"))
    if accuracy is not None and not accuracy.passed:
        out.print(text(f"FAIL: the validation {accuracy.metric} dropped by more than {accuracy.max_drop:g}"))
    return 1
