"""Triton kernels: the batch-invariant GEMMs and row reductions on a GPU.

A library kernel on a GPU chooses its tiles, its split of a reduction across thread
blocks and its algorithm by the problem's shape, so a row's result depends on how many
rows come with it, and an attention row's on where its real keys sit in the padded
batch. Every kernel here fixes its order by the reduced length alone, and where padding
lies along the reduced axis, by the row's real values alone:

- ``fp4rl::bi_mm`` (a linear layer's ``mm`` / ``addmm``, K the hidden width, never
  padded): one tile configuration for every shape, K never split; each output tile walks
  K in ``BLOCK_K`` steps, in order, accumulating ``tl.dot`` products in float32 (vLLM's
  batch-invariant mode does the same). bf16 operands multiply as TF32, in which every
  bf16 value is exact; float32 operands in IEEE precision. The bias joins the float32
  accumulator; the output is rounded once.
- ``fp4rl::bi_bmm`` (attention's ``Q K^T`` and ``P V``): each output one sequential
  float32 sum over k, one product at a time, from k = 0. Masked keys have probability
  exactly 0, and adding a product of 0 leaves a sum unchanged, so a query's ``P V`` is
  the same bits at any left padding, beside any future (causally masked) keys and decoded
  alone against its KV cache: the sum walks the row's real keys in order from its own
  first one (a blocked ``tl.dot`` from the padded start would regroup them with the
  padding). On CUDA cores: attention's share of a forward is small at RL's lengths.
- ``fp4rl::bi_softmax`` (softmax, log-softmax, logsumexp) and ``fp4rl::bi_row_mean``
  (RMSNorm's mean): one program a row, no value read from another row. The row max is
  exact in any order. The exponentials' sum runs in ``BLOCK`` float32 lanes, the lanes
  then summed by ``tl.sum``'s fixed tree; lane 0 starts at the row's first term that is
  not exactly 0 (its first real key), so left padding and masked future keys (terms of
  exactly 0, which leave a lane unchanged) change nothing. A log-softmax is
  ``x - logsumexp(x)``, so that a token scored as ``x[t] - logsumexp(x)`` (TRL) gets the
  bits of ``log_softmax(x)[t]``. The mean sums its lanes from the row's start: its axis
  (the hidden width) is never padded.

Float64 appears nowhere (the CPU kernels' float64 sums are a CPU's choice: a GPU runs
float64 at a fraction of float32's rate). Each launcher is a custom operator with a fake
implementation (shapes on the ``meta`` device and under ``torch.compile``), which
:class:`fp4rl.nn.invariant.BatchInvariantMode` routes a GPU's ops to (and a CPU's under
``FP4RL_KERNELS=triton``, which with ``TRITON_INTERPRET=1`` is how they are tested
without a GPU).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from fp4rl.kernels.triton_quant import Variant

#: the one tile configuration of the linear GEMM (a row's bits depend on it, so it never
#: changes with shape)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
#: the batched (attention) GEMM's tile, batch entries by rows by columns: it sets the speed
#: alone, since every output is one sequential sum whatever the tile
BMM_E, BMM_M, BMM_N = 4, 32, 32
#: the lanes of a row reduction (the lane sums' tree is fixed by it, so it never changes)
ROW_BLOCK = 256
#: rows a row kernel's program reduces, each on its own (its speed alone)
ROW_ROWS = 16
#: the row kernel's modes
SOFTMAX, LOG_SOFTMAX, LOGSUMEXP = 0, 1, 2
#: the dtypes the kernels read and write
FLOATS = (torch.float32, torch.bfloat16)


@triton.jit(do_not_specialize=("M", "N", "K"))
def _bi_mm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk,
                  stride_bn, stride_cm, stride_cn, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    ks = tl.arange(0, BK).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + ks
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:  # bf16 values are exact in TF32 (10 mantissa bits): tensor cores, no rounding
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=("M", "N", "K", "E", "TILES_M", "TILES_N"))
def _bi_bmm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, E, TILES_M, TILES_N, sa_b, sa_m, sa_k, sb_b,
                   sb_k, sb_n, sc_b, sc_m, sc_n, BE: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    per_group = TILES_M * TILES_N
    entries = (pid // per_group) * BE + tl.arange(0, BE).to(tl.int64)
    tile = pid % per_group
    rows = ((tile // TILES_N) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = ((tile % TILES_N) * BN + tl.arange(0, BN)).to(tl.int64)
    a_mask = (entries[:, None] < E) & (rows[None, :] < M)
    b_mask = (entries[:, None] < E) & (cols[None, :] < N)
    a_row = a_ptr + entries[:, None] * sa_b + rows[None, :] * sa_m
    b_col = b_ptr + entries[:, None] * sb_b + cols[None, :] * sb_n
    a_step = tl.zeros((1, 1), tl.int64) + sa_k  # 64-bit steps along k
    b_step = tl.zeros((1, 1), tl.int64) + sb_k
    acc = tl.zeros((BE, BM, BN), dtype=tl.float32)
    for _ in range(0, K):  # one product at a time, in increasing k: zeros change nothing
        a = tl.load(a_row, mask=a_mask, other=0.0).to(tl.float32)
        b = tl.load(b_col, mask=b_mask, other=0.0).to(tl.float32)
        acc = acc + a[:, :, None] * b[:, None, :]
        a_row += a_step
        b_col += b_step
    out = c_ptr + entries[:, None, None] * sc_b + rows[None, :, None] * sc_m + \
        cols[None, None, :] * sc_n
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=a_mask[:, :, None] & b_mask[:, None, :])


@triton.jit(do_not_specialize=("R", "L"))
def _bi_softmax_kernel(x_ptr, y_ptr, R, L, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                       MODE: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live_row = rows[:, None] < R
    x_rows = x_ptr + rows[:, None] * L
    lanes = tl.arange(0, BLOCK).to(tl.int64)[None, :]
    length = L.to(tl.int64)
    top = tl.full((ROWS, BLOCK), float("-inf"), tl.float32)
    for k0 in range(0, L, BLOCK):
        idx = k0 + lanes
        inside = live_row & (idx < length)
        top = tl.maximum(top, tl.load(x_rows + idx, mask=inside,
                                      other=float("-inf")).to(tl.float32))
    m = tl.max(top, 1)[:, None]
    # each row's first term that is not exactly 0: its lanes' alignment, set by the row's
    # real values (padding before it, and terms of 0 anywhere after, change no lane)
    first = tl.zeros((ROWS, BLOCK), tl.int64) + length
    for k0 in range(0, L, BLOCK):
        idx = k0 + lanes
        inside = live_row & (idx < length)
        v = tl.load(x_rows + idx, mask=inside, other=float("-inf")).to(tl.float32)
        first = tl.minimum(first, tl.where(inside & (tl.exp(v - m) > 0.0), idx, length))
    start = tl.min(first, 1)[:, None]
    acc = tl.zeros((ROWS, BLOCK), tl.float32)
    for k0 in range(0, L, BLOCK):
        idx = start + k0 + lanes
        inside = live_row & (idx < length)
        v = tl.load(x_rows + idx, mask=inside, other=0.0).to(tl.float32)
        acc = acc + tl.where(inside, tl.exp(v - m), 0.0)
    s = tl.sum(acc, 1)[:, None]
    lse = m + tl.log(s)
    if MODE == 2:
        tl.store(y_ptr + rows[:, None], lse.to(y_ptr.dtype.element_ty), mask=live_row)
    else:
        y_rows = y_ptr + rows[:, None] * L
        for k0 in range(0, L, BLOCK):
            idx = k0 + lanes
            inside = live_row & (idx < length)
            v = tl.load(x_rows + idx, mask=inside, other=0.0).to(tl.float32)
            out = v - lse if MODE == 1 else tl.exp(v - m) / s
            tl.store(y_rows + idx, out.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=("R", "L"))
def _bi_row_mean_kernel(x_ptr, y_ptr, R, L, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live_row = rows[:, None] < R
    x_rows = x_ptr + rows[:, None] * L
    lanes = tl.arange(0, BLOCK).to(tl.int64)[None, :]
    acc = tl.zeros((ROWS, BLOCK), tl.float32)
    for k0 in range(0, L, BLOCK):
        idx = k0 + lanes
        acc = acc + tl.load(x_rows + idx, mask=live_row & (idx < L), other=0.0).to(tl.float32)
    mean = tl.sum(acc, 1)[:, None] / L.to(tl.float32)
    tl.store(y_ptr + rows[:, None], mean.to(y_ptr.dtype.element_ty), mask=live_row)


def mm_variant(dtype: torch.dtype, bias: bool) -> Variant:
    """The linear GEMM for ``dtype`` operands and output (float32 or bfloat16), with or
    without a bias (of the same dtype; absent, the output pointer stands in, never
    read)."""
    return Variant(_bi_mm_kernel, (dtype, dtype, dtype, dtype),
                   (("BM", BLOCK_M), ("BN", BLOCK_N), ("BK", BLOCK_K), ("HAS_BIAS", bias),
                    ("IEEE", dtype == torch.float32)))


def bmm_variant(dtype: torch.dtype) -> Variant:
    """The batched (attention) GEMM for ``dtype`` operands and output."""
    return Variant(_bi_bmm_kernel, (dtype, dtype, dtype),
                   (("BE", BMM_E), ("BM", BMM_M), ("BN", BMM_N)))


def softmax_variant(x: torch.dtype, y: torch.dtype, mode: int) -> Variant:
    """The row kernel reading ``x`` and writing ``y``: :data:`SOFTMAX`,
    :data:`LOG_SOFTMAX` or :data:`LOGSUMEXP` (one value a row)."""
    return Variant(_bi_softmax_kernel, (x, y),
                   (("ROWS", ROW_ROWS), ("BLOCK", ROW_BLOCK), ("MODE", mode)))


def row_mean_variant(x: torch.dtype, y: torch.dtype) -> Variant:
    """The row mean reading ``x`` and writing ``y``."""
    return Variant(_bi_row_mean_kernel, (x, y), (("ROWS", ROW_ROWS), ("BLOCK", ROW_BLOCK)))


#: the (input, output) dtypes a row kernel is launched with: the same, or bf16 read into
#: float32 (softmax's ``half_to_float``, a mean asked for in float32)
ROW_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.bfloat16, torch.float32))


def variants() -> Iterator[Variant]:
    """Every variant the launchers can produce, for ahead-of-time compilation."""
    for dtype in FLOATS:
        for bias in (False, True):
            yield mm_variant(dtype, bias)
        yield bmm_variant(dtype)
    for x, y in ROW_DTYPES:
        for mode in (SOFTMAX, LOG_SOFTMAX, LOGSUMEXP):
            yield softmax_variant(x, y, mode)
        yield row_mean_variant(x, y)


def bi_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` of 2-D ``a`` (M, K) and ``b`` (K, N), any strides, one launch."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    mm_variant(a.dtype, bias is not None).launch(
        grid, a, b, out if bias is None else bias, out, m, n, k, a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), out.stride(0), out.stride(1))
    return out


def bi_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of batched ``a`` (B, M, K) and ``b`` (B, K, N), any strides, one launch:
    each output one sequential sum over k."""
    batch, m, k = a.shape
    n = b.shape[2]
    out = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    tiles_m, tiles_n = triton.cdiv(m, BMM_M), triton.cdiv(n, BMM_N)
    if out.numel() == 0:
        return out
    bmm_variant(a.dtype).launch(
        (triton.cdiv(batch, BMM_E) * tiles_m * tiles_n,), a, b, out, m, n, k, batch,
        tiles_m, tiles_n,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2))
    return out


