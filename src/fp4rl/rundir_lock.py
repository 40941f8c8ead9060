"""One writer per output directory: an exclusive lock held for a whole run.

Two commands writing checkpoints, metrics and reports into the same directory corrupt
each other's files. ``fp4rl train`` and ``fp4rl experiment`` therefore hold an advisory
``flock`` on ``<output>/.fp4rl.lock`` while they run; a second writer is refused in one
line naming the holder (its PID, host, command and start time, which the holder writes
into the file). The kernel drops the lock when its process ends, however it ends, so a
lock file left by a killed run holds no lock: the next run takes it over and rewrites
the holder's line. (On a network file system without ``flock`` the lock cannot be held;
the command then says so and runs unlocked.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from fp4rl.errors import DirectoryInUse

LOCK_FILE = ".fp4rl.lock"


def _holder() -> str:
    command = " ".join(["fp4rl", *sys.argv[1:]]) if sys.argv else "fp4rl"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    return f"PID {os.getpid()} on {socket.gethostname()} ({command}), since {started}"


@contextlib.contextmanager
def exclusive(directory: Path, option: str = "--output",
              warn: object = print) -> Iterator[None]:
    """Hold ``directory``'s lock for the block (creating the directory); an
    :class:`~fp4rl.errors.DirectoryInUse` names the current holder where another process
    has it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = path.read_text().strip() or "another process"
                raise DirectoryInUse(f"{option} {directory} is in use by {holder}: wait for it "
                                  f"to finish, or write elsewhere") from None
            if callable(warn):
                warn(f"note: cannot lock {directory} ({err.strerror}); running unlocked")
        os.ftruncate(fd, 0)
        os.write(fd, (_holder() + "\n").encode())
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = ["LOCK_FILE", "exclusive"]
