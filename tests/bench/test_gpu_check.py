"""The one-call GPU check runs end to end on a CPU at toy sizes, so it is known to work
before a GPU is lent: every stage ends ``ok`` (vLLM's ``skipped`` where it is not installed)
and writes its record."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from _paths import ROOT


@pytest.mark.slow
@pytest.mark.long
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--device", "cpu", "--quick", "--output", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    summary = json.loads((out / "summary.json").read_text())
    failed = {name: json.loads((out / f"{name}.json").read_text()).get("error")
              for name, s in summary["stages"].items() if s["status"] == "error"}
    assert done.returncode == 0 and not failed, (failed, done.stderr[-2000:])
    assert set(summary["stages"]) == {"tests", "formats", "linear", "rollout", "train", "vllm",
                                      "demo", "invariant", "speed"}
    vllm_here = importlib.util.find_spec("vllm") is not None
    assert {n for n, s in summary["stages"].items() if s["status"] == "skipped"} == \
        (set() if vllm_here else {"vllm"})
    assert "CPU:" in summary["device_name"]
    formats = json.loads((out / "formats.json").read_text())
    assert formats["bandwidth"]["hif4"]["GB/s"] > 0
    assert (out / "demo" / "report.md").is_file()
    speed = json.loads((out / "speed.json").read_text())
    assert speed["quantizers"]["hif4"]["seconds"] > 0
    assert set(speed["decode_seconds"]) == {"1", "16"}
    assert speed["decode_seconds"]["1"]["packed store"] > 0
    assert speed["linear"]["micro_batches=8"]["bytes_ratio"] < \
        speed["linear"]["micro_batches=1"]["bytes_ratio"]
    invariant = json.loads((out / "invariant.json").read_text())["engine_vs_trainer"]
    assert all(v["bit_equal"] for v in invariant.values()), invariant


def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--output", str(tmp_path / "x")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in done.stderr
