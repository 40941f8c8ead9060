"""Diagnostics and rollout fidelity, on constructed tensors and tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from fp4rl.analysis.diagnose import diagnose_activations
from fp4rl.analysis.fidelity import compare, default_methods, make_batch
from fp4rl.analysis.prompts import load_prompts
from fp4rl.cli import main
from fp4rl.formats import quantize


def test_diagnose_statistics_match_definitions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 128, generator=g)
    x[:, 5] = 1000.0  # one outlier channel: every 64/32-block holding it collapses
    x[0, 100:110] = 0.0
    d = diagnose_activations("model.layers.0.mlp.down_proj", x, ["hif4", "mxfp4"])
    assert d.zero_frac["bf16"] == pytest.approx(10 / x.numel())
    assert d.zero_frac["hif4"] == (quantize(x, "hif4") == 0).float().mean().item()
    # the block holding the outlier collapses (63 of 64, 31 of 32), the others do not
    assert 0.45 < d.zero_frac["hif4"] < 0.6 and 0.2 < d.zero_frac["mxfp4"] < 0.35
    assert d.outlier_block_frac["hif4"] == pytest.approx(0.5)   # 1 of 2 blocks per row
    assert d.outlier_block_frac["mxfp4"] == pytest.approx(0.25)  # 1 of 4 blocks per row
    for fmt in ("hif4", "mxfp4"):  # the residual tolerates 2:4 far better than Q(X)
        assert d.sparsify_mse[fmt]["residual"] < d.sparsify_mse[fmt]["qx"]
        assert d.sparsify_rmse[fmt]["qx"] == pytest.approx(d.sparsify_mse[fmt]["qx"] ** 0.5)


def test_diagnose_cli_on_tiny_model(tiny_llama_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "What is 2 + 2?"}\n\n{"prompt": "Add 3 and 4."}\n')
    out, js = tmp_path / "diag", tmp_path / "d.json"
    assert main(["diagnose", "--model", str(tiny_llama_dir), "--format", "hif4",
                 "--format", "mxfp4", "--prompts", str(prompts), "--out", str(out),
                 "--json", str(js)]) == 0
    data = json.loads(js.read_text())
    assert len(data["layers"]) == 14
    first = data["layers"][0]
    assert first["name"].startswith("model.layers.0.")
    assert set(first["zero_frac"]) == {"bf16", "hif4", "mxfp4"}
    for png in ("zero_frac.png", "outlier_blocks.png", "sparsify_error.png", "heatmap.png"):
        assert (out / png).stat().st_size > 1000


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no text field"):
        load_prompts(bad)
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "missing.txt")


def test_kl_and_logprob_difference():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, -1.0]]), -1)
    assert compare(ref, ref, torch.tensor([0])) == (0.0, 0.0)
    other = torch.log_softmax(torch.tensor([[0.0, 2.0, -1.0]]), -1)
    kl, diff = compare(ref, other, torch.tensor([0]))
    want = (ref.exp() * (ref - other)).sum().item()
    assert kl == pytest.approx(want) and diff == pytest.approx(2.0)


def test_batch_scores_only_completions():
    b = make_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]
    assert b.scored.tolist() == [[False, False, False, True, True],
                                 [False, True, True, True, False]]


def test_default_methods_cover_the_paper():
    methods = default_methods()
    assert methods[0] == "bf16" and len(methods) == 1 + 2 * 9  # the paper's 8 rows + ResQ-W
    assert {"hif4", "hif4+resq-2:4", "hif4+resq-channel:0.5", "hif4+resq-block:32x64:0.5",
            "hif4+smoothquant", "hif4+rht", "hif4+occ", "mxfp4+resq-dense",
            "hif4+resqw-2:4"} <= set(methods)


def test_fidelity_cli_on_tiny_model(tiny_llama_dir, tmp_path):
    js, png = tmp_path / "f.json", tmp_path / "f.png"
    assert main(["fidelity", "--model", str(tiny_llama_dir), "--methods", "bf16", "mxfp4",
                 "mxfp4+resq-dense", "--n", "4", "--max-new-tokens", "6", "--json", str(js),
                 "--plot", str(png)]) == 0
    rows = {r["method"]: r for r in json.loads(js.read_text())["rows"]}
    assert list(rows) == ["bf16", "mxfp4", "mxfp4+resq-dense"]
    assert rows["bf16"]["kl"] < rows["mxfp4+resq-dense"]["kl"] < rows["mxfp4"]["kl"]
    assert rows["mxfp4"]["kl_vs_train"] == pytest.approx(0.0, abs=1e-6)  # same numerics
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows.values())
    assert png.stat().st_size > 1000


def test_fidelity_rejects_bad_method(tiny_llama_dir, capsys):
    assert main(["fidelity", "--model", str(tiny_llama_dir), "--methods", "hif5"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe" in err and "did you mean 'hif4'" in err and "Traceback" not in err
