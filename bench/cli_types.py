"""Argument types shared by the benches."""
from __future__ import annotations

import argparse

SETTINGS = {"off": False, "on": True}


def on_off_list(text: str) -> list[bool | None]:
    """`off,on` (either, both, in order) → [False, True]; empty → [None] (the builder's default).
    Any other word is refused by argparse in one line."""
    words = [word for word in text.split(",") if word]
    unknown = [word for word in words if word not in SETTINGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{','.join(unknown)}: expected a comma-separated list of off and on")
    return [SETTINGS[word] for word in words] or [None]
