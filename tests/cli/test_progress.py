"""Progress where the output is not a terminal (a batch job's log): plain lines per item
and at least one every heartbeat while work runs."""

from __future__ import annotations

import io
import time

from rich.console import Console

from fp4rl.progress import POLL, LogProgress, progress_bar, status


def log_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_a_bar_in_a_log_prints_each_item_with_count_and_rate():
    console, out = log_console()
    bar = progress_bar(console)
    assert isinstance(bar, LogProgress)
    with bar:
        task = bar.add_task("GRPO", total=3, info="")
        for step in (1, 2, 3):
            bar.update(task, completed=step, info=f"reward 0.{step}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[-1].startswith("GRPO: 3/3 (") and "/s" in lines[-1] and "reward 0.3" in lines[-1]


class Clock:
    """A clock a test moves by hand: no test waits for a heartbeat."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_bar_in_a_log_beats_while_an_item_runs():
    console, out = log_console()
    clock = Clock()
    bar = LogProgress(console, heartbeat=30, clock=clock)
    bar.add_task("runs", total=2, info="cell hif4: running")
    clock.now += 29
    bar.beat()
    assert out.getvalue() == ""  # not yet quiet for a heartbeat
    clock.now += 2
    bar.beat()
    bar.beat()  # once per heartbeat, not once per poll
    assert out.getvalue().splitlines() == ["runs: 0/2 (31 s)  cell hif4: running"]
    clock.now += 9
    bar.update(0, completed=1)
    clock.now += 29
    bar.beat()  # an item's line resets the heartbeat
    assert out.getvalue().splitlines()[1:] == ["runs: 1/2 (40 s, 0.03/s)  cell hif4: running"]


def test_a_status_in_a_log_says_start_changes_heartbeat_and_end():
    console, out = log_console()
    clock = Clock()
    with status(console, "scoring methods", heartbeat=30, clock=clock) as live:
        clock.now += 5
        live.update("scoring hif4")
        clock.now += 29
        live.beat()
        clock.now += 1
        live.beat()
        live.beat()
        clock.now += 10
    assert out.getvalue().splitlines() == [
        "scoring methods ...", "scoring hif4 ...", "still scoring hif4 (35 s)",
        "scoring hif4: done in 45 s"]


def test_the_heartbeat_thread_beats_on_its_own():
    """The thread behind a log's bar polls the clock by itself (one real poll)."""
    console, out = log_console()
    clock = Clock()
    with LogProgress(console, heartbeat=30, clock=clock) as bar:
        bar.add_task("runs", total=2)
        clock.now += 31
        time.sleep(POLL * 1.5)
    assert out.getvalue().count("runs: 0/2 (31 s)") == 1


def test_a_failed_status_does_not_say_done():
    console, out = log_console()
    try:
        with status(console, "loading"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert "done" not in out.getvalue()


def test_a_terminal_keeps_the_live_bar():
    console = Console(file=io.StringIO(), force_terminal=True)
    assert not isinstance(progress_bar(console), LogProgress)
