"""`fp4rl bench formats` and the kernel fallback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from _paths import ROOT

import fp4rl
from fp4rl.cli import main
from fp4rl.kernels import cpu
from fp4rl.kernels.codes import c_defines


def test_bench_formats_writes_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "formats", "--size", "128", "--repeats", "2", "--format", "hif4",
                 "--format", "mxfp4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    names = [r["name"] for r in data["results"]]
    assert names == ["hif4.fast_vs_clone", "hif4.fast_vs_reference",
                     "mxfp4.fast_vs_clone", "mxfp4.fast_vs_reference"]
    for r in data["results"]:
        assert r["ratio"] > 0 and r["candidate_times"] and r["baseline_times"]
    assert "fake quantization, 128 x 128" in capsys.readouterr().out


def test_bench_rejects_unknown_format(capsys):
    assert main(["bench", "formats", "--size", "64", "--format", "fp5"]) == 2
    err = capsys.readouterr().err
    assert "unknown format" in err and len(err.strip().splitlines()) == 1


def test_reference_fallback_without_kernel(monkeypatch):
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    expected = fp4rl.quantize(x, "hif4")
    monkeypatch.setenv("FP4RL_DISABLE_KERNELS", "1")
    cpu.load_library.cache_clear()
    try:
        assert cpu.load_library() is None
        assert torch.equal(fp4rl.quantize(x, "hif4"), expected)
    finally:
        monkeypatch.delenv("FP4RL_DISABLE_KERNELS")
        cpu.load_library.cache_clear()
    assert cpu.load_library() is not None


def test_cost_cli_reproduces_paper(capsys):
    assert main(["cost", "--m", "512", "--d", "1024", "--n", "2048"]) == 0
    out = capsys.readouterr().out
    assert "| resq-dense |" in out and "2.00x" in out and "2.67x" in out


def test_bench_rollout_on_tiny_model(tmp_path, tiny_llama_dir):
    out = tmp_path / "r.json"
    assert main(["bench", "rollout", "--model", str(tiny_llama_dir), "--repeats", "1",
                 "--mixed-precision", "bf16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [r["name"] for r in rows] == ["rollout.hf.hif4_vs_hf.bf16",
                                         "rollout.hf.hif4+resq-2:4_vs_hf.bf16",
                                         "rollout.hf.fp32_vs_hf.bf16"]
    assert all(r["ratio"] > 0 and r["baseline"] == "hf.bf16" for r in rows)
    assert report["mixed_precision"] == "bf16"


def test_bench_rollout_in_fp32_compares_with_fp32(tmp_path, tiny_llama_dir, capsys,
                                                  monkeypatch):
    """Where bf16 is emulated (``auto`` resolves to fp32, as a training run's does), every
    policy and the baseline run in fp32, and no bf16 generation is timed at all."""
    from fp4rl import precision
    from fp4rl.rollout import KVCacheEngine

    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    dtypes = []
    real = KVCacheEngine.__init__
    monkeypatch.setattr(KVCacheEngine, "__init__", lambda self, *a, **kw: dtypes.append(
        kw["compute_dtype"]) or real(self, *a, **kw))
    out = tmp_path / "r.json"
    assert main(["bench", "rollout", "--model", str(tiny_llama_dir), "--repeats", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == ["rollout.hf.hif4_vs_hf.fp32",
                                                      "rollout.hf.hif4+resq-2:4_vs_hf.fp32"]
    assert report["mixed_precision"] == "no"
    assert dtypes and set(dtypes) == {torch.float32}
    printed = capsys.readouterr().out
    assert "time vs fp32" in printed and "hif4+resq-2:4, fp32" in printed
    assert main(["bench", "formats", "--mixed-precision", "no"]) == 2
    assert "--mixed-precision applies to bench rollout, linear and invariant only" in \
        capsys.readouterr().err


def test_bench_rollout_vllm_without_vllm_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["bench", "rollout", "--engine", "hf", "vllm"]) == 2
    err = capsys.readouterr()
    assert err.out == ""  # refused before anything ran or printed
    assert err.err.count("\n") == 1 and "vLLM is not installed" in err.err
    assert 'pip install "vllm' in err.err
    assert main(["bench", "linear", "--engine", "vllm"]) == 2
    assert "--engine applies to bench rollout and bench train only" in capsys.readouterr().err
    assert main(["bench", "train", "--batch", "4"]) == 2
    assert "--batch applies to bench rollout, engine and invariant only" in capsys.readouterr().err


def test_bench_linear_reports_both_baselines(tmp_path, monkeypatch):
    from fp4rl import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: True)  # any CPU alike
    out = tmp_path / "linear.json"
    assert main(["bench", "linear", "--tokens", "16", "--shapes", "2", "--repeats", "1",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == [
        "linear.smollm2-135m.up_proj[16x576->1536].hif4_vs_bf16",
        "linear.smollm2-135m.up_proj[16x576->1536].hif4_vs_fp32",
        "linear.smollm2-135m.down_proj[16x1536->576].hif4_vs_bf16",
        "linear.smollm2-135m.down_proj[16x1536->576].hif4_vs_fp32"]
    assert all(r["ratio"] > 0 and len(r["candidate_times"]) == 1 for r in results)
    assert [r["baseline"] for r in results[:2]] == ["bf16", "fp32"]
    assert "cpu_bf16_flags" in json.loads(out.read_text())["machine"]


@pytest.mark.parametrize(("native", "option", "computes"), [
    (False, None, ["fp32"]),  # emulated bf16 (minutes a repeat at 2048 features) not timed
    (True, "bf16", ["bf16"]),
])
def test_bench_linear_times_the_compute_asked_for(tmp_path, monkeypatch, capsys, native,
                                                   option, computes):
    from fp4rl import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    out = tmp_path / "linear.json"
    asked = [] if option is None else ["--mixed-precision", option]
    assert main(["bench", "linear", "--tokens", "8", "--shapes", "1", "--repeats", "1",
                 *asked, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["computes"] == computes
    assert [r["name"] for r in report["results"]] == [
        f"linear.smollm2-135m.up_proj[8x576->1536].hif4_vs_{c}" for c in computes]
    printed = capsys.readouterr().out
    assert printed.count("bf16 not timed") == (option is None)  # said once
    row = next(line for line in printed.splitlines() if "smollm2" in line)
    cells = [cell.strip() for cell in row.split("│")]
    assert cells.count("-") == 3  # the other dtype's columns, empty


def test_bench_train_splits_a_step_into_phases(tmp_path, tiny_llama_dir):
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", str(tiny_llama_dir), "--repeats", "1",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    # on-policy: the old-log-prob pass scores the rows that do not train alone (NeMo-RL's
    # every-token metrics)
    assert [r["name"] for r in results] == [f"train.{p}.fp4_vs_bf16" for p in
                                            ("rollout", "reward", "old_logprob", "update",
                                             "step")]
    step = results[-1]
    parts = sum(r["candidate_times"][0] for r in results[:-1])
    assert step["candidate_times"][0] == pytest.approx(parts, abs=1e-4)


def test_kernel_harness_builds_against_the_kernel(tmp_path):
    """The C timing harness declares the kernel's entry points itself; keep them in step."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    root = ROOT
    assert subprocess.run([compiler, "-fsyntax-only", str(cpu.SOURCE)], capture_output=True,
                          check=False).returncode != 0  # the codes come from one place only
    exe = tmp_path / "harness"
    subprocess.run([compiler, "-O1", "-fopenmp", "-Wall", "-Werror", *c_defines(),
                    str(root / "benchmarks" / "kernel_harness.c"), str(cpu.SOURCE),
                    "-lm", "-o", str(exe)], check=True)
    out = subprocess.run([str(exe), "64", "128"], check=True, capture_output=True,
                         text=True).stdout
    lines = [line for line in out.splitlines() if "axis" in line]
    assert len(lines) == 8 and all(float(line.rsplit(":", 1)[1]) > 0 for line in lines)


def test_bench_invariant_times_the_three_passes_of_a_step(tmp_path, tiny_llama_dir,
                                                          monkeypatch):
    from fp4rl import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: True)  # any CPU alike
    out = tmp_path / "invariant.json"
    assert main(["bench", "invariant", "--model", str(tiny_llama_dir), "--repeats", "1",
                 "--batch", "2", "--tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["results"]]
    assert names == [f"invariant.{p}.{d}" for p in ("rollout", "score", "update", "step")
                     for d in ("fp32", "bf16")]
    rows = {r["name"]: r for r in report["results"]}
    for dtype in ("fp32", "bf16"):
        for side in ("candidate_times", "baseline_times"):
            parts = sum(rows[f"invariant.{p}.{dtype}"][side][0]
                        for p in ("rollout", "score", "update"))
            assert rows[f"invariant.step.{dtype}"][side][0] == pytest.approx(parts, abs=1e-6)
    assert "cpu_bf16_flags" in report["machine"]
    assert report["computes"] == ["fp32", "bf16"]


@pytest.mark.parametrize(("native", "option", "computes"), [
    (False, None, ["fp32"]),  # emulated bf16 is not timed unless asked for
    (False, "bf16", ["bf16"]),
    (True, "no", ["fp32"]),
    (True, "auto", ["bf16"]),
])
def test_bench_invariant_times_the_compute_asked_for(tmp_path, tiny_llama_dir, monkeypatch,
                                                      capsys, native, option, computes):
    from fp4rl import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    out = tmp_path / "invariant.json"
    asked = [] if option is None else ["--mixed-precision", option]
    assert main(["bench", "invariant", "--model", str(tiny_llama_dir), "--repeats", "1",
                 "--batch", "2", "--tokens", "2", *asked, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["computes"] == computes
    assert [r["name"] for r in report["results"]] == [
        f"invariant.{p}.{d}" for p in ("rollout", "score", "update", "step") for d in computes]
    assert capsys.readouterr().out.count("bf16 not timed") == (option is None)  # said once


def test_a_bench_records_the_libraries_held_below_the_cpu(monkeypatch):
    from fp4rl.bench import common

    for name in common.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    assert "isa_limits" not in common.machine()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    monkeypatch.setenv("FP4RL_AMX", "0")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert common.machine()["isa_limits"] == {"ATEN_CPU_CAPABILITY": "avx2",
                                              "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                                              "FP4RL_AMX": "0"}