def _row_launch(variant: Variant, x: torch.Tensor, reduce: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Launch a row kernel over the rows along ``x``'s last axis (one program a row),
    writing a row of the same length or (``reduce``) one value a row, the axis kept."""
    rows = x.contiguous()
    length = rows.shape[-1]
    out = torch.empty((*rows.shape[:-1], 1) if reduce else rows.shape, dtype=out_dtype,
                      device=x.device)
    count = rows.numel() // length if length else 0
    if count:
        variant.launch((triton.cdiv(count, ROW_ROWS),), rows, out, count, length)
    return out


@torch.library.custom_op("fp4rl::bi_mm", mutates_args=())
def _bi_mm_op(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The linear batch-invariant GEMM of 2-D operands."""
    return bi_mm(a, b, bias)


@_bi_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@torch.library.custom_op("fp4rl::bi_bmm", mutates_args=())
def _bi_bmm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The batched batch-invariant GEMM (attention's)."""
    return bi_bmm(a, b)


@_bi_bmm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@torch.library.custom_op("fp4rl::bi_softmax", mutates_args=())
def _bi_softmax_op(x: torch.Tensor, mode: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Softmax, log-softmax or logsumexp (the axis kept, size 1) along the last axis."""
    return _row_launch(softmax_variant(x.dtype, out_dtype, mode), x, mode == LOGSUMEXP,
                       out_dtype)


@_bi_softmax_op.register_fake
def _(x: torch.Tensor, mode: int, out_dtype: torch.dtype) -> torch.Tensor:
    shape = (*x.shape[:-1], 1) if mode == LOGSUMEXP else x.shape
    return x.new_empty(shape, dtype=out_dtype)


@torch.library.custom_op("fp4rl::bi_row_mean", mutates_args=())
def _bi_row_mean_op(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The mean along the last axis, the axis kept (size 1)."""
    return _row_launch(row_mean_variant(x.dtype, out_dtype), x, True, out_dtype)


@_bi_row_mean_op.register_fake
def _(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], 1), dtype=out_dtype)


__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "BMM_E", "BMM_M", "BMM_N", "LOGSUMEXP", "LOG_SOFTMAX",
           "ROW_BLOCK", "ROW_DTYPES", "ROW_ROWS", "SOFTMAX", "bi_bmm", "bi_mm", "bmm_variant",
           "mm_variant", "row_mean_variant", "softmax_variant", "variants"]
