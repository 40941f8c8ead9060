"""The one-call GPU check, held on a CPU before a GPU is lent: every stage runs end to end at
toy sizes (``ok``, vLLM's ``skipped`` where it is not installed) and writes its record; each
timed row computes in the dtype it says, read from its output, and a ratio whose sides ran
in another is refused in one line; every figure also goes out as JSON lines, on stdout and
under ``$OUT``."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from _paths import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_the_speed_stage_computes_in_the_dtype_each_row_says(tmp_path):
    """``--only speed --device cpu --quick``: the FP4-against-bf16 rows ran in bfloat16
    on both sides (under the old string argument autocast stayed off: float32), the
    rollout rows in bfloat16, the quantizers on float32; the figures on stdout are those
    written to ``--output`` and to ``$OUT/gpu-check``."""
    pytest.importorskip("triton")
    out, lent = tmp_path / "check", tmp_path / "lent"
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "speed", "--device", "cpu",
                           "--quick", "--output", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "OUT": str(lent)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    speed = json.loads((out / "speed.json").read_text())
    assert set(speed) == {"status", "device", "size", "clone", "quantizers", "linear",
                          "decode", "profile", "refused", "seconds"}
    assert speed["status"] == "ok" and speed["refused"] == []
    one, eight = "tokens=16 micro_batches=1", "tokens=16 micro_batches=8"
    assert set(speed["linear"]) == {one, eight}
    for row in speed["linear"].values():
        assert set(row) == {"compute", "bf16", "hif4", "nvfp4", "ratio", "bytes_ratio",
                            "on load / quantize first", "not_run"}
        assert row["compute"] == row["bf16"]["dtype"] == row["hif4"]["dtype"] == \
            row["nvfp4"]["dtype"] == "bfloat16"
        for name in ("hif4", "nvfp4"):
            assert row["ratio"][name] == pytest.approx(row[name]["seconds"] /
                                                       row["bf16"]["seconds"])
        # no Triton on a CPU: the on-load sides are not run, and the row says why
        assert row["not_run"] == {"hif4 on load": "no quantize-on-load kernel on cpu",
                                  "nvfp4 on load": "no quantize-on-load kernel on cpu"}
        assert row["on load / quantize first"] == {}
        assert row["bytes_ratio"]["hif4 on load"] < row["bytes_ratio"]["hif4"]
    assert speed["linear"][eight]["bytes_ratio"]["hif4"] < \
        speed["linear"][one]["bytes_ratio"]["hif4"]
    assert set(speed["decode"]) == {"1", "16"}
    for row in speed["decode"].values():
        variants = {"bf16", "dequantized", "packed then GEMM", "packed store"}
        assert set(row) == {"compute", "ratio to bf16", *variants}  # no Triton launch on a CPU
        assert {row[v]["dtype"] for v in variants} == {row["compute"]} == {"bfloat16"}
        assert set(row["ratio to bf16"]) == variants - {"bf16"}
        assert all(r > 0 for r in row["ratio to bf16"].values())
    assert set(speed["quantizers"]) == {"hif4", "mxfp4", "nvfp4", "mxfp8_e4m3"}
    assert all(q["dtype"] == "float32" and q["share of clone bandwidth"] > 0
               for q in speed["quantizers"].values())

    lines = _json_lines(done.stdout)
    assert lines and all({"stage", "keys"} <= set(line) for line in lines)
    by_keys = {(line["stage"], tuple(line["keys"])): line for line in lines}
    assert by_keys["speed", ("linear", one, "hif4")]["dtype"] == "bfloat16"
    assert by_keys["speed", ("linear", eight, "ratio")]["hif4"] == \
        speed["linear"][eight]["ratio"]["hif4"]
    assert by_keys["summary", ("stages", "speed")]["status"] == "ok"
    for folder in (out, lent / "gpu-check"):
        assert _json_lines((folder / "figures.jsonl").read_text()) == lines
        assert json.loads((folder / "speed.json").read_text()) == speed
        assert (folder / "summary.json").is_file()


def test_a_ratio_whose_sides_ran_in_another_dtype_is_refused():
    gc = _gpu_check()
    bf16, fp32 = gc.Timed(1.0, "bfloat16"), gc.Timed(2.0, "float32")
    refused: list[str] = []
    assert gc.ratio("row", {"a": fp32, "b": bf16}, "a", "b", torch.bfloat16, refused) is None
    assert refused == ["row: no a/b ratio: a computed in float32, while the row says bfloat16"]
    assert gc.ratio("row", {"a": bf16, "b": bf16}, "a", "b", torch.bfloat16, refused) == 1.0
    assert gc.ratio("row", {"a": fp32, "b": fp32}, "a", "b", torch.float32, refused) == 1.0
    assert len(refused) == 1
    ids = torch.ones(1, dtype=torch.int64)
    assert gc.computed_dtype((torch.ones(1, dtype=torch.bfloat16), ids)) == "bfloat16"
    assert gc.computed_dtype({"y": torch.ones(1), "z": [torch.ones(1, dtype=torch.bfloat16)]}) \
        == "bfloat16+float32"
    with pytest.raises(TypeError, match="no floating tensor"):
        gc.computed_dtype(None)


def test_the_speed_stage_refuses_its_ratios_when_autocast_stays_off(tmp_path, monkeypatch,
                                                                    capsys):
    """The script's old fault put back (autocast off, as ``autocast(device, "bf16")``
    left it): the FP4-against-bf16 rows computed in float32 and the stage reports no ratio
    for them; it ends ``error`` with one line naming the sides' dtypes, no traceback, its
    other figures kept."""
    pytest.importorskip("triton")
    gc = _gpu_check()

    @contextlib.contextmanager
    def autocast_off(device: torch.device, compute: torch.dtype) -> Iterator[None]:
        yield

    monkeypatch.setattr(gc, "autocast", autocast_off)
    record = gc.run_stage("speed", lambda: gc.stage_speed("cpu", True), gc.Figures([tmp_path]))
    assert record["status"] == "error" and "traceback" not in record
    assert [row["ratio"] for row in record["linear"].values()] == \
        [{"hif4": None, "nvfp4": None}] * 2
    assert [line.split(":")[0] for line in record["refused"]] == \
        ["speed linear tokens=16 micro_batches=1"] * 2 + \
        ["speed linear tokens=16 micro_batches=8"] * 2
    assert record["error"] == ("speed linear tokens=16 micro_batches=1: no hif4/bf16 ratio: "
                               "hif4 computed in float32 and bf16 computed in float32, while "
                               "the row says bfloat16 (and 3 more in speed.json)")
    assert all(r is not None for row in record["decode"].values()
               for r in row["ratio to bf16"].values())
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("speed: ")]
    assert len(printed) == 1 and printed[0].startswith(f"speed: error: {record['error']} in ")
    assert json.loads((tmp_path / "speed.json").read_text())["error"] == record["error"]


@pytest.mark.slow
@pytest.mark.long
def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick",
                           "--output", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
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
    invariant = json.loads((out / "invariant.json").read_text())
    checked = {k: v for k, v in invariant["engine_vs_trainer"].items() if "skipped" not in v}
    assert set(checked) == {"bf16.fp32", "bf16.bf16", "hif4.fp32", "hif4.bf16"}
    assert invariant["bit_equal"] and set(invariant["checked"]) == set(checked)
    assert all(v["bit_equal"] and v["computed_in"] == {"fp32": "float32", "bf16": "bfloat16"}[
        k.split(".")[1]] for k, v in checked.items()), checked
    assert all(invariant["forward"][r]["ratio"] > 0 for r in ("bf16", "hif4"))


def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run([sys.executable, str(SCRIPT), "--output", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "no CUDA GPU" in done.stderr


def test_an_unknown_stage_is_named_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--only", "sped",
                           "--output", str(tmp_path / "x")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "gpu_check: no stage sped; the stages are tests, formats, linear, rollout, train, "
        "vllm, demo, invariant, speed"]
