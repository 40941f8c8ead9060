"""On-policy to the bit: a forward whose logits for a token do not depend on its batch.

A GEMM library picks its blocking, its vector path and its reduction order by the shape it
is given, so the same row multiplied alone (a decode step), beside 11 others (a prefill)
or beside T others (the trainer's forward) can come out with different last bits. In
bf16 or fp32 that is noise of 1e-7; under 4-bit rounding a value near a rounding boundary
flips, the next layer flips more, and through the KV cache the engine and the trainer
score the same sampled token tenths of a nat apart, although the recipe makes their two
policies one function.

:class:`BatchInvariantMode` routes every op whose reduction order a library chooses to a
kernel whose order is fixed by the reduced length alone (``fp4rl/kernels/invariant.c``):

- ``mm`` / ``addmm`` (every linear layer, FP4 or not, and ``lm_head``): products summed
  in increasing k by fused multiply-adds, in runs of 64, in float32, bf16 operands widened
  exactly (a weight packed once per version inside :func:`fp4rl.nn.hold_weights`); on a
  CPU with AMX, bf16 operands on the tile unit, whose sum of a step's 32 products is the
  hardware's own: batch-invariant on that machine, not the FMA path's bits;
- ``bmm`` (attention's ``Q K^T`` and ``P V``, under the eager attention the mode puts the
  model on): one sequential sum, so that masked keys (probability exactly 0) change
  nothing: the same bits at any left padding, and for a query decoded alone against its
  KV cache as for the same query in a prefill;
- ``_softmax`` / ``_log_softmax`` / ``logsumexp`` / ``mean`` along the last axis
  (attention, RMSNorm, log-probs; other axes moved last): each row on its own, sums in
  float64 on the CPU; a log-softmax is
  ``x - logsumexp(x)``, so that a host scoring a token as ``x[t] - logsumexp(x)`` (TRL)
  gets the bits of ``log_softmax(x)[t]``.

Everything else a transformer runs is elementwise, hence row-local. Sampling is
unchanged. On a GPU (and on CPU tensors under ``FP4RL_KERNELS=triton``, which with
``TRITON_INTERPRET=1`` is how it is tested here) the same ops go to Triton kernels
(:mod:`fp4rl.kernels.triton_invariant`) whose order depends on the reduced length alone:
the linears' GEMM in one tile configuration that never splits K (``fp4rl::bi_mm``, as
vLLM's batch-invariant mode); attention's ``Q K^T`` and ``P V`` as one sequential float32
sum per output (``fp4rl::bi_bmm``), so that a row's real keys are walked in order from its
own first one and masked keys add exact zeros; softmax, log-softmax, logsumexp and the
row mean one row at a time in fixed float32 lanes, a softmax's lanes aligned at the row's
first term that is not exactly 0 (its first real key), so that left padding and masked
future keys change nothing (``fp4rl::bi_softmax``, ``fp4rl::bi_row_mean``). The rollout's
chunks, re-padded by :func:`fp4rl.rollout.batch.concat_batches`, are then scored with the
engine's bits at any padding. Interpreted, compiled for sm_90 and sm_100 and traced on
``meta`` here; not yet timed on a GPU.

Nothing is silently off: an op the mode routes is computed in its fixed order (mixed
dtypes promoted as torch promotes them; ``alpha`` / ``beta`` and a bias of any shape
applied elementwise after the fixed-order product; softmax and reductions along any axes)
or refused in one line (:class:`BatchInvariantError`: float64, an ``out=`` overload, a
fused attention kernel); turning the mode on where its kernels cannot run (no C library
on the CPU, no Triton on a GPU, ``FP4RL_DISABLE_KERNELS=1``, another device) is refused
when it is set (:func:`check_batch_invariant`).

:func:`set_batch_invariant` makes a model run every forward under the mode (through its
forward hooks, so that any host calling the model gets it: fp4rl's trainer and engine, TRL,
a user's script). The same hooks tell the FP4 layers which token rows are padding, so that
pad rows stay out of a per-tensor NVFP4 scale (:func:`token_rows`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Literal

import torch
from torch import nn
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

from fp4rl.errors import UserError
from fp4rl.kernels.cpu import BI_CHUNK, bi_gemm, bi_logsumexp, bi_row_mean, bi_softmax, load_library

aten = torch.ops.aten

#: the model attribute that records that its forwards run batch-invariant
_FLAG = "fp4rl_batch_invariant"
#: the model attribute holding the forward hooks' handles (installed once)
_HOOKS = "_fp4rl_forward_hooks"
#: the attention implementation under the mode: its matmuls and softmax are ops the mode
#: routes (SDPA's fused CPU kernel is one op with an order of its own)
INVARIANT_ATTENTION = "eager"

#: :func:`tokens_fed`'s mask, per thread: ``torch.compile`` reads a ``threading.local`` in
#: its graph (and guards on it), where a ``ContextVar.get`` breaks the graph; a forward
#: awaits nothing, so a thread's scope is also its task's
_tokens = threading.local()


class BatchInvariantError(UserError):
    """``batch_invariant`` where its fixed-order kernels cannot run, or an op under the mode
    that no fixed-order kernel computes: refused in one line, never computed silently in a
    library's shape-dependent order."""


