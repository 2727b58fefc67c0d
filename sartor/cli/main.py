"""`sartor` entry point: subcommands, and one policy for errors.

Exit status: 0 success; 1 a check failed (compare over tolerance, validate over --max-drop); 2 a
usage error or any SartorError (printed as one `error: ...` line); 3 an internal error (a bug: one
`internal error:` line). --verbose adds the traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback

from ..errors import MissingExtraError, SartorError
from ..runtime.fingerprint import ENVIRONMENT as FINGERPRINT_ENVIRONMENT
from ..runtime.fingerprint import LEVELS as COMPATIBILITY_LEVELS
from ..version import __version__

# One module per subcommand, of the same name, in the order `sartor --help` lists them.
COMMANDS = ("build", "rebuild", "deploy", "run", "infer", "inspect", "compare", "validate", "bench", "serve",
            "sensitivity", "keygen", "sign")
EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


def _command_modules() -> list:
    """Each subcommand's module, or the MissingExtraError its import raised: on a runtime install
    `sartor build` and `sartor serve` still parse, and say which extra to install."""
    modules = []
    for name in COMMANDS:
        try:
            modules.append(importlib.import_module(f".{name}", __package__))
        except MissingExtraError as exc:
            modules.append(exc.for_feature(f"sartor {name}"))
    return modules


def _add_missing(subparsers, name: str, missing: MissingExtraError) -> None:
    """A subcommand whose extra is not installed: any arguments, and its one-line error when run."""
    p = subparsers.add_parser(name, add_help=False, help=f"(needs the {missing.extra} extra: "
                              f"pip install 'sartor[{missing.extra}]')")
    p.add_argument("arguments", nargs=argparse.REMAINDER)

    def refuse(args):
        raise missing
    p.set_defaults(func=refuse, missing_extra=missing)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sartor", description="Compile ONNX vision models into engines "
                                     "tailored to one device, and run, inspect, compare and time them.")
    parser.add_argument("-V", "--version", action="version", version=f"sartor {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks on errors")
    # --verbose is accepted after the subcommand as well; SUPPRESS keeps the top-level value otherwise.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors")
    for p in (parser, common):
        p.add_argument("--compatibility", choices=COMPATIBILITY_LEVELS, default=argparse.SUPPRESS,
                       help="which differences between an engine's fingerprint and this machine refuse a load: "
                            "strict (any), default (device, GPU model, toolkit major.minor; driver and patch "
                            "versions only warn), loose (only device kind, architecture, compute capability); "
                            f"sets ${FINGERPRINT_ENVIRONMENT}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in zip(COMMANDS, _command_modules()):
        if isinstance(command, MissingExtraError):
            _add_missing(subparsers, name, command)
        else:
            command.add_parser(subparsers, [common])
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def _compatibility(level: str | None):
    """--compatibility as $SARTOR_FINGERPRINT, which every load reads (the server's engine processes
    too), for this command only."""
    previous = os.environ.get(FINGERPRINT_ENVIRONMENT)
    if level is not None:
        os.environ[FINGERPRINT_ENVIRONMENT] = level
    try:
        yield
    finally:
        if level is not None:
            if previous is None:
                del os.environ[FINGERPRINT_ENVIRONMENT]
            else:
                os.environ[FINGERPRINT_ENVIRONMENT] = previous


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    try:
        # parse_args, except that a subcommand whose extra is missing takes any arguments (--help too)
        args, unknown = parser.parse_known_args(argv)
        if unknown and getattr(args, "missing_extra", None) is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # usage errors (2), --help and --version (0)
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (serve --systemd-unit repeats it)
    verbose = getattr(args, "verbose", False)
    try:
        with _compatibility(getattr(args, "compatibility", None)):
            return args.func(args)
    except SartorError as exc:
        if verbose:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        message = _one_line(exc) or "(no message)"
        print(f"internal error: {type(exc).__name__}: {message} (rerun with --verbose for the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
