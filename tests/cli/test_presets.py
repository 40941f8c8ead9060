"""Config presets ship inside the package: ``--config NAME`` works from any directory and
from an installed wheel; a typo is one line that suggests the closest preset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _paths import ROOT

from fp4rl.cli import build_parser, main
from fp4rl.errors import ConfigError
from fp4rl.experiments import get_plan
from fp4rl.presets import list_presets, preset_path

REPO = ROOT
NAMES = {"demo", "smoke", "qwen2.5-3b-gsm8k", "qwen2.5-math-7b-dapo"}


def test_list_presets_names_and_describes_each():
    presets = list_presets()
    assert set(presets) == NAMES
    for description in presets.values():
        assert description and "\n" not in description and not description.startswith("#")


def test_preset_path_by_name_by_file_name_and_by_path(tmp_path):
    smoke = preset_path("smoke")
    assert smoke.is_file() and smoke.name == "smoke.yaml"
    assert preset_path("smoke.yaml") == smoke
    own = tmp_path / "mine.yaml"
    own.write_text("run: {steps: 1}\n")
    assert preset_path(own) == own and preset_path(str(own)) == own
    assert preset_path(smoke) == smoke


def test_unknown_preset_lists_the_presets_and_suggests_one(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'smoke'") as err:
        preset_path("smok")
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in NAMES)
    # a missing file is not silently replaced by the preset of the same name
    with pytest.raises(ConfigError, match="did you mean 'smoke'"):
        preset_path(tmp_path / "smoke.yaml")


def test_experiment_plans_read_the_config_presets():
    assert get_plan("paper-3b").config_path() == preset_path("qwen2.5-3b-gsm8k")
    assert get_plan("paper-7b").config_path() == preset_path("qwen2.5-math-7b-dapo")
    assert get_plan("tiny").config_path() is None


def test_cli_presets_prints_one_aligned_line_each(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(NAMES)
    presets = list_presets()
    column = {line.index(presets[line.split()[0]]) for line in lines}
    assert len(column) == 1  # the descriptions start in one column


def test_cli_unknown_config_is_one_line_suggesting_smoke(tmp_path, capsys):
    assert main(["train", "--config", "smok", "--output", str(tmp_path / "run"),
                 "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "did you mean 'smoke'" in err
    assert main(["demo", "--config", "smok", "--output", str(tmp_path / "demo")]) == 2
    assert "did you mean 'smoke'" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
    assert build_parser().parse_args(["demo"]).config == "demo"


def _copy_sources(dest: Path) -> Path:
    """The files a wheel is built from, without build outputs of the checkout (a stale
    ``build/`` there would leak into the wheel)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / "src", dest / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so"))
    return dest


@pytest.mark.slow
def test_installed_wheel_trains_the_smoke_preset_outside_the_checkout(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    source = _copy_sources(tmp_path / "source")
    subprocess.run([*pip, "wheel", "--no-deps", "--no-index", "--no-build-isolation",
                    str(source), "-w", str(tmp_path / "dist")], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("fp4rl-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    code = ("import sys, fp4rl; print('fp4rl from', fp4rl.__file__, flush=True); "
            "from fp4rl.cli import main; sys.exit(main())")
    done = subprocess.run(
        [sys.executable, "-c", code, "train", "--config", "smoke", "--output", str(run),
         "--steps", "1"],
        cwd=elsewhere, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = Path(done.stdout.splitlines()[0].removeprefix("fp4rl from "))
    assert imported.is_relative_to(site) and not imported.is_relative_to(REPO)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


@pytest.mark.parametrize("preset", ["qwen2.5-3b-gsm8k", "qwen2.5-math-7b-dapo"])
def test_paper_presets_roll_out_in_vllm_on_a_gpu_and_in_fp4rls_engine_on_a_cpu(
        preset, monkeypatch):
    """The engine a user would choose, with no override: vLLM where a GPU and vLLM are
    there (and its plug-in runs the recipe), fp4rl's own engine otherwise."""
    import importlib.util

    import torch

    from fp4rl.rl.config import load_config
    from fp4rl.rollout import resolve_engine

    cfg = load_config(preset, [])
    assert cfg.rollout.engine == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    find_spec = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, ok=installed: (object() if ok else None)
                            if name == "vllm" else find_spec(name, *a))
        assert resolve_engine(cfg.rollout.engine, cpu, cfg.recipe()) == "hf"
        assert resolve_engine(cfg.rollout.engine, cuda, cfg.recipe()) == \
            ("vllm" if installed else "hf")
        smooth = load_config(preset, ["rollout.recovery={method: smoothquant}"])
        assert resolve_engine("auto", cuda, smooth.recipe()) == "hf"  # vLLM cannot run it
    assert resolve_engine("hf", cuda, cfg.recipe()) == "hf"