#: which kernels compute the mode's ops: fp4rl's C library, or its Triton kernels
Backend = Literal["c", "triton"]
#: devices whose ops go to the Triton kernels (``meta``: their fakes, for shapes and device
#: discipline without a GPU)
_TRITON_DEVICES = ("cuda", "meta")
#: dtypes the kernels read and write; float16 is widened to float32 (exactly) and the
#: result rounded back once
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_OFF = ", or turn batch_invariant off"


@functools.cache
def _triton_imports() -> bool:
    try:
        from fp4rl.kernels import triton_invariant  # noqa: F401  # registers fp4rl::bi_*
    except ImportError:
        return False
    return True


def invariant_backend(device: torch.device | str) -> Backend:
    """The kernels that compute the mode's ops for tensors on ``device``: Triton on a GPU
    (and on the CPU under ``FP4RL_KERNELS=triton``, interpreted with ``TRITON_INTERPRET=1``),
    the C library on the CPU. Raises :class:`BatchInvariantError` where none can run (the
    kernels turned off, no C compiler, no Triton, another device)."""
    device = torch.device(device)
    if os.environ.get("FP4RL_DISABLE_KERNELS") == "1":
        raise BatchInvariantError("batch_invariant needs fp4rl's fixed-order kernels, which "
                                  f"FP4RL_DISABLE_KERNELS=1 turns off: unset it{_OFF}")
    if device.type in _TRITON_DEVICES or (device.type == "cpu" and
                                          os.environ.get("FP4RL_KERNELS") == "triton"):
        if not _triton_imports():
            raise BatchInvariantError(f"batch_invariant on {device.type} tensors needs "
                                      f"Triton, which does not import here: install it{_OFF}")
        return "triton"
    if device.type == "cpu":
        if load_library() is None:
            raise BatchInvariantError("batch_invariant on the CPU needs fp4rl's C kernels, "
                                      "which could not be built here (no C compiler): "
                                      f"install gcc or set CC{_OFF}")
        return "c"
    raise BatchInvariantError(f"batch_invariant has no fixed-order kernels for {device.type} "
                              f"tensors (cpu and cuda have): run the model on one of those{_OFF}")


def check_batch_invariant(device: torch.device | str) -> None:
    """Refuse (:class:`BatchInvariantError`, one line) to turn the mode on for ``device``
    where its kernels cannot run: at :func:`set_batch_invariant` and a run's planning, so
    that the mode is never on in name while its ops go to a library."""
    invariant_backend(device)


