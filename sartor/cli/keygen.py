"""`sartor keygen -o KEY`: a new Ed25519 key pair for signing engines (KEY and KEY.pub)."""
from __future__ import annotations

from ..deploy.signing import generate_key, public_key_path
from .common import console, text

DESCRIPTION = ("Write a new Ed25519 signing key pair: KEY (private, PEM, mode 0600) and KEY.pub (public, PEM) for "
               "devices' trust stores (`--trust DIR`, SARTOR_TRUST).")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("keygen", parents=parents, help="Write a new engine signing key pair",
                              description=DESCRIPTION)
    p.add_argument("-o", "--output", required=True, metavar="KEY", help="the private key file (KEY.pub beside it)")
    p.add_argument("--force", action="store_true", help="replace an existing key pair")
    p.set_defaults(func=run)


def run(args) -> int:
    fingerprint = generate_key(args.output, overwrite=args.force)
    out = console()
    out.print(text(f"wrote {args.output} (private, mode 0600) and {public_key_path(args.output)} (public)"))
    out.print(text(f"key fingerprint {fingerprint}"))
    return 0
