"""Tests for the Rollout-ResQ overhead model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp4rl.analysis.cost import CostRow, cost_table, format_cost_table
from fp4rl.recovery.sparsity import parse_pattern

dims = st.integers(1, 2**14)


def by_name(rows: list[CostRow]) -> dict[str, CostRow]:
    return {row.name: row for row in rows}


@given(m=dims, d=dims, n=dims)
def test_paper_overheads_hold_exactly_for_any_shape(m: int, d: int, n: int) -> None:
    rows = by_name(cost_table(m, d, n))
    mdn = m * d * n
    assert rows["bf16"] == CostRow("bf16", 2 * mdn, 2.0, 1.0)
    assert rows["fp4"] == CostRow("fp4", mdn / 2, 0.5, 4.0)
    assert rows["resq-dense"] == CostRow("resq-dense", mdn, 1.0, 2.0)
    assert rows["resq-2:4"] == CostRow("resq-2:4", 3 * mdn / 4, 0.75, 8 / 3)


@pytest.mark.parametrize(
    ("pattern", "name", "speedup"),
    [
        ("channel:0.5", "resq-channel:0.5", 8 / 3),
        ("block:32x64:0.5", "resq-block:32x64:0.5", 8 / 3),
        ("1:4", "resq-1:4", 4 / 1.25),
        ("1:8", "resq-1:8", 4 / 1.125),
        ("channel:0.25", "resq-channel:0.25", 4 / 1.25),
    ],
)
def test_other_patterns_use_their_density(pattern: str, name: str, speedup: float) -> None:
    rows = cost_table(128, 4096, 4096, sparsities=[parse_pattern(pattern)])
    assert [row.name for row in rows] == ["bf16", "fp4", name]
    assert rows[-1].speedup == speedup
    assert rows[-1].flops == pytest.approx(2 * 128 * 4096 * 4096 / speedup, rel=1e-12)


@pytest.mark.parametrize(
    ("fp4_speedup", "dense_speedup", "sparse_speedup"),
    [(4.0, 2.0, 8 / 3), (2.0, 1.0, 4 / 3), (8.0, 4.0, 16 / 3)],
)
def test_fp4_speedup_scales_every_fp4_row(
    fp4_speedup: float, dense_speedup: float, sparse_speedup: float
) -> None:
    rows = by_name(cost_table(4, 8, 16, fp4_speedup=fp4_speedup))
    assert rows["fp4"].speedup == fp4_speedup
    assert rows["resq-dense"].speedup == pytest.approx(dense_speedup)
    assert rows["resq-2:4"].speedup == pytest.approx(sparse_speedup)


def test_row_order_follows_requested_patterns() -> None:
    patterns = [parse_pattern(p) for p in ("2:4", "dense", " Channel:0.5 ")]
    rows = cost_table(1, 1, 1, sparsities=patterns)
    assert [row.name for row in rows] == [
        "bf16",
        "fp4",
        "resq-2:4",
        "resq-dense",
        "resq-channel:0.5",
    ]
    assert [row.name for row in cost_table(1, 1, 1, sparsities=())] == ["bf16", "fp4"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"m": 0}, "positive"),
        ({"n": -3}, "positive"),
        ({"fp4_speedup": 0.0}, "fp4_speedup"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"m": 2, "d": 2, "n": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        cost_table(**args)  # type: ignore[arg-type]


def test_markdown_table() -> None:
    text = format_cost_table(cost_table(1024, 4096, 4096))
    lines = text.splitlines()
    assert lines[0] == "| method | effective FLOPs | FLOPs / mdn | speedup vs BF16 |"
    assert lines[1] == "|---|---:|---:|---:|"
    assert lines[2:] == [
        "| bf16 | 3.436e+10 | 2 | 1.00x |",
        "| fp4 | 8.59e+09 | 0.5 | 4.00x |",
        "| resq-dense | 1.718e+10 | 1 | 2.00x |",
        "| resq-2:4 | 1.288e+10 | 0.75 | 2.67x |",
    ]
