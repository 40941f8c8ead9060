"""Progress where the output is not a terminal (a batch job's log): plain lines per item
and at least one every heartbeat while work runs."""

from __future__ import annotations

import io
import time

from rich.console import Console

from fp4rl.progress import LogProgress, progress_bar, status


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


def test_a_bar_in_a_log_beats_while_an_item_runs():
    console, out = log_console()
    with LogProgress(console, heartbeat=0.2) as bar:
        bar.add_task("runs", total=2, info="cell hif4: running")
        time.sleep(2.5)
    assert out.getvalue().count("runs: 0/2") >= 1


def test_a_status_in_a_log_says_start_changes_heartbeat_and_end():
    console, out = log_console()
    with status(console, "scoring methods", heartbeat=0.2) as live:
        live.update("scoring hif4")
        time.sleep(2.5)
    text = out.getvalue()
    assert "scoring methods ..." in text and "scoring hif4 ..." in text
    assert "still scoring hif4" in text and "scoring hif4: done in" in text


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
