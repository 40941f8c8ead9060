"""Tests for the residual sparsity patterns."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4rl.recovery.sparsity import (
    NM,
    Block,
    Channel,
    Dense,
    keep_mask,
    kept_count,
    parse_pattern,
    sparsify,
)


def reference_nm_mask(rows: list[list[float]], n: int, m: int) -> list[list[bool]]:
    """Plain-Python n:m selection: per group, sort by (-|v|, index) and keep the first n."""
    masks = []
    for row in rows:
        mask: list[bool] = []
        for start in range(0, len(row), m):
            group = row[start : start + m]
            order = sorted(range(len(group)), key=lambda i, g=group: (-abs(g[i]), i))
            kept = set(order[:n])
            mask += [i in kept for i in range(len(group))]
        masks.append(mask)
    return masks


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("dense", Dense()),
        (" Dense ", Dense()),
        ("2:4", NM(2, 4)),
        ("1:1", NM(1, 1)),
        ("4:4", NM(4, 4)),
        ("16:32", NM(16, 32)),
        ("channel:0.5", Channel(0.5)),
        ("channel:1", Channel(1.0)),
        ("channel:.25", Channel(0.25)),
        ("block:32x64:0.5", Block(32, 64, 0.5)),
        ("BLOCK:1x1:1.0", Block(1, 1, 1.0)),
    ],
)
def test_parse_pattern_accepts(text: str, expected: object) -> None:
    parsed = parse_pattern(text)
    assert parsed == expected
    assert parse_pattern(str(parsed)) == parsed
    assert parse_pattern(parsed) is parsed


@pytest.mark.parametrize(
    "text",
    [
        "3:2",
        "0:4",
        "2:0",
        "-1:4",
        "2:4:8",
        "channel:1.5",
        "channel:0",
        "channel:-0.5",
        "channel:",
        "channel:abc",
        "channel:nan",
        "block:32x64",
        "block:0x64:0.5",
        "block:32x0:0.5",
        "block:32x64:0",
        "block:32x64:1.5",
        "block:32:0.5",
        "foo",
        "",
    ],
)
def test_parse_pattern_rejects_with_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="accepted") as info:
        parse_pattern(text)
    message = str(info.value)
    for form in ('"dense"', '"2:4"', '"channel:0.5"', '"block:32x64:0.5"'):
        assert form in message


def test_parse_pattern_rejects_non_strings() -> None:
    with pytest.raises(ValueError, match="accepted"):
        parse_pattern(0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("dense", 1.0),
        ("2:4", 0.5),
        ("1:8", 0.125),
        ("3:4", 0.75),
        ("channel:0.5", 0.5),
        ("block:32x64:0.5", 0.5),
        ("block:4x4:0.25", 0.25),
    ],
)
def test_density(pattern: str, expected: float) -> None:
    assert parse_pattern(pattern).density == expected


@pytest.mark.parametrize(
    ("fraction", "total", "expected"),
    [
        (0.5, 4, 2),
        (0.5, 5, 3),
        (0.3, 10, 3),
        (0.1, 30, 3),
        (0.25, 5, 2),
        (0.01, 4, 1),
        (1.0, 7, 7),
        (0.7, 10, 7),
        (0.07, 100, 7),  # 0.07 * 100 == 7.000000000000001 in binary floating point
        (0.14, 100, 14),
        (1e-9, 3, 1),
    ],
)
def test_kept_count_is_exact_ceil(fraction: float, total: int, expected: int) -> None:
    assert kept_count(fraction, total) == expected


def test_dense_returns_input_unchanged() -> None:
    x = torch.randn(3, 5)
    assert sparsify(x, "dense") is x
    assert keep_mask(x, parse_pattern("dense")).all()


@pytest.mark.parametrize(
    ("pattern", "row", "expected"),
    [
        (
            "2:4",
            [1.0, -4.0, 3.0, 2.0, 0.5, 0.5, -0.5, 0.1],
            [0.0, -4.0, 3.0, 0.0, 0.5, 0.5, 0.0, 0.0],
        ),
        ("2:4", [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]),
        ("2:4", [-1.0, 1.0, -1.0, 1.0], [-1.0, 1.0, 0.0, 0.0]),
        ("1:4", [2.0, -3.0, 3.0, 1.0], [0.0, -3.0, 0.0, 0.0]),
        ("1:2", [5.0, 6.0, -7.0, 7.0], [0.0, 6.0, -7.0, 0.0]),
        ("4:4", [1.0, 0.0, -2.0, 3.0], [1.0, 0.0, -2.0, 3.0]),
        # Partial trailing groups keep their min(n, r) largest.
        ("2:4", [1.0, 2.0, 3.0, 4.0, 5.0, 0.1], [0.0, 0.0, 3.0, 4.0, 5.0, 0.1]),
        ("2:4", [1.0, 2.0, 3.0, 4.0, 0.0, 7.0, -9.0], [0.0, 0.0, 3.0, 4.0, 0.0, 7.0, -9.0]),
        ("2:4", [1.0, 2.0, 3.0, 4.0, 7.0], [0.0, 0.0, 3.0, 4.0, 7.0]),
        ("2:4", [3.0], [3.0]),
        # Groups wider than the pairwise limit go through the stable sort.
        (
            "2:10",
            [1.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
            [0.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0],
        ),
        ("3:12", [2.0] * 12, [2.0] * 3 + [0.0] * 9),
    ],
)
def test_nm_exact_masks(pattern: str, row: list[float], expected: list[float]) -> None:
    x = torch.tensor([row])
    assert torch.equal(sparsify(x, pattern), torch.tensor([expected]))


small_values = st.integers(-3, 3).map(float)


@st.composite
def matrices_and_nm(draw: st.DrawFn) -> tuple[list[list[float]], int, int]:
    m = draw(st.integers(1, 12))
    n = draw(st.integers(1, m))
    rows, cols = draw(st.integers(1, 3)), draw(st.integers(1, 26))
    values = draw(
        st.lists(st.lists(small_values, min_size=cols, max_size=cols), min_size=rows, max_size=rows)
    )
    return values, n, m


@settings(max_examples=100, deadline=None)
@given(matrices_and_nm())
def test_nm_matches_reference_with_many_ties(case: tuple[list[list[float]], int, int]) -> None:
    values, n, m = case
    x = torch.tensor(values)
    expected = torch.tensor(reference_nm_mask(values, n, m))
    assert torch.equal(keep_mask(x, parse_pattern(f"{n}:{m}")), expected)
    assert torch.equal(sparsify(x, f"{n}:{m}"), x * expected)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 16),
    extra=st.integers(0, 16),
    groups=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_nm_keeps_exactly_n_per_full_group_of_nonzeros(
    n: int, extra: int, groups: int, seed: int
) -> None:
    m = n + extra
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, groups * m, generator=gen)
    x = torch.where(x == 0, 1.0, x)
    kept = sparsify(x, f"{n}:{m}").reshape(2, groups, m)
    assert torch.all((kept != 0).sum(-1) == n)
    magnitude = x.abs().reshape(2, groups, m)
    smallest_kept = torch.where(kept != 0, magnitude, torch.inf).amin(-1)
    largest_dropped = torch.where(kept == 0, magnitude, -torch.inf).amax(-1)
    assert torch.all(smallest_kept >= largest_dropped)


@pytest.mark.parametrize("pattern", ["2:4", "1:8", "channel:0.5", "block:2x3:0.4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shape_and_dtype_preserved(pattern: str, dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 16).to(dtype)
    out = sparsify(x, pattern)
    assert out.shape == x.shape
    assert out.dtype == dtype
    kept = out != 0
    assert torch.equal(out[kept], x[kept])


@pytest.mark.parametrize("pattern", ["2:4", "channel:0.5", "block:2x2:0.5"])
def test_empty_and_scalar_inputs(pattern: str) -> None:
    assert sparsify(torch.empty(0, 8), pattern).shape == (0, 8)
    with pytest.raises(ValueError, match="scalar"):
        sparsify(torch.tensor(1.0), pattern)


def test_channel_keeps_top_l2_norm_columns_over_all_tokens() -> None:
    # L2 norms over both batch entries: [4.24, 5, 1, 4.5]; an L1 ranking would pick column 0.
    x = torch.tensor([[[3.0, 5.0, 0.0, 4.5]], [[3.0, 0.0, -1.0, 0.0]]])
    kept = keep_mask(x, parse_pattern("channel:0.5"))
    expected_columns = torch.tensor([False, True, False, True])
    assert torch.equal(kept, expected_columns.expand(2, 1, 4))


def test_wide_ties_keep_the_lowest_indices() -> None:
    """Long tied runs: an unstable sort would pick arbitrary positions."""
    row = torch.ones(1, 4096)
    first_half = torch.arange(4096) < 2048
    assert torch.equal(keep_mask(row, parse_pattern("channel:0.5"))[0], first_half)
    tiles = keep_mask(row.reshape(64, 64), parse_pattern("block:1x1:0.5"))
    assert torch.equal(tiles.flatten(), first_half)
    assert torch.equal(keep_mask(row, parse_pattern("4:256"))[0, :256], torch.arange(256) < 4)


@pytest.mark.parametrize(
    ("fraction", "expected_columns"),
    [
        ("0.5", [True, True, False, False]),  # all four norms tie: lowest indices win
        ("0.25", [True, False, False, False]),
        ("0.3", [True, True, False, False]),  # ceil(1.2) = 2
        ("1", [True, True, True, True]),
    ],
)
def test_channel_ties_and_rounding(fraction: str, expected_columns: list[bool]) -> None:
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 2.0, -2.0, 2.0]])
    kept = keep_mask(x, parse_pattern(f"channel:{fraction}"))
    assert torch.equal(kept, torch.tensor(expected_columns).expand(2, 4))


def test_block_keeps_top_norm_tiles() -> None:
    x = torch.zeros(4, 4)
    x[0:2, 2:4] = 1.0  # tile (0, 1): norm 2
    x[2:4, 0:2] = 3.0  # tile (1, 0): norm 6
    x[0, 0] = 1.5  # tile (0, 0): norm 1.5
    out = sparsify(x, "block:2x2:0.5")
    expected = torch.zeros(4, 4)
    expected[0:2, 2:4] = 1.0
    expected[2:4, 0:2] = 3.0
    assert torch.equal(out, expected)


def test_block_partial_edge_tiles_and_ties() -> None:
    # 3x3 in 2x2 tiles: (0,0) is 2x2, (0,1) 2x1, (1,0) 1x2, (1,1) 1x1.
    x = torch.ones(3, 3)
    x[2, 2] = 10.0
    kept = keep_mask(x, parse_pattern("block:2x2:0.5"))
    expected = torch.tensor(
        [
            [True, True, False],
            [True, True, False],
            [False, False, True],
        ]
    )
    assert torch.equal(kept, expected)
    # Equal-norm tiles: row-major order decides, so tile (0,0) beats (1,1).
    tied = torch.zeros(4, 4)
    tied[0, 0], tied[3, 3] = 1.0, -1.0
    expected_tied = torch.zeros(4, 4)
    expected_tied[0, 0] = 1.0
    assert torch.equal(sparsify(tied, "block:2x2:0.25"), expected_tied)


def test_block_flattens_leading_dims_into_rows() -> None:
    x = torch.zeros(2, 2, 4)
    x[1, 1, 3] = 5.0  # flattened row 3, column 3: tile (1, 1) of a 4x4 matrix
    kept = keep_mask(x, parse_pattern("block:2x2:0.25"))
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[2:4, 2:4] = True
    assert torch.equal(kept, expected.reshape(2, 2, 4))


@pytest.mark.parametrize(
    ("shape", "pattern", "expected_kept"),
    [
        ((64, 128), "block:32x64:0.5", 2 * 32 * 64),
        ((50, 100), "block:32x64:0.5", 32 * 64 + 32 * 36),  # full tile + right edge tile
        ((8, 10), "channel:0.5", 8 * 5),
        ((8, 10), "channel:0.55", 8 * 6),
    ],
)
def test_kept_counts_for_fraction_patterns(
    shape: tuple[int, int], pattern: str, expected_kept: int
) -> None:
    # Magnitudes grow with position so the biggest tiles/channels are the full ones.
    x = torch.arange(1, shape[0] * shape[1] + 1, dtype=torch.float32).reshape(shape).flip(0, 1)
    assert keep_mask(x, parse_pattern(pattern)).sum().item() == expected_kept


def test_resq_reads_its_pattern_once_at_the_config_and_writes_it_back_as_text():
    """The config holds the parsed pattern (no caller parses it again) and writes the
    string it reads; what a split across ranks asks of it is the pattern's own answer."""
    from fp4rl.errors import RecipeError
    from fp4rl.recovery.resq import ResQConfig
    from fp4rl.recovery.resqw import ResQWConfig

    config = ResQConfig(sparsity=" Block:32x64:0.5 ")
    assert config.sparsity == Block(32, 64, 0.5) and config.patterns == (Block(32, 64, 0.5),)
    assert config.model_dump() == {"sparsity": "block:32x64:0.5"}
    assert ResQConfig.model_validate(config.model_dump()) == config
    assert ResQConfig().sparsity == NM(2, 4) and ResQConfig.from_text("").sparsity == Dense()
    assert ResQWConfig.from_text("1:4").patterns == (NM(1, 4), NM(1, 4))
    assert [p.local for p in (Dense(), NM(2, 4), Channel(0.5), Block(2, 2, 0.5))] == \
        [True, True, False, False]
    with pytest.raises(RecipeError, match="invalid sparsity pattern '3:2'"):
        ResQConfig(sparsity="3:2")
