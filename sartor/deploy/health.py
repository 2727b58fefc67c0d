"""The health watch after a swap: the running `sartor serve` (its HTTP endpoint, `--server URL`) must
report the model ready at the new release's version within the watch, and stay ready until it ends.

Polled every `interval` seconds: `GET /v2/models/MODEL` (the version served) and
`GET /v2/models/MODEL/ready`. The release fails its watch when the server has not switched to it
when the watch ends (it refused to load it, or never saw it), or when, once switched, the model is
not ready (or the server does not answer) `failures` polls in a row.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..errors import ConfigError

DEFAULT_FAILURES = 3
REQUEST_TIMEOUT_S = 5.0


@dataclass
class WatchResult:
    passed: bool
    detail: str
    polls: int = 0


def server_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ConfigError("--server names no URL")
    return url if "://" in url else f"http://{url}"


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read() if exc.fp else b""


def served_version(base: str, model: str) -> tuple[str | None, bool, str]:
    """(the version the server serves, whether the model is ready, what went wrong when not)."""
    try:
        status, body = _get(f"{base}/v2/models/{model}")
        if status != 200:
            return None, False, f"model metadata answered HTTP {status}"
        versions = json.loads(body.decode("utf-8")).get("versions") or []
        ready_status, _ = _get(f"{base}/v2/models/{model}/ready")
    except (OSError, ValueError, urllib.error.URLError) as exc:
        return None, False, f"{base} does not answer ({getattr(exc, 'reason', exc)})"
    version = str(versions[0]) if versions else None
    return version, ready_status == 200, "" if ready_status == 200 else f"model not ready (HTTP {ready_status})"


def watch(base: str, model: str, version: str, seconds: float, interval: float = 0.5,
          failures: int = DEFAULT_FAILURES) -> WatchResult:
    """Watch `model` on the server at `base` for `seconds` (see the module docstring)."""
    end = time.monotonic() + seconds
    switched, in_a_row, polls, last = False, 0, 0, "no answer yet"
    while True:
        polls += 1
        served, ready, why = served_version(base, model)
        if served == version and ready:
            switched, in_a_row = True, 0
        elif switched:
            in_a_row += 1
            last = why or f"the server went back to version {served}"
            if in_a_row >= failures:
                return WatchResult(False, f"{model} version {version} failed {failures} health polls in a row: "
                                          f"{last}", polls)
        else:
            last = why or f"the server still serves version {served}"
        if time.monotonic() >= end:
            break
        time.sleep(min(interval, max(0.0, end - time.monotonic())))
    if not switched:
        return WatchResult(False, f"the server at {base} did not serve {model} version {version} within {seconds:g} s "
                                  f"({last})", polls)
    return WatchResult(True, f"{model} version {version} ready at {base} for {seconds:g} s ({polls} polls)", polls)
