"""Child processes restarted when they exit, with back-off: the frontend processes of `--frontends N`
(frontend_pool.py) and the engine processes of `--engine-processes K` (shards.py)."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from typing import Callable

log = logging.getLogger("sartor.serve")
RESTART_DELAYS_S = (0.0, 0.5, 2.0, 5.0)  # after the 1st, 2nd, 3rd... death within RESTART_WINDOW_S
RESTART_WINDOW_S = 60.0
WATCH_EVERY_S = 0.25  # how often the processes are checked for having exited


class Restarts:
    """Watches `processes` (index -> Popen, the pool's own dict, which `spawn(index)` fills again) on
    the running event loop and restarts each that exits under the same index; `forget(index)` runs
    first, for what the pool keeps about the dead one."""

    def __init__(self, label: str, processes: dict[int, subprocess.Popen], spawn: Callable[[int], None],
                 forget: Callable[[int], None] | None = None) -> None:
        self.label = label
        self.processes = processes
        self.spawn = spawn
        self.forget = forget
        self.stopping = False
        self._deaths: dict[int, list[float]] = {}
        self._watch: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._watch = asyncio.get_running_loop().call_later(WATCH_EVERY_S, self._check)

    def stop(self) -> None:
        self.stopping = True
        if self._watch is not None:
            self._watch.cancel()

    def _check(self) -> None:
        """Restart the processes that exited (poll() reaps them)."""
        if self.stopping:
            return
        for index, process in list(self.processes.items()):
            if process.poll() is not None:
                self._exited(index, process)
        self._watch = asyncio.get_running_loop().call_later(WATCH_EVERY_S, self._check)

    def _exited(self, index: int, process: subprocess.Popen) -> None:
        del self.processes[index]
        if self.forget is not None:
            self.forget(index)
        now = time.monotonic()
        recent = [t for t in self._deaths.get(index, []) if now - t < RESTART_WINDOW_S] + [now]
        self._deaths[index] = recent
        delay = RESTART_DELAYS_S[min(len(recent), len(RESTART_DELAYS_S)) - 1]
        log.warning("%s %d (pid %s) exited with code %s: restarting it%s", self.label, index, process.pid,
                    process.returncode, f" in {delay:g} s" if delay else "")
        asyncio.get_running_loop().call_later(delay, self._respawn, index)

    def _respawn(self, index: int) -> None:
        if not self.stopping:
            self.spawn(index)
