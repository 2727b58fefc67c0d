"""Ultralytics without the network: what samples/yolo/train.py runs under, and a runner for other scripts.

    python samples/yolo/offline.py SCRIPT.py [ARGS...]     (e.g. bench/yolo_val_agreement.py)

`refuse_network()` makes every socket connect and DNS lookup of this process fail with OSError and
records it in NETWORK_ATTEMPTS (printed to stderr as it happens), so a log shows whether anything
tried to download. `offline_ultralytics(runs_dir)`, called before Ultralytics is imported, sets
YOLO_OFFLINE=1, puts Ultralytics' settings, runs, datasets and weights directories under
`runs_dir` (never ~/.config), and skips the dataset check's font lookup (check_font would fetch
Arial.ttf; fonts only serve plots). As a script it does both (runs under $SARTOR_YOLO_RUNS, default
/tmp/sartor_yolo_runs), runs SCRIPT as __main__ and reports the count at exit.
"""
from __future__ import annotations

import os
import runpy
import socket
import sys
from pathlib import Path

NETWORK_ATTEMPTS: list = []


def refuse_network() -> None:
    """Every socket connect and DNS lookup in this process fails with OSError, and is recorded."""
    getaddrinfo = socket.getaddrinfo

    def refused_connect(self, address, *args):
        NETWORK_ATTEMPTS.append(f"connect {address}")
        print(f"NETWORK ATTEMPT refused: connect {address}", file=sys.stderr, flush=True)
        raise OSError("network access is disabled in samples/yolo/offline.py")

    def refused_getaddrinfo(host, *args, **kwargs):
        if host in (None, "localhost", "127.0.0.1", "::1"):
            return getaddrinfo(host, *args, **kwargs)
        NETWORK_ATTEMPTS.append(f"getaddrinfo {host}")
        print(f"NETWORK ATTEMPT refused: getaddrinfo {host}", file=sys.stderr, flush=True)
        raise socket.gaierror(socket.EAI_NONAME, "network access is disabled in samples/yolo/offline.py")

    socket.socket.connect = refused_connect  # type: ignore[method-assign]
    socket.getaddrinfo = refused_getaddrinfo  # type: ignore[assignment]


def offline_ultralytics(runs_dir: Path) -> None:
    """Environment for Ultralytics, set before it is imported."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    os.environ["YOLO_OFFLINE"] = "1"  # is_online() -> False: no hub, no events, no auto-install
    os.environ["YOLO_CONFIG_DIR"] = str(runs_dir / "config")  # settings.json here, not in ~/.config
    os.environ.setdefault("ULTRALYTICS_SKIP_REQUIREMENTS_CHECKS", "1")  # never pip-install during export
    from ultralytics.data import utils as data_utils
    from ultralytics.utils import SETTINGS

    SETTINGS.update({"sync": False, "runs_dir": str(runs_dir), "datasets_dir": str(runs_dir / "datasets"),
                     "weights_dir": str(runs_dir / "weights")})
    # check_det_dataset() ends with check_font("Arial.ttf"), which fetches the font when matplotlib has
    # no Arial; fonts serve only plots, and plots are off.
    data_utils.check_font = lambda *args, **kwargs: None


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    refuse_network()
    offline_ultralytics(Path(os.environ.get("SARTOR_YOLO_RUNS", "/tmp/sartor_yolo_runs")).resolve())
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        print(f"network attempts: {len(NETWORK_ATTEMPTS)}" + (f" ({NETWORK_ATTEMPTS})" if NETWORK_ATTEMPTS else ""),
              file=sys.stderr)


if __name__ == "__main__":
    main()