def _float_dtype(op: str, *tensors: torch.Tensor) -> torch.dtype | None:
    """The dtype torch's type promotion gives ``op``'s result; None for integer and bool
    operands (exact arithmetic: every order gives the same bits). Refuses float64 and
    complex, which no fixed-order kernel computes."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    if not dtype.is_floating_point and not dtype.is_complex:
        return None
    _check_dtype(op, dtype)
    return dtype


def _check_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in _FLOATS:
        raise BatchInvariantError(f"batch_invariant: {op} in {dtype} has no fixed-order kernel "
                                  f"(float32, bfloat16 and float16 have): run the model in one "
                                  f"of those{_OFF}")


def _gemm(op: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
          out_dtype: torch.dtype | None = None, *, sequential: bool) -> torch.Tensor | None:
    """``a @ b (+ bias)`` (2-D, or batched 3-D), each output's products summed in an order
    set by K alone: a linear layer's runs of :data:`BI_CHUNK` (C) or ``tl.dot`` steps
    (Triton); ``sequential``: one sum in increasing k, which masked keys (products of 0)
    leave unchanged (attention's). Operands of different dtypes are promoted as torch
    promotes them (exactly: every promotion here widens); the output is the float32
    accumulator rounded once to ``out_dtype`` (default: the promoted dtype). None for
    integer operands (exact in any order)."""
    dtype = _float_dtype(op, a, b, *(() if bias is None else (bias,)))
    if dtype is None:
        return None
    out_dtype = out_dtype or dtype
    _check_dtype(op, out_dtype)
    kernel_out = out_dtype if out_dtype in _KERNEL_DTYPES else torch.float32
    if invariant_backend(a.device) == "c":
        operands = dtype if dtype in _KERNEL_DTYPES else torch.float32
        out = bi_gemm(a.to(operands), b.to(operands), bias, kernel_out,
                      chunk=0 if sequential else BI_CHUNK)
        return out.to(out_dtype)
    # the Triton kernels write their operands' dtype: widened to float32 where the output
    # is wider, the same products and sums
    operands = dtype if dtype == kernel_out else torch.float32
    a, b = a.to(operands), b.to(operands)
    if sequential:
        if bias is not None:
            raise AssertionError("the batched GEMM takes no bias")
        result: torch.Tensor = torch.ops.fp4rl.bi_bmm(a, b)
    else:
        result = torch.ops.fp4rl.bi_mm(a, b, None if bias is None else bias.to(operands))
    return result.to(out_dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    return _gemm("mm", a, b, sequential=False)


def _mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``mm`` into ``out_dtype`` (:func:`fp4rl.gemm.mm_fp32`'s float32 of bf16 operands):
    the fixed-order GEMM of the widened operands, the same products and sum."""
    return _gemm("mm", a, b, out_dtype=out_dtype, sequential=False)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    return _gemm("bmm", a, b, sequential=True)


def _scaled(op: str, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: complex,
            alpha: complex, sequential: bool) -> torch.Tensor | None:
    """``beta * bias + alpha * (a @ b)``: a bias vector with ``alpha = beta = 1`` joins the
    kernel's float32 accumulator; otherwise the fixed-order product in float32, then the
    scaling and the (broadcast) bias elementwise in float32, rounded once. Row-local
    either way; ``beta = 0`` ignores the bias, as torch does."""
    n = b.shape[-1]
    vector = not sequential and (bias.dim() == 1 or (bias.dim() == 2 and bias.shape[0] == 1)) \
        and bias.shape[-1] == n
    if vector and alpha == 1 and beta == 1:
        return _gemm(op, a, b, bias.reshape(-1), sequential=False)
    dtype = _float_dtype(op, bias, a, b)
    if dtype is None:
        return None
    product = _gemm(op, a, b, out_dtype=torch.float32, sequential=sequential)
    assert product is not None
    out = product if alpha == 1 else product * alpha
    if beta != 0:
        out = out + (bias.float() if beta == 1 else bias.float() * beta)
    return out.to(dtype)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: complex = 1,
           alpha: complex = 1) -> torch.Tensor | None:
    return _scaled("addmm", bias, a, b, beta, alpha, sequential=False)


def _baddbmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: complex = 1,
             alpha: complex = 1) -> torch.Tensor | None:
    return _scaled("baddbmm", bias, a, b, beta, alpha, sequential=True)


#: the Triton row kernel's modes (:mod:`fp4rl.kernels.triton_invariant`)
_SOFTMAX, _LOG_SOFTMAX, _LOGSUMEXP = 0, 1, 2
_ROW_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
               (torch.bfloat16, torch.float32))


def _rows(x: torch.Tensor, mode: int | None, out_dtype: torch.dtype) -> torch.Tensor:
    """A row kernel along ``x``'s last axis: softmax, log-softmax, logsumexp (``mode``) or
    the mean (None), each row on its own; a reduction keeps the axis (size 1)."""
    rows = x if x.dtype in _KERNEL_DTYPES else x.float()
    kernel_out = out_dtype if out_dtype in _KERNEL_DTYPES else torch.float32
    if invariant_backend(x.device) == "c":
        if mode is None:
            out = bi_row_mean(rows, kernel_out)
        elif mode == _LOGSUMEXP:
            out = bi_logsumexp(rows, kernel_out)
        else:
            out = bi_softmax(rows, mode == _LOG_SOFTMAX, kernel_out)
        return out.to(out_dtype)
    if (rows.dtype, kernel_out) not in _ROW_DTYPES:
        kernel_out = torch.float32
    result: torch.Tensor = torch.ops.fp4rl.bi_row_mean(rows, kernel_out) if mode is None \
        else torch.ops.fp4rl.bi_softmax(rows, mode, kernel_out)
    return result.to(out_dtype)


