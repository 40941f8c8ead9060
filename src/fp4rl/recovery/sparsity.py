"""Sparsity patterns for the Rollout-ResQ residual term.

The residual GEMM ``S(Q(X - Q(X))) Q(W)^T`` only pays for itself when ``S``
drops enough of the residual to run on sparse hardware paths, so each pattern
here mirrors a structure an accelerator can exploit:

``"dense"``
    Keep everything (the residual GEMM runs dense).
``"n:m"``, e.g. ``"2:4"``
    Semi-structured sparsity: in every run of ``m`` consecutive values along the
    last (reduction) axis keep the ``n`` largest magnitudes.
``"channel:<fraction>"``, e.g. ``"channel:0.5"``
    Keep the input channels (last-axis positions) with the largest L2 norm over
    all tokens; the residual GEMM then shrinks along its reduction dimension.
``"block:<r>x<c>:<fraction>"``, e.g. ``"block:32x64:0.5"``
    Keep the ``r x c`` tiles of the token-by-channel matrix with the largest L2
    norm, which block-sparse GEMM kernels skip tile by tile.

Selection rules shared by all patterns (all inputs are assumed finite):

* Ties in magnitude or norm are broken by position: the lower index wins
  (for tiles, row-major tile order). Selections are therefore deterministic,
  which matters because FP4-quantized residuals sit on a coarse grid and tie
  often.
* A fraction ``f`` of ``k`` candidates keeps ``ceil(f * k)`` of them, where
  ``f * k`` is evaluated exactly on the decimal value of ``f`` (so
  ``0.3 * 10`` keeps 3, not 4). Rounding up means at least the requested share
  survives and a non-empty input never loses everything.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated, ClassVar

import torch
from pydantic import BeforeValidator, PlainSerializer
from torch import Tensor

from fp4rl.errors import UserError
from fp4rl.settings import Choices

ACCEPTED_FORMS = (
    '"dense", "n:m" with 1 <= n <= m (e.g. "2:4"), "channel:<fraction>" with '
    '0 < fraction <= 1 (e.g. "channel:0.5"), "block:<r>x<c>:<fraction>" with '
    'r, c >= 1 and 0 < fraction <= 1 (e.g. "block:32x64:0.5")'
)

# Above this group size the O(m^2) pairwise ranking loses to a stable sort.
_PAIRWISE_MAX_GROUP = 8

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_NM_RE = re.compile(r"(\d+):(\d+)")
_CHANNEL_RE = re.compile(rf"channel:{_NUMBER}")
_BLOCK_RE = re.compile(rf"block:(\d+)x(\d+):{_NUMBER}")


@dataclass(frozen=True)
class Dense:
    """Keep every entry."""

    #: whether what it keeps of a row depends only on a run of ``m`` values along it (so a
    #: rank holding a slice of the inputs, cut at whole runs, keeps what the whole would)
    local: ClassVar[bool] = True

    @property
    def density(self) -> float:
        return 1.0

    def __str__(self) -> str:
        return "dense"


@dataclass(frozen=True)
class NM:
    """Keep the ``n`` largest magnitudes of every ``m`` consecutive values."""

    n: int
    m: int
    local: ClassVar[bool] = True

    @property
    def density(self) -> float:
        return self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


@dataclass(frozen=True)
class Channel:
    """Keep the top ``fraction`` of last-axis channels by L2 norm over tokens."""

    fraction: float
    local: ClassVar[bool] = False  # ranks channels by their norm over the whole input

    @property
    def density(self) -> float:
        return self.fraction

    def __str__(self) -> str:
        return f"channel:{self.fraction}"


@dataclass(frozen=True)
class Block:
    """Keep the top ``fraction`` of ``rows x cols`` tiles by L2 norm."""

    rows: int
    cols: int
    fraction: float
    local: ClassVar[bool] = False  # ranks tiles by their norm over the whole matrix

    @property
    def density(self) -> float:
        return self.fraction

    def __str__(self) -> str:
        return f"block:{self.rows}x{self.cols}:{self.fraction}"


#: a parsed pattern; its ``density`` is the nominal kept fraction (n/m, the fraction, 1 for
#: dense), the figure a cost model uses (a fraction pattern keeps slightly more where its
#: kept count rounds up)
SparsityPattern = Dense | NM | Channel | Block


def parse_pattern(pattern: str | SparsityPattern) -> SparsityPattern:
    """Parse a pattern string (case and surrounding spaces ignored).

    Already-parsed patterns pass through, so callers can accept either form.
    Raises :class:`~fp4rl.errors.UserError` (a ``ValueError``) naming the accepted forms
    for anything malformed or out of range.
    """
    if isinstance(pattern, SparsityPattern):
        return pattern
    if not isinstance(pattern, str):
        raise UserError(
            f"sparsity pattern must be a string, got {pattern!r}; accepted: {ACCEPTED_FORMS}"
        )
    text = pattern.strip().lower()
    parsed = _parse_text(text)
    if parsed is None:
        raise UserError(f"invalid sparsity pattern {pattern!r}; accepted: {ACCEPTED_FORMS}")
    return parsed


def _parse_text(text: str) -> SparsityPattern | None:
    """Return the pattern for ``text``, or None when it is malformed or out of range."""
    if text == "dense":
        return Dense()
    if match := _NM_RE.fullmatch(text):
        n, m = int(match[1]), int(match[2])
        return NM(n, m) if 1 <= n <= m else None
    if match := _CHANNEL_RE.fullmatch(text):
        fraction = float(match[1])
        return Channel(fraction) if 0.0 < fraction <= 1.0 else None
    if match := _BLOCK_RE.fullmatch(text):
        rows, cols, fraction = int(match[1]), int(match[2]), float(match[3])
        valid = rows >= 1 and cols >= 1 and 0.0 < fraction <= 1.0
        return Block(rows, cols, fraction) if valid else None
    return None


def kept_count(fraction: float, total: int) -> int:
    """Number of candidates a ``fraction`` keeps out of ``total`` (exact ceil)."""
    return min(total, math.ceil(Fraction(repr(fraction)) * total))


def sparsify(x: Tensor, pattern: str | SparsityPattern) -> Tensor:
    """Zero the entries of ``x`` that ``pattern`` drops.

    Returns a tensor of the same shape and dtype; ``"dense"`` returns ``x``
    itself without copying. Dropped entries become +0, as in the fused kernels (``x * 0``
    would keep the sign of a dropped negative value and a dropped NaN).
    """
    parsed = parse_pattern(pattern)
    if isinstance(parsed, Dense):
        return x
    return torch.where(keep_mask(x, parsed), x, x.new_zeros(()))


def keep_mask(x: Tensor, pattern: SparsityPattern) -> Tensor:
    """Boolean mask (shape of ``x``) of the entries ``pattern`` (pattern: :func:`sparsify`
    reads a name) keeps.

    Treat it as read-only: for channel patterns it is a broadcast view.
    """
    if x.dim() == 0:
        raise ValueError("sparsity needs a tensor with a last (reduction) axis, got a scalar")
    if x.numel() == 0 or isinstance(pattern, Dense):
        return torch.ones_like(x, dtype=torch.bool)
    if isinstance(pattern, NM):
        return _nm_mask(x, pattern.n, pattern.m)
    if isinstance(pattern, Channel):
        return _channel_mask(x, pattern.fraction)
    return _block_mask(x, pattern.rows, pattern.cols, pattern.fraction)


def _nm_mask(x: Tensor, n: int, m: int) -> Tensor:
    """n:m mask along the last axis.

    A last axis whose length is not a multiple of ``m`` is zero-padded to the
    next multiple before grouping. Padding sits at the highest indices, so it
    loses every tie: a trailing partial group of ``r`` values keeps its
    ``min(n, r)`` largest.
    """
    d = x.shape[-1]
    pad = -d % m
    magnitude = x.abs()
    if pad:
        magnitude = torch.nn.functional.pad(magnitude, (0, pad))
    groups = magnitude.reshape(-1, m)
    keep = _top_n_pairwise(groups, n) if m <= _PAIRWISE_MAX_GROUP else _top_n_by_sort(groups, n)
    return keep.reshape(*x.shape[:-1], d + pad)[..., :d]


def _top_n_pairwise(groups: Tensor, n: int) -> Tensor:
    """Mask of the ``n`` largest per row, ranking by pairwise wins (lower index wins ties).

    Counting wins keeps every operation a vectorized elementwise pass over the
    groups, which beats sorting millions of tiny rows on CPU.
    """
    m = groups.shape[-1]
    rank = torch.zeros(groups.shape, dtype=torch.uint8, device=groups.device)
    values, ranks = groups.unbind(-1), rank.unbind(-1)
    for i in range(m):
        for j in range(i + 1, m):
            later_wins = values[j] > values[i]
            ranks[i].add_(later_wins)
            ranks[j].add_(~later_wins)
    return rank < n


def _top_n_by_sort(groups: Tensor, n: int) -> Tensor:
    """Mask of the ``n`` largest per row; the stable sort keeps ties in index order."""
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros(groups.shape, dtype=torch.bool, device=groups.device)
    return keep.scatter_(-1, order[..., :n], True)


def _top_fraction(scores: Tensor, fraction: float) -> Tensor:
    """Mask of the top ``fraction`` of a 1-D score vector, lower index winning ties."""
    k = kept_count(fraction, scores.numel())
    order = torch.sort(scores, descending=True, stable=True).indices
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return keep.scatter_(0, order[:k], True)


def _as_matrix(x: Tensor) -> Tensor:
    """The (tokens, channels) matrix of ``x`` in at least float32.

    Squared norms of half-precision values would otherwise overflow or round
    distinct norms into ties.
    """
    return x.reshape(-1, x.shape[-1]).to(torch.promote_types(x.dtype, torch.float32))


def _channel_mask(x: Tensor, fraction: float) -> Tensor:
    """Keep whole last-axis channels ranked by L2 norm over every token."""
    norms_sq = _as_matrix(x).square().sum(dim=0)
    return _top_fraction(norms_sq, fraction).expand(x.shape)


def _block_mask(x: Tensor, rows: int, cols: int, fraction: float) -> Tensor:
    """Keep ``rows x cols`` tiles of the (tokens, channels) matrix ranked by L2 norm.

    Partial tiles at the bottom and right edges are zero-padded for ranking,
    so they compete on the energy they actually hold.
    """
    d = x.shape[-1]
    matrix = _as_matrix(x)
    tokens = matrix.shape[0]
    pad_rows, pad_cols = -tokens % rows, -d % cols
    padded = torch.nn.functional.pad(matrix, (0, pad_cols, 0, pad_rows))
    tile_rows, tile_cols = padded.shape[0] // rows, padded.shape[1] // cols
    tiles = padded.reshape(tile_rows, rows, tile_cols, cols)
    norms_sq = tiles.square().sum(dim=(1, 3)).flatten()
    keep_tiles = _top_fraction(norms_sq, fraction).reshape(tile_rows, 1, tile_cols, 1)
    keep = keep_tiles.expand(tile_rows, rows, tile_cols, cols).reshape(padded.shape)
    return keep[:tokens, :d].reshape(x.shape)


#: a settings field holding a pattern: read from its string once, at the config's edge
#: (a malformed one refused there, naming the accepted forms), held as the object, and
#: written back as its string
Pattern = Annotated[SparsityPattern, BeforeValidator(parse_pattern),
                    PlainSerializer(str, return_type=str),
                    Choices(lambda: ["dense", "n:m", "channel:<fraction>",
                                     "block:<rows>x<cols>:<fraction>"])]
