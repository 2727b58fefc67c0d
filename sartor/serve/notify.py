"""systemd's service notifications (sd_notify), and the unit `sartor serve --systemd-unit` prints.

The protocol is one datagram per message on the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or
an abstract name written with a leading '@'): `READY=1` once every model is loaded and warm,
`WATCHDOG=1` at half the interval systemd gives in $WATCHDOG_USEC (for this process when
$WATCHDOG_PID names it), `STOPPING=1` when a graceful stop begins, `STATUS=...` lines for
`systemctl status`. Without $NOTIFY_SOCKET every call does nothing. It is small enough to write here
rather than depend on a binding to libsystemd.
"""
from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import threading

log = logging.getLogger("sartor.serve")
WATCHDOG_SEC = 30  # the unit's WatchdogSec: systemd restarts a server that has not pinged for this long
UNIT_FLAG = "--systemd-unit"


def _address(name: str) -> str:
    return "\0" + name[1:] if name.startswith("@") else name


def notify(message: str, environ=None) -> bool:
    """Send `message` to systemd; False when there is no $NOTIFY_SOCKET or the send failed (logged)."""
    name = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET")
    if not name:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(_address(name))
            sock.sendall(message.encode("utf-8"))
        return True
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", name, exc.strerror or exc)
        return False


def watchdog_interval(environ=None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when systemd asks for none
    from this process."""
    environ = environ if environ is not None else os.environ
    usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.strip() != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number of microseconds: no watchdog pings", usec)
        return None
    return value / 2e6 if value > 0 else None


class Watchdog:
    """Pings WATCHDOG=1 every `interval` seconds while `alive()` holds (a server whose event loop
    stopped answering stops pinging, and systemd restarts it)."""

    def __init__(self, interval: float, alive) -> None:
        self.interval, self.alive = interval, alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sartor-watchdog")

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                healthy = self.alive()
            except Exception:
                log.exception("the watchdog's health check failed")
                healthy = False
            if healthy:
                notify("WATCHDOG=1")
            else:
                log.warning("not pinging the systemd watchdog: the server does not answer")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)


def _absolute_paths(argv: list[str]) -> list[str]:
    """The options that name files made absolute (a unit runs in /)."""
    out, take = [], False
    for arg in argv:
        if take:
            out.append(os.path.abspath(arg))
            take = False
            continue
        flag, eq, value = arg.partition("=")
        if flag in ("--model-repository", "--trust"):
            if eq:
                out.append(f"{flag}={os.path.abspath(value)}")
            else:
                out.append(arg)
                take = True
            continue
        out.append(arg)
    return out


def systemd_unit(argv: list[str], executable: str | None = None) -> str:
    """A systemd service running `sartor` with `argv` (the command line as given after `sartor`,
    `serve` and its options, less --systemd-unit), restarted always, watched by the watchdog."""
    args = _absolute_paths([a for a in argv if a != UNIT_FLAG])
    command = shlex.join([executable or sys.executable, "-m", "sartor", *args])
    return f"""[Unit]
Description=sartor inference server (KServe v2)
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
NotifyAccess=main
ExecStart={command}
# READY=1 comes once every model is loaded and warm; WATCHDOG=1 every {WATCHDOG_SEC // 2} s while it answers.
WatchdogSec={WATCHDOG_SEC}
TimeoutStartSec=600
Restart=always
RestartSec=2
# SIGTERM drains the queued requests before the process exits.
KillSignal=SIGTERM
TimeoutStopSec=30
Environment=PYTHONUNBUFFERED=1

[Install]
WantedBy=multi-user.target
"""