def _softmax(log: bool) -> Callable[..., torch.Tensor | None]:
    name = "log_softmax" if log else "softmax"

    def handler(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor | None:
        if x.dim() == 0 or x.numel() == 0:
            return None  # nothing is summed
        out_dtype = torch.float32 if half_to_float else x.dtype
        _check_dtype(name, x.dtype)
        out = _rows(x.movedim(dim, -1), _LOG_SOFTMAX if log else _SOFTMAX, out_dtype)
        return out.movedim(-1, dim)
    return handler


def _reduced(op: str, x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool,
             mode: int | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """A reduction over the axes ``dim`` (None or empty: all), computed as one row a
    result: those axes moved last and flattened into one."""
    if x.dim() == 0 or x.numel() == 0:
        return None  # one value or none: nothing is summed in any order
    _check_dtype(op, x.dtype)
    _check_dtype(op, out_dtype)
    axes = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [i for i in range(x.dim()) if i not in axes]
    rows = x.permute(*kept, *axes).reshape(*(x.shape[i] for i in kept), -1)
    out = _rows(rows, mode, out_dtype)
    if keepdim:
        return out.reshape([1 if i in axes else s for i, s in enumerate(x.shape)])
    return out.reshape([x.shape[i] for i in kept])


def _logsumexp(x: torch.Tensor, dim: Sequence[int], keepdim: bool = False
               ) -> torch.Tensor | None:
    if not x.is_floating_point():
        x = x.to(torch.get_default_dtype())  # torch's result type for integers
    return _reduced("logsumexp", x, dim, keepdim, _LOGSUMEXP, x.dtype)


def _mean(x: torch.Tensor, dim: Sequence[int] | None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if dtype is not None:
        x = x.to(dtype)  # torch casts the input first
    if not x.is_floating_point():
        return None  # torch refuses an integer mean itself
    return _reduced("mean", x, dim, keepdim, None, x.dtype)


def _mean_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    return _mean(x, None, False, dtype=dtype)


#: the ops the mode computes itself; a handler returns None only where the op sums
#: nothing in a chosen order (integers, empty or 0-dim tensors), and refuses what it
#: cannot compute
_HANDLERS: dict[OpOverload, Callable[..., torch.Tensor | None]] = {
    aten.mm.default: _mm,
    aten.mm.dtype: _mm_out,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten.baddbmm.default: _baddbmm,
    aten._softmax.default: _softmax(log=False),
    aten._log_softmax.default: _softmax(log=True),
    aten.logsumexp.default: _logsumexp,
    aten.mean.dim: _mean,
    aten.mean.default: _mean_all,
}
#: ops refused under the mode: another overload of a routed op (``out=``, say), and the
#: fused attention kernels, each a reduction in an order of the library's choosing
_REFUSED: tuple[OpOverloadPacket, ...] = tuple(
    {h.overloadpacket for h in _HANDLERS} | {
        getattr(aten, name) for name in (
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
            "_efficient_attention_forward") if hasattr(aten, name)})


def _refuse(func: OpOverload) -> BatchInvariantError:
    if "attention" in func.name():
        return BatchInvariantError(
            f"batch_invariant: {func} is a fused attention kernel whose reduction order the "
            "library chooses by shape; run the model with attn_implementation='eager' "
            f"(set_batch_invariant sets it on a transformers model){_OFF}")
    return BatchInvariantError(f"batch_invariant: {func} has no fixed-order kernel; call "
                               f"{func.overloadpacket} without out= or an overload{_OFF}")


class BatchInvariantMode(TorchDispatchMode):
    """Computes the ops whose reduction order a library would choose by shape with
    fixed-order kernels (see the module docstring): C on the CPU, Triton on a GPU. An op it
    cannot compute so is refused (:class:`BatchInvariantError`), never passed to the
    library; every other op (elementwise, hence row-local) runs as it is."""

    #: GEMMs inside must keep this mode's order: a fused kernel that would bypass
    #: ``aten.mm`` (the packed GEMM, :func:`fp4rl.gemm.fuses_packed`) steps aside
    fixed_reduction_order = True
    #: fp4rl's C operators (``fp4rl::c_*``) pass through as they are, so an eager call
    #: may skip their dispatch under this mode (:func:`fp4rl.kernels.cpu_ops._direct`)
    passes_c_ops = True

    def __torch_dispatch__(self, func: OpOverload, types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not None:
                return out
        elif func.overloadpacket in _REFUSED:
            raise _refuse(func)
        return func(*args, **kwargs)


def batch_invariant() -> contextlib.AbstractContextManager[object]:
    """Context manager: every op run inside it that reduces along an axis does so in an
    order fixed by that axis' length (see :class:`BatchInvariantMode`). A model's
    attention goes through it only under eager attention: :func:`set_batch_invariant`
    sets that up and enters this around each forward."""
    return BatchInvariantMode()


def invariant_for(model: nn.Module) -> contextlib.AbstractContextManager[object]:
    """The batch-invariant mode where ``model`` runs batch-invariant (else nothing): for
    what a host computes from the model's logits outside its forward (the sampled tokens'
    log-probs in the engine, the scored tokens' in the trainer and in TRL), so that both
    sides take them with the same kernel."""
    return batch_invariant() if is_batch_invariant(model) else contextlib.nullcontext()


def token_rows() -> torch.Tensor | None:
    """Within a patched model's forward, which of the flattened token rows its linear
    layers see are real tokens (bool, ``batch * length``): the attention mask's columns for
    the tokens fed. None where the forward was given no mask."""
    rows: torch.Tensor | None = getattr(_tokens, "rows", None)
    return rows


@contextlib.contextmanager
def tokens_fed(mask: torch.Tensor | None) -> Iterator[None]:
    """Within the block, :func:`token_rows` is ``mask`` (bool, flattened token rows)."""
    outer = token_rows()
    _tokens.rows = mask
    try:
        yield
    finally:
        _tokens.rows = outer


def _rows_of(args: tuple[object, ...], kwargs: dict[str, object]) -> torch.Tensor | None:
    """The flattened token rows of a causal LM's forward: its attention mask's last
    ``length`` columns, ``length`` the tokens fed (``input_ids`` or ``inputs_embeds``)."""
    mask = kwargs.get("attention_mask")
    fed = kwargs.get("input_ids")
    if fed is None and args and isinstance(args[0], torch.Tensor):
        fed = args[0]
    if fed is None:
        fed = kwargs.get("inputs_embeds")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not isinstance(fed, torch.Tensor):
        return None
    length = fed.shape[1] if fed.dim() >= 2 else 1
    if mask.shape[1] < length or mask.shape[0] != fed.shape[0]:
        return None
    return mask[:, -length:].reshape(-1).bool()


class _ForwardScope:
    """The state one forward of a patched model runs in, entered by its pre-hook and left
    by its post-hook (which runs even where the forward raises)."""

    def __init__(self) -> None:
        self.stack: list[contextlib.ExitStack] = []

    def enter(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
              ) -> None:
        scope = contextlib.ExitStack()
        scope.enter_context(tokens_fed(_rows_of(args, kwargs)))
        if getattr(module, _FLAG, False):
            scope.enter_context(batch_invariant())
        self.stack.append(scope)

    def leave(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object],
              output: object) -> None:
        if self.stack:
            self.stack.pop().close()


def install_forward_hooks(model: nn.Module) -> None:
    """Give ``model`` the hooks that scope each of its forwards (pad rows known to the FP4
    layers; the batch-invariant mode where it is on). Installed once."""
    if getattr(model, _HOOKS, None) is not None:
        return
    scope = _ForwardScope()  # bound methods, not closures: the model still pickles
    handles = (model.register_forward_pre_hook(scope.enter, with_kwargs=True),
               model.register_forward_hook(scope.leave, with_kwargs=True, always_call=True))
    object.__setattr__(model, _HOOKS, handles)


def set_batch_invariant(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Make every forward of ``model`` batch-invariant (or not again): its eager attention
    and its forwards under :class:`BatchInvariantMode`. Returns ``model``. Turning it on
    where its kernels cannot run for the model's device is refused
    (:class:`BatchInvariantError`, one line: :func:`check_batch_invariant`)."""
    if enabled:
        check_batch_invariant(_device_of(model))
    install_forward_hooks(model)
    if enabled:
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(INVARIANT_ATTENTION)
    object.__setattr__(model, _FLAG, bool(enabled))
    return model


def _device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (or buffer); the CPU for a model of
    none."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def is_batch_invariant(model: nn.Module) -> bool:
    """Whether :func:`set_batch_invariant` is on for ``model``."""
    return bool(getattr(model, _FLAG, False))


__all__ = ["INVARIANT_ATTENTION", "Backend", "BatchInvariantError", "BatchInvariantMode",
           "batch_invariant", "check_batch_invariant", "install_forward_hooks",
           "invariant_backend", "invariant_for", "is_batch_invariant",
           "set_batch_invariant", "token_rows", "tokens_fed"]
