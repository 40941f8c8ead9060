"""``fp4rl bench linear --traffic``: the bytes each launch of an FP4 linear moves on a GPU,
held to a count made by hand from the layer's docstring, and its command line."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from fp4rl.bench.traffic import linear_traffic
from fp4rl.cli import main

pytest.importorskip("triton")

M, K, N = 32, 64, 128  # tokens, in_features, out_features
F32, BF16 = 4, 2


def _hand_count() -> tuple[Counter, Counter]:
    """HiF4 on all three GEMMs, bf16 compute, FP32 masters (nn/linear.py's docstring).

    Forward: Q(W) along in_features and along out_features (the input gradient's, kept
    for the backward), one read of the fp32 master, both written by the quantizer in bf16
    (the GEMMs' operands); Q(X) along in_features and along the tokens (the weight
    gradient's, saved), one read, both written in bf16; the GEMM (reads both bf16
    operands, writes Y in bf16).
    Backward: Q(dY) along out_features and along the tokens, one read (bf16 in, bf16 out);
    dX = Q(dY) Q(W) in bf16, cast to the input's fp32; dW = Q(dY)^T Q(X) in bf16, cast to
    the master's fp32."""
    x, w, y = M * K, N * K, M * N
    fp4 = Counter({
        ("forward", "quantize_both", w * F32, 2 * w * BF16): 1,
        ("forward", "quantize_both", x * F32, 2 * x * BF16): 1,
        ("forward", "mm", (x + w) * BF16, y * BF16): 1,
        ("backward", "quantize_both", y * BF16, 2 * y * BF16): 1,
        ("backward", "mm", (y + w) * BF16, x * BF16): 1,
        ("backward", "cast", x * BF16, x * F32): 1,
        ("backward", "mm", (y + x) * BF16, w * BF16): 1,
        ("backward", "cast", w * BF16, w * F32): 1,
    })
    bf16 = Counter({
        ("forward", "cast", x * F32, x * BF16): 1,
        ("forward", "cast", w * F32, w * BF16): 1,
        ("forward", "mm", (x + w) * BF16, y * BF16): 1,
        ("backward", "mm", (y + w) * BF16, x * BF16): 1,
        ("backward", "mm", (y + x) * BF16, w * BF16): 1,
        ("backward", "cast", x * BF16, x * F32): 1,
        ("backward", "cast", w * BF16, w * F32): 1,
    })
    return fp4, bf16


def _launches(rec) -> Counter:
    return Counter((x.phase, x.name, x.read, x.written) for x in rec.launches)


def test_the_report_counts_what_the_layer_launches():
    t = linear_traffic("hif4", (M, K, N))
    fp4, bf16 = _hand_count()
    assert _launches(t.fp4) == fp4
    assert _launches(t.bf16) == bf16
    total = sum((r + w) * c for (_, _, r, w), c in fp4.items())
    assert t.fp4.total() == total
    assert t.ratio == pytest.approx(total / sum((r + w) * c for (_, _, r, w), c in bf16.items()))
    gemms = [x for x in t.fp4.launches if x.name == "mm"]
    assert [x.flops for x in gemms] == [2 * M * K * N] * 3


def test_micro_batches_after_the_first_read_the_kept_weight_operands():
    """From the second micro-batch on, the FP4 layer reads its kept Q(W) operands: no
    quantize of the master (4 bytes read, 2 x 2 written per weight); the bf16
    baseline casts its weight every time (autocast). From the second on
    the weight gradient also accumulates into the fp32 .grad (reads two, writes one), in
    both layers."""
    one, four = linear_traffic("hif4", (M, K, N)), linear_traffic("hif4", (M, K, N), 4)
    w = N * K
    accumulate = 3 * (3 * w * F32)
    kept = 3 * (F32 + 2 * BF16) * w
    assert four.fp4.total() == 4 * one.fp4.total() + accumulate - kept
    assert four.bf16.total() == 4 * one.bf16.total() + accumulate


def test_cli_prints_the_target_and_writes_json(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "linear", "--traffic", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "target: fp4 bytes <= 1.2x bf16" in printed and "H200" in printed
    data = json.loads(out.read_text())
    assert data["fp4_bytes"] > data["bf16_bytes"] > 0
    assert data["ratio"] == pytest.approx(data["fp4_bytes"] / data["bf16_bytes"])
    assert data["shape"] == [512, 2048, 11008]


@pytest.mark.parametrize("argv", [["bench", "linear", "--traffic", "--shape", "512,2048"],
                                  ["bench", "linear", "--shape", "8,64,64"],
                                  ["bench", "formats", "--traffic"],
                                  ["bench", "rollout", "--traffic", "--recipe", "mxfp4",
                                   "--format", "hif4"],
                                  ["bench", "rollout", "--traffic", "--format", "hif4",
                                   "--format", "mxfp4"],
                                  ["bench", "rollout", "--recipe", "mxfp4"],
                                  ["bench", "formats", "--recipe", "mxfp4"]])
def test_cli_refuses_bad_traffic_options_in_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1


def test_the_rollout_report_counts_one_vllm_method_linear():
    """At decode: bf16 reads x and its bf16 weight and writes y; the dequantized store adds
    the activation operator (x in, bf16 values and a scale per row out); the packed store
    reads its codes and scales (their bytes) in one fused GEMM on a GPU at decode sizes,
    and its other path decodes them into a bf16 weight before the same GEMM, with no copy
    of a one-part weight."""
    import torch

    from fp4rl.bench.traffic import rollout_traffic
    from fp4rl.gemm import pack_operand

    m, k, n = 4, 64, 128
    got = rollout_traffic("hif4", m, (k, n)).as_dict()
    gemm = (m * k + n * k) * BF16 + m * n * BF16
    assert got["bf16_bytes"] == gemm
    activation = m * k * BF16 + (m * k * BF16 + m * F32)
    assert got["dequantized_bytes"] == activation + gemm
    packed = pack_operand(torch.randn(n, k), "hif4").packed
    fields = sum(t.numel() * t.element_size() for t in packed.fields.values())
    assert [x["name"] for x in got["packed_launches"]] == ["rollout_activation", "packed_mm"]
    assert got["packed_bytes"] == activation + m * k * BF16 + fields + m * n * BF16
    assert got["packed_launches"][1]["flops"] == 2 * m * k * n
    assert got["packed_ratio"] < 0.5
    assert [x["name"] for x in got["packed_decode_launches"]] == ["rollout_activation",
                                                                  "decode_rows", "mm"]
    assert got["packed_decode_bytes"] == activation + fields + n * k * BF16 + gemm
    assert got["packed_decode_ratio"] > 1
    # ResQ's two terms share the decoded weight: one read of the codes for both
    two = rollout_traffic("hif4+resq-2:4", m, (k, n)).as_dict()
    assert [x["name"] for x in two["packed_launches"]] == ["rollout_activation", "packed_mm"]
    assert two["packed_launches"][1]["read"] == 2 * m * k * BF16 + fields
    # past the fused kernel's token count the packed store decodes, then multiplies
    from fp4rl.kernels import FUSED_MAX_ROWS

    big = rollout_traffic("hif4", FUSED_MAX_ROWS + 1, (k, n)).as_dict()
    assert [x["name"] for x in big["packed_launches"]] == ["rollout_activation",
                                                           "decode_rows", "mm"]


def test_cli_rollout_traffic(capsys):
    assert main(["bench", "rollout", "--traffic", "--shape", "64,256,512"]) == 0
    out = capsys.readouterr().out
    assert "packed:" in out and "target: the packed linear <= 0.4x" in out
    assert "packed_mm" in out


def test_rollout_traffic_reports_the_linears_keys_for_the_recipe_asked(tmp_path, capsys):
    """``bench rollout --traffic``: ``--recipe`` is the recipe counted (as ``--format`` is),
    and the report has the linear report's keys, the packed store as the FP4 side."""
    from fp4rl.bench.traffic import rollout_traffic

    out = tmp_path / "r.json"
    assert main(["bench", "rollout", "--traffic", "--recipe", "nvfp4", "--shape", "8,64,128",
                 "--json", str(out)]) == 0
    assert "(nvfp4, 8 tokens" in capsys.readouterr().out
    data = json.loads(out.read_text())
    linear = linear_traffic("hif4", (8, 64, 128)).as_dict()
    shared = {"shape", "recipe", "fp4_bytes", "bf16_bytes", "ratio", "target",
              "fp4_launches", "bf16_launches"}
    assert shared <= set(linear) and shared <= set(data)
    assert data["recipe"] == "nvfp4" and data["shape"] == [8, 64, 128]
    expected = rollout_traffic("nvfp4", 8, (64, 128)).as_dict()
    assert data["storage"] == "packed"
    assert data["fp4_bytes"] == expected["packed_bytes"] != \
        rollout_traffic("hif4", 8, (64, 128)).as_dict()["packed_bytes"]
    assert data["bf16_bytes"] == expected["bf16_bytes"]
    assert data["ratio"] == pytest.approx(data["fp4_bytes"] / data["bf16_bytes"])
    assert data["target"] is None  # set for 64 tokens
