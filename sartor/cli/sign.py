"""`sartor sign ENGINE --key KEY [-o OUT]`: sign an engine file with an Ed25519 private key."""
from __future__ import annotations

from ..deploy.signing import sign_engine
from .common import console, text

DESCRIPTION = ("Sign an engine file with an Ed25519 private key (from `sartor keygen`): its checksum is checked, "
               "any signature it had is replaced, and the payload is left as it is. Devices with a trust store "
               "(`--trust DIR`, SARTOR_TRUST) load only engines signed by its keys.")


def add_parser(subparsers, parents) -> None:
    p = subparsers.add_parser("sign", parents=parents, help="Sign an engine file", description=DESCRIPTION)
    p.add_argument("engine", metavar="ENGINE", help="the engine file")
    p.add_argument("--key", required=True, metavar="KEY", help="the private key file")
    p.add_argument("-o", "--output", metavar="OUT", help="write the signed engine here (default: in place)")
    p.set_defaults(func=run)


def run(args) -> int:
    signed = sign_engine(args.engine, args.key, args.output)
    replaced = f", replacing the signature by {signed.replaced}" if signed.replaced else ""
    console().print(text(f"signed {signed.output} with key {signed.fingerprint}{replaced}"))
    return 0
