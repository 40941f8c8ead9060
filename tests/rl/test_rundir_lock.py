"""One writer per run directory, with real processes: a second ``fp4rl train`` or
``fp4rl experiment`` into a directory in use is one line naming the holder (exit 2), and
the lock a killed run leaves is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp4rl.cli import main
from fp4rl.rundir_lock import LOCK_FILE, exclusive

HOLD = """
import sys, time
from pathlib import Path
from fp4rl.rundir_lock import exclusive
with exclusive(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """A process holding ``tmp_path / "run"``'s lock (killed at the end, whatever happens)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield run, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_second_writer_is_refused_in_one_line_naming_the_holder(holder, capsys,
                                                                   tiny_llama_dir):
    run, proc = holder
    (run / "notes.txt").write_text("the holder's")
    assert main(["train", "--output", str(run), f"model={tiny_llama_dir}", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"PID {proc.pid}" in err[0] and "in use" in err[0], err
    assert (run / "notes.txt").read_text() == "the holder's"  # nothing of it removed
    assert main(["experiment", "precision", "--plan", "tiny", "--output", str(run),
                 "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"PID {proc.pid}" in err[0], err


def test_the_lock_of_a_killed_run_is_taken_over(holder):
    run, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert f"PID {proc.pid}" in (run / LOCK_FILE).read_text()  # the file stays behind
    with exclusive(run):
        assert f"PID {os.getpid()}" in (run / LOCK_FILE).read_text()


def test_the_lock_is_released_when_the_run_ends(tmp_path):
    run = Path(tmp_path / "run")
    with exclusive(run):
        pass
    done = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(120)", "pass"),
                           str(run)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "locked"


def test_the_refusal_is_its_own_error_type(holder):
    """Callers tell a held directory (someone else's: leave it alone) from any other output
    problem by the type, not by the message's words."""
    from fp4rl.errors import DirectoryInUse, OutputError

    run, proc = holder
    with pytest.raises(DirectoryInUse, match=f"PID {proc.pid}") as refused, exclusive(run):
        pass
    assert isinstance(refused.value, OutputError)
