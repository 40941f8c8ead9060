"""Running a command on one or several processes from a test, bounded in time: a run that
hangs is killed with every process it started, and the test fails with its stderr."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


def launcher(nproc: int) -> list[str]:
    """The command prefix that starts ``nproc`` processes (torchrun for more than one)."""
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}"] if nproc > 1 else [sys.executable])


def run_bounded(cmd: list[str], timeout_s: float, nproc: int, **env_vars: str
                ) -> subprocess.CompletedProcess:
    """``cmd`` with one torch thread per process, killed as a process group on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_vars}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"{nproc}-process run timed out:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
