"""``fp4rl env``: versions, devices and the quantization path of every format, with why."""

from __future__ import annotations

import json
import re

from fp4rl.cli import main
from fp4rl.formats import get_format
from fp4rl.kernels import kernel_choice


def test_env_prints_versions_devices_and_kernels(tmp_path, capsys):
    out = tmp_path / "env.json"
    assert main(["env", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("versions:", "torch", "transformers", "devices:", "cpu bf16 flags",
                   "kernels:", "hif4 on cpu"):
        assert needle in text, needle
    report = json.loads(out.read_text())
    assert set(report) == {"versions", "devices", "kernels", "environment"}
    assert report["versions"]["fp4rl"] != "not installed"
    assert report["kernels"]["hif4 on cpu"].split(":")[0] in ("c", "reference")


def test_env_says_why_a_format_takes_the_reference_path(monkeypatch, capsys):
    monkeypatch.setenv("FP4RL_DISABLE_KERNELS", "1")
    assert kernel_choice(get_format("hif4"), "cpu") == ("reference", "FP4RL_DISABLE_KERNELS=1")
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"mxfp4 on cpu +reference: FP4RL_DISABLE_KERNELS=1", text)
    assert re.search(r"FP4RL_DISABLE_KERNELS +1\n", text)
    monkeypatch.delenv("FP4RL_DISABLE_KERNELS")
    assert kernel_choice(get_format("bf16"), "cpu") == ("reference", "no kernel knows this format")
