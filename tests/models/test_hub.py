"""Hub ids where paths go, with no network: a Hugging Face cache built in a temporary
``HF_HOME`` (the ``models--ORG--NAME/snapshots/<sha>`` and ``refs/main`` layout) holds a
model and GSM8K-layout parquet files; ``fp4rl eval``, ``train`` and ``export`` run against
it with ``HF_HUB_OFFLINE=1``, and what the cache lacks is one line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _paths
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

SHA = "0123456789abcdef0123456789abcdef01234567"
FIXTURES = _paths.FIXTURES / "data"


def _snapshot(hub: Path, kind: str, repo: str) -> Path:
    root = hub / f"{kind}--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    snap = root / "snapshots" / SHA
    snap.mkdir(parents=True)
    return snap


def _gsm8k_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_llama_dir) -> Path:
    """A Hub cache holding ORG/smol (a model) and ORG/gsm (GSM8K parquet under main/)."""
    home = tmp_path_factory.mktemp("hf-home")
    hub = home / "hub"
    shutil.copytree(tiny_llama_dir, _snapshot(hub, "models", "ORG/smol"), dirs_exist_ok=True)
    rows = [json.loads(line) for line in (FIXTURES / "gsm8k.jsonl").read_text().splitlines()
            if line.strip()]
    data = _snapshot(hub, "datasets", "ORG/gsm")
    _gsm8k_parquet(data / "main" / "train-00000-of-00002.parquet", rows[: len(rows) // 2])
    _gsm8k_parquet(data / "main" / "train-00001-of-00002.parquet", rows[len(rows) // 2:])
    _gsm8k_parquet(data / "main" / "test-00000-of-00001.parquet", rows)
    _gsm8k_parquet(data / "main" / "bad-00000-of-00001.parquet",
                   [{"question": "What is 1 + 1?"}, *rows[:1]])
    return home


def fp4rl(home: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "fp4rl.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


GSM = "hf://datasets/ORG/gsm/main"


def test_eval_reads_a_hub_model_and_a_hub_dataset_file(hf_home, tmp_path):
    out = tmp_path / "eval.json"
    run = fp4rl(hf_home, "eval", "--model", "ORG/smol", "--data",
                f"gsm8k:{GSM}/test-00000-of-00001.parquet", "--n", "3", "--max-new-tokens",
                "4", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(out.read_text())["n"] == 3


def test_train_and_export_take_hub_ids_and_globs(hf_home, tmp_path):
    run = fp4rl(hf_home, "train", "--config", "smoke", "--steps", "1", "--output",
                str(tmp_path / "run"), "model=ORG/smol", "data.source=gsm8k",
                f"data.train_path={GSM}/train-*.parquet",
                f"data.test_path={GSM}/test-00000-of-00001.parquet",
                "grpo.batch_size=2", "grpo.micro_batch_size=8", "grpo.max_response_length=4",
                "data.train_size=6")
    assert run.returncode == 0, run.stderr[-2000:]
    export = fp4rl(hf_home, "export", "--model", "ORG/smol@main", "--format", "hif4",
                   "--output", str(tmp_path / "exp"))
    assert export.returncode == 0, export.stderr[-2000:]
    assert (tmp_path / "exp" / "config.json").is_file()


@pytest.mark.parametrize("args, says", [
    (["eval", "--model", "ORG/absent", "--n", "1"], "'ORG/absent' is not in the Hugging Face "
                                                   "cache"),
    (["eval", "--model", "ORG/smol", "--data", "gsm8k:hf://datasets/ORG/gsm/main/nope.parquet",
      "--n", "1"], "dataset file 'hf://datasets/ORG/gsm/main/nope.parquet' is not in the"),
    (["eval", "--model", "ORG/smol", "--data", "gsm8k:hf://datasets/ORG/gsm/other/*.parquet",
      "--n", "1"], "no file of ORG/gsm matches 'other/*.parquet'"),
    (["train", "--config", "qwen2.5-3b-gsm8k", "--output", "{tmp}/paper"],
     "model 'Qwen/Qwen2.5-3B' is not in the Hugging Face cache"),
])
def test_what_the_cache_lacks_is_one_line(hf_home, tmp_path, args, says):
    run = fp4rl(hf_home, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert says in lines[0] and "hf download" in lines[0]


def test_a_bad_row_of_a_hub_file_is_reported_as_for_a_local_file(hf_home, tmp_path):
    run = fp4rl(hf_home, "train", "--config", "smoke", "--output", str(tmp_path / "bad"),
                "model=ORG/smol", "data.source=gsm8k", "data.strict=true",
                f"data.train_path={GSM}/bad-00000-of-00001.parquet")
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-2000:]
    assert "bad-00000-of-00001.parquet: row 0:" in lines[0]
