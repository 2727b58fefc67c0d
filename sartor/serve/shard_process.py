"""The main of one engine process of `sartor serve --engine-processes K` (`shards.py` starts K of
them): a whole server on the shared ports, linked to its siblings. Apart from `shards.py` because
it runs a `Server`, and the server imports `shards.py` to start them."""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from ..errors import SartorError
from .peers import Siblings, link_shard
from .server import Server, ServeOptions

log = logging.getLogger("sartor.serve")


def shard_main(settings: dict) -> None:
    """One engine process: a whole server on the shared ports, linked to its siblings, until SIGTERM
    or until its parent is gone. A failure to start is written, as one line, to settings["failure"]."""
    logging.basicConfig(level=settings["log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the shards
    server = peers = None
    try:
        server = Server(ServeOptions(**settings["options"]))
        siblings = Siblings({int(i): path for i, path in settings["siblings"].items()})
        peers = link_shard(server.core, siblings, settings["peer"], lambda: server.frontend_pids).start()
        server.start()
    except SartorError as exc:
        with open(settings["failure"], "w", encoding="utf-8") as f:
            f.write(str(exc))
        _stop(server, peers)
        sys.exit(1)
    peers.ready.set()
    log.info("engine process %d (pid %d) serving", settings["index"], os.getpid())
    # A parent killed without a chance to stop its shards must not leave them serving on its ports.
    while not stop.wait(0.5) and os.getppid() == settings["parent"]:
        pass
    _stop(server, peers)


def _stop(server, peers) -> None:
    if server is not None:
        server.stop()
    if peers is not None:
        peers.stop()
