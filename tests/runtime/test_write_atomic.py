"""write_atomic: engines, caches and reports reach their name whole or not at all, through
symlinks, never over devices or FIFOs, with the umask's mode, and with no temporary left behind
when the process is told to stop (a real process and a real SIGTERM)."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sartor.errors import OutputPathError
from sartor.runtime.engine_file import check_writable, write_atomic

ROOT = Path(__file__).resolve().parents[2]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "store" / "model.plan"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "current.plan"
    link.symlink_to(target)
    write_atomic(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    dangling = tmp_path / "next.plan"
    dangling.symlink_to(tmp_path / "store" / "next-target.plan")
    write_atomic(dangling, b"created")
    assert dangling.is_symlink() and (tmp_path / "store" / "next-target.plan").read_bytes() == b"created"
    assert leftovers(tmp_path) == leftovers(tmp_path / "store") == []


def test_a_fifo_or_a_device_is_refused_and_left_alone(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for call in (write_atomic, check_writable):
        with pytest.raises(OutputPathError, match=r"it is a FIFO, not a regular file \(sartor renames"):
            call(fifo, b"x") if call is write_atomic else call(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and leftovers(tmp_path) == []
    if os.path.exists("/dev/full"):  # checked before anything is written: the node is never touched
        with pytest.raises(OutputPathError, match="it is a character device"):
            check_writable("/dev/full")
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    with pytest.raises(OutputPathError, match="resolves to no file"):
        write_atomic(loop, b"x")


@pytest.mark.parametrize("umask,expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_takes_the_umask_and_a_replaced_one_keeps_its_mode(tmp_path, umask, expected):
    previous = os.umask(umask)
    try:
        write_atomic(tmp_path / "new.plan", b"x")
        assert stat.S_IMODE(os.stat(tmp_path / "new.plan").st_mode) == expected
        kept = tmp_path / "kept.plan"
        kept.write_bytes(b"old")
        os.chmod(kept, 0o640)
        write_atomic(kept, b"new")
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o640 and kept.read_bytes() == b"new"
    finally:
        os.umask(previous)


SLOW_WRITER = """
import os, sys, time
from pathlib import Path
from sartor.runtime import engine_file

def slow_fsync(fd):  # a disk that takes its time: the test stops the process here
    Path(sys.argv[2]).write_text("writing")
    time.sleep(60)

engine_file.os.fsync = slow_fsync
engine_file.write_atomic(sys.argv[1], b"x" * 4096)
"""


def test_sigterm_during_the_write_leaves_neither_the_file_nor_a_temporary(tmp_path):
    output, marker = tmp_path / "model.plan", tmp_path / "started"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(output), str(marker)], env=env,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline, "the writer never started"
        time.sleep(0.05)
    assert leftovers(tmp_path)  # the temporary is there while it writes
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    assert not output.exists() and leftovers(tmp_path) == []
