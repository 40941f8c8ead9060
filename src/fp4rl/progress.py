"""One progress style for every long-running command, on a terminal and in a log.

On a terminal: rich's live bars and spinners. When the output is not a terminal (a batch
job's log, a redirected file, CI), those draw nothing, so the same calls print plain
lines instead: a bar one line per finished item (count, total, rate, elapsed, its info),
and at least one every :data:`HEARTBEAT` seconds while an item runs; a status its
message when it starts and changes, a "still ..." line every :data:`HEARTBEAT` seconds,
and how long it took.

Both read the time from a ``clock`` (``time.monotonic`` unless given) and beat from a
thread that polls every :data:`POLL` seconds through :meth:`LogProgress.beat`, which a
test calls itself with a clock of its own instead of waiting.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.status import Status

#: the longest a redirected log goes without a line while work runs (seconds)
HEARTBEAT = 30.0
#: how often the heartbeat thread looks at the clock (seconds)
POLL = 1.0

Clock = Callable[[], float]


def progress_bar(console: Console) -> Progress | LogProgress:
    """A rich progress bar with count, elapsed/remaining time and a free ``info`` field;
    plain lines where ``console`` is not a terminal."""
    if not console.is_terminal:
        return LogProgress(console)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                    console=console)


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float = 0.0
    info: str = ""
    visible: bool = True
    started: float = 0.0


class LogProgress:
    """The part of rich's ``Progress`` fp4rl's commands use, as lines in a log."""

    def __init__(self, console: Console, heartbeat: float = HEARTBEAT,
                 clock: Clock = time.monotonic) -> None:
        self.console = console
        self.heartbeat = heartbeat
        self.clock = clock
        self.tasks: dict[int, _Task] = {}
        self._last = clock()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- rich's interface ------------------------------------------------------------
    def add_task(self, description: str, total: float | None = None, completed: float = 0,
                 visible: bool = True, **fields: object) -> TaskID:
        task_id = TaskID(len(self.tasks))  # rich's task id type (an int)
        self.tasks[task_id] = _Task(description, total, completed, str(fields.get("info", "")),
                                    visible, self.clock())
        return task_id

    def update(self, task_id: int, *, total: float | None = None,
               completed: float | None = None, advance: float | None = None,
               **fields: object) -> None:
        task = self.tasks[task_id]
        before = task.completed
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        if "info" in fields:
            task.info = str(fields["info"])
        if task.completed != before:
            self._print(task)

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def reset(self, task_id: int, **fields: Any) -> None:
        task = self.tasks[task_id]
        task.completed, task.started = 0.0, self.clock()
        self.update(task_id, **fields)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)

    def __enter__(self) -> LogProgress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- lines -------------------------------------------------------------------------
    def line(self, task: _Task) -> str:
        elapsed = self.clock() - task.started
        count = f"{task.completed:g}" + (f"/{task.total:g}" if task.total else "")
        rate = f", {task.completed / elapsed:.2f}/s" if elapsed > 0 and task.completed else ""
        info = f"  {task.info}" if task.info else ""
        return f"{task.description}: {count} ({elapsed:.0f} s{rate}){info}"

    def _print(self, task: _Task) -> None:
        if not task.visible:
            return
        with self._lock:
            self.console.print(self.line(task), markup=False, highlight=False, soft_wrap=True)
            self._last = self.clock()

    def beat(self) -> None:
        """Every task's line, where the log has been quiet for a heartbeat."""
        with self._lock:
            if self.clock() - self._last >= self.heartbeat:
                for task in list(self.tasks.values()):
                    self._print(task)

    def _beat(self) -> None:
        while not self._stop.wait(POLL):
            self.beat()


@contextlib.contextmanager
def status(console: Console, message: str, heartbeat: float = HEARTBEAT,
           clock: Clock = time.monotonic) -> Iterator[Status | _LogStatus]:
    """``console.status(message)`` on a terminal; in a log the message, a "still ..." line
    every ``heartbeat`` seconds, and the time it took. Yields an object with
    ``update(message)``, as rich's status does (and ``beat()`` in a log)."""
    if console.is_terminal:
        with console.status(message) as live:
            yield live
        return
    log = _LogStatus(console, message, heartbeat, clock)
    try:
        yield log
    except BaseException:
        log.close(done=False)
        raise
    log.close(done=True)


class _LogStatus:
    def __init__(self, console: Console, message: str, heartbeat: float,
                 clock: Clock) -> None:
        self.console, self.heartbeat, self.clock = console, heartbeat, clock
        self.started = self._last = clock()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.update(message)
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def update(self, message: str) -> None:
        self.message = message
        self._say(f"{message} ...")

    def close(self, done: bool) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        if done:
            self._say(f"{self.message}: done in {self.clock() - self.started:.0f} s")

    def _say(self, text: str) -> None:
        with self._lock:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            self._last = self.clock()

    def beat(self) -> None:
        """A "still ..." line, where the log has been quiet for a heartbeat."""
        with self._lock:
            if self.clock() - self._last >= self.heartbeat:
                self._say(f"still {self.message} ({self.clock() - self.started:.0f} s)")

    def _beat(self) -> None:
        while not self._stop.wait(POLL):
            self.beat()


__all__ = ["HEARTBEAT", "POLL", "LogProgress", "progress_bar", "status"]
