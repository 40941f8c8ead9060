"""``fp4rl bench rollout --engine vllm``: a tiny run produces its rows and its JSON (the
figures themselves are recorded on a quiet machine, not here)."""

from __future__ import annotations

import json

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.cli import main  # noqa: E402


def test_bench_rollout_vllm_rows_and_json(tmp_path, capsys, smollm_dir):
    out = tmp_path / "rollout.json"
    assert main(["bench", "rollout", "--model", "smollm2-135m", "--engine", "vllm",
                 "--batch", "2", "--tokens", "4", "--repeats", "1", "--mixed-precision", "bf16",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "CPU:" in printed and "native bf16 flags" in printed
    report = json.loads(out.read_text())
    assert report["engines"] == ["vllm"] and report["batch"] == 2
    assert report["new_tokens"] == 4
    rows = report["results"]
    assert [r["name"] for r in rows] == ["rollout.vllm.hif4_vs_vllm.bf16",
                                         "rollout.vllm.hif4+resq-2:4_vs_vllm.bf16"]
    for r in rows:
        assert r["baseline"] == "vllm.bf16" and r["ratio"] > 0
        assert len(r["candidate_times"]) == len(r["baseline_times"]) == 1


@pytest.mark.long
def test_bench_rollout_both_engines_adds_the_cross_row(tmp_path, capsys, smollm_dir):
    out = tmp_path / "both.json"
    assert main(["bench", "rollout", "--model", "smollm2-135m", "--engine", "vllm", "hf",
                 "--batch", "2", "--tokens", "4", "--repeats", "1", "--mixed-precision", "bf16",
                 "--json", str(out)]) == 0
    assert "vLLM hif4+resq-2:4 tokens/s over hf hif4+resq-2:4 tokens/s" in \
        capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["engines"] == ["hf", "vllm"]
    names = [r["name"] for r in report["results"]]
    assert names[:3] == ["rollout.hf.hif4_vs_hf.bf16", "rollout.hf.hif4+resq-2:4_vs_hf.bf16",
                         "rollout.hf.fp32_vs_hf.bf16"]
    assert names[-1] == "rollout.hf.hif4+resq-2:4_vs_vllm.hif4+resq-2:4"
    cross = report["results"][-1]
    assert (cross["candidate"], cross["baseline"]) == ("hf.hif4+resq-2:4",
                                                       "vllm.hif4+resq-2:4")
