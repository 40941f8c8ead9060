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
  in increasing k, in runs of 64, in float32, bf16 operands widened exactly;
- ``bmm`` (attention's ``Q K^T`` and ``P V``, under the eager attention the mode puts the
  model on): one sequential sum, so that masked keys (probability exactly 0) change
  nothing: the same bits at any left padding, and for a query decoded alone against its
  KV cache as for the same query in a prefill;
- ``_softmax`` / ``_log_softmax`` / ``logsumexp`` / ``mean`` along the last axis
  (attention, RMSNorm, log-probs): each row on its own, sums in float64; a log-softmax is
  ``x - logsumexp(x)``, so that a host scoring a token as ``x[t] - logsumexp(x)`` (TRL)
  gets the bits of ``log_softmax(x)[t]``.

Everything else a transformer runs is elementwise, hence row-local already. Sampling is
unchanged. On a GPU the GEMMs go to a Triton kernel of one tile configuration that never
splits K (``fp4rl::bi_mm``, :mod:`fp4rl.kernels.triton_invariant`, as vLLM's
batch-invariant mode does; interpreted, compiled for sm_90 and sm_100 and traced on
``meta`` here, not yet run on a GPU); softmax and the row mean pass through to torch's
CUDA kernels, which reduce each row within one thread block. Other devices and dtypes pass
through.

:func:`set_batch_invariant` makes a model run every forward under the mode (through its
forward hooks, so that any host calling the model gets it: fp4rl's trainer and engine, TRL,
a user's script). The same hooks tell the FP4 layers which token rows are padding, so that
pad rows stay out of a per-tensor NVFP4 scale (:func:`token_rows`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from fp4rl.kernels.cpu import (
    BI_CHUNK,
    bi_gemm,
    bi_logsumexp,
    bi_row_mean,
    bi_softmax,
    bi_supported,
)

aten = torch.ops.aten

#: the model attribute that records that its forwards run batch-invariant
_FLAG = "fp4rl_batch_invariant"
#: the model attribute holding the forward hooks' handles (installed once)
_HOOKS = "_fp4rl_forward_hooks"
#: the attention implementation under the mode: its matmuls and softmax are ops the mode
#: routes (SDPA's fused CPU kernel is one op with an order of its own)
INVARIANT_ATTENTION = "eager"

_token_rows: contextvars.ContextVar[torch.Tensor | None] = \
    contextvars.ContextVar("fp4rl_token_rows", default=None)


def _last_axis(x: torch.Tensor, dim: int) -> bool:
    return x.dim() > 0 and dim % x.dim() == x.dim() - 1


#: devices whose GEMMs go to the Triton kernel (``meta``: its fake, for shapes and device
#: discipline without a GPU)
_TRITON_DEVICES = ("cuda", "meta")


def _on_gpu(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor | None:
    """``fp4rl::bi_mm`` (the Triton kernel, :mod:`fp4rl.kernels.triton_invariant`) for
    float32 / bfloat16 operands on a GPU; None where Triton is absent."""
    if a.device.type not in _TRITON_DEVICES or a.dtype not in (torch.float32, torch.bfloat16) \
            or any(t.dtype != a.dtype for t in (b, *(() if bias is None else (bias,)))):
        return None
    try:
        from fp4rl.kernels import triton_invariant  # noqa: F401  # registers fp4rl::bi_mm
    except ImportError:
        return None
    out: torch.Tensor = torch.ops.fp4rl.bi_mm(a, b, bias)
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.dtype != b.dtype or not bi_supported(a, b):
        return _on_gpu(a, b)
    return bi_gemm(a, b, chunk=BI_CHUNK)


def _mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """``mm`` with an fp32 output of bf16 operands (:func:`fp4rl.gemm.mm_fp32` on a GPU):
    the fixed-order fp32 GEMM of the widened operands, the same products and sum."""
    if out_dtype != torch.float32 or a.dtype != b.dtype or a.dtype != torch.bfloat16:
        return None
    return _mm(a.float(), b.float())


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor | None:
    vector = bias.dim() == 1 or (bias.dim() == 2 and bias.shape[0] == 1)
    if beta != 1 or alpha != 1 or not vector or bias.shape[-1] != b.shape[1] or \
            a.dtype != b.dtype or bias.dtype != a.dtype:
        return None
    if not bi_supported(a, b, bias):
        return _on_gpu(a, b, bias.reshape(-1))
    return bi_gemm(a, b, bias.reshape(-1), chunk=BI_CHUNK)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.dtype != b.dtype or not bi_supported(a, b):
        return _on_gpu(a, b)
    return bi_gemm(a, b, chunk=0)


def _softmax(log: bool) -> Callable[..., torch.Tensor | None]:
    def handler(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor | None:
        if not _last_axis(x, dim) or not bi_supported(x):
            return None
        return bi_softmax(x, log, torch.float32 if half_to_float else x.dtype)
    return handler


def _logsumexp(x: torch.Tensor, dim: list[int], keepdim: bool = False
               ) -> torch.Tensor | None:
    if len(dim) != 1 or not _last_axis(x, dim[0]) or not bi_supported(x) or x.numel() == 0:
        return None
    out = bi_logsumexp(x)
    return out if keepdim else out.squeeze(-1)


def _mean(x: torch.Tensor, dim: list[int] | None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor | None:
    if dim is None or len(dim) != 1 or not _last_axis(x, dim[0]) or not bi_supported(x) or \
            (dtype is not None and dtype not in (torch.float32, torch.bfloat16)):
        return None
    out = bi_row_mean(x, dtype or x.dtype)
    return out if keepdim else out.squeeze(-1)


#: the ops the mode computes itself; a handler returns None to pass an op through
_HANDLERS: dict[OpOverload, Callable[..., torch.Tensor | None]] = {
    aten.mm.default: _mm,
    aten.mm.dtype: _mm_out,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten._softmax.default: _softmax(log=False),
    aten._log_softmax.default: _softmax(log=True),
    aten.logsumexp.default: _logsumexp,
    aten.mean.dim: _mean,
}


class BatchInvariantMode(TorchDispatchMode):
    """Computes the ops whose reduction order a library would choose by shape with
    fixed-order CPU kernels (see the module docstring); every other op, and every op on
    another device, runs as it is."""

    #: GEMMs inside must keep this mode's order: a fused kernel that would bypass
    #: ``aten.mm`` (the packed GEMM, :func:`fp4rl.gemm.fuses_packed`) steps aside
    fixed_reduction_order = True

    def __torch_dispatch__(self, func: OpOverload, types: Collection[type],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(*args, **kwargs)
            if out is not None:
                return out
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
    return _token_rows.get()


@contextlib.contextmanager
def tokens_fed(mask: torch.Tensor | None) -> Iterator[None]:
    """Within the block, :func:`token_rows` is ``mask`` (bool, flattened token rows)."""
    reset = _token_rows.set(mask)
    try:
        yield
    finally:
        _token_rows.reset(reset)


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
    and its forwards under :class:`BatchInvariantMode`. Returns ``model``."""
    install_forward_hooks(model)
    if enabled:
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(INVARIANT_ATTENTION)
    object.__setattr__(model, _FLAG, bool(enabled))
    return model


def is_batch_invariant(model: nn.Module) -> bool:
    """Whether :func:`set_batch_invariant` is on for ``model``."""
    return bool(getattr(model, _FLAG, False))


__all__ = ["INVARIANT_ATTENTION", "BatchInvariantMode", "batch_invariant",
           "install_forward_hooks", "invariant_for", "is_batch_invariant",
           "set_batch_invariant", "token_rows", "tokens_fed"]
