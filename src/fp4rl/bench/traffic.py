"""``fp4rl bench linear --traffic``: the bytes an FP4 linear moves on a GPU, counted from its
launches, against a bf16 ``nn.Linear``'s.

A GEMM at training sizes and every quantizer are bound by memory, so the bytes each pass
reads and writes set a floor under the time a GPU can take. The layer runs here on
PyTorch's ``meta`` device, along the path a CUDA tensor takes (the Triton kernels
selected, their launches recorded instead of run; bf16 compute as under CUDA autocast);
a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op with its
inputs and outputs, and each Triton launch is read by its kernel's arguments. Views move
nothing; every other op reads each input tensor once and writes each output once (what
an ideal kernel of that op does: the floor, not a cache model). The roofline time of an
op is the larger of its bytes over the HBM bandwidth and its FLOPs over the bf16 peak.

The bf16 baseline is what autocast runs for ``nn.Linear`` with FP32 masters: the input
and the weight cast to bf16, one GEMM forward, two backward, the gradients cast back to
fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict
from unittest import mock

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fp4rl.kernels import FUSED_MAX_ROWS

if TYPE_CHECKING:
    from rich.console import Console

    from fp4rl.kernels.triton_quant import Variant

#: name: (HBM bytes/s, dense bf16 FLOP/s)
GPUS = {"H100": (3.35e12, 990e12), "H200": (4.8e12, 990e12)}
#: the shape the targets are stated for: 512 tokens of Qwen2.5-3B's up_proj
TARGET_SHAPE = (512, 2048, 11008)
#: the FP4 linear's bytes against bf16's: one micro-batch, and eight sharing Q(W)
TARGETS = {1: 1.2, 8: 1.1}

aten = torch.ops.aten
#: ops that return a view or only change metadata: no bytes move
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default,
          aten.transpose.int, aten.permute.default, aten.expand.default,
          aten.as_strided.default, aten.slice.Tensor, aten.select.int, aten.alias.default,
          aten.detach.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.squeeze.default, aten.reshape.default, aten.split.Tensor,
          aten.unbind.int, aten.view_as.default, aten.lift_fresh.default,
          aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
          aten.new_empty.default}
#: ops counted under a name of their own
_NAMES = {aten._to_copy.default: "cast"}
_GEMMS = {aten.mm.default, aten.mm.dtype, aten.addmm.default, aten.bmm.default}


class LaunchRecord(TypedDict):
    """A :class:`Launch` in the JSON reports."""

    name: str
    phase: str
    read: int
    written: int
    flops: int


@dataclass
class Launch:
    """One op or kernel launch: what it read and wrote, its FLOPs, the pass it ran in."""

    name: str
    phase: str
    read: int
    written: int
    flops: int = 0

    @property
    def bytes(self) -> int:
        return self.read + self.written

    def seconds(self, gpu: str) -> float:
        bandwidth, peak = GPUS[gpu]
        return max(self.bytes / bandwidth, self.flops / peak)

    def record(self) -> LaunchRecord:
        """This launch as the reports write it (its fields, in their order)."""
        return {"name": self.name, "phase": self.phase, "read": self.read,
                "written": self.written, "flops": self.flops}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


@dataclass
class Recorder:
    """The launches of a region, labelled by the phase set with :meth:`phase`."""

    launches: list[Launch] = field(default_factory=list)
    current: str = "forward"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def op(self, func: OpOverload[..., object], args: tuple[object, ...],
           kwargs: dict[str, object], out: object) -> None:
        if func in _VIEWS:
            return
        read = sum(map(_nbytes, _tensors((args, kwargs))))
        written = sum(map(_nbytes, _tensors(out)))
        flops = 0
        if func in _GEMMS:
            a, b = _tensors(args)[-2:] if func is aten.addmm.default else _tensors(args)[:2]
            flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * \
                (a.shape[0] if a.dim() == 3 else 1)
        elif func.name() == "fp4rl::packed_mm":  # (terms x tokens, in) x (out, in)
            x, fields, rows, cols, terms = args[0], args[1], args[4], args[5], args[6]
            # the operator's schema: (Tensor a, Tensor[] fields, str, str, int rows, ...)
            assert isinstance(x, torch.Tensor)
            assert isinstance(rows, int) and isinstance(cols, int) and isinstance(terms, int)
            flops = 2 * x.shape[0] * rows * cols
            if x.shape[0] // terms > FUSED_MAX_ROWS:  # the operator decodes, then multiplies
                codes = sum(map(_nbytes, _tensors(fields)))
                weight = rows * cols * x.element_size()
                self.launches += [Launch("decode_rows", self.current, codes, weight),
                                  Launch("mm", self.current, read - codes + weight, written,
                                         flops)]
                return
        name = _NAMES.get(func, str(func.overloadpacket.__name__))
        self.launches.append(Launch(name, self.current, read, written, flops))

    def kernel(self, variant: Variant, args: tuple[object, ...]) -> None:
        """A Triton launch: each pointer argument read or written as its kernel uses it."""
        consts = dict(variant.constants)
        names = [n for n in variant.kernel.arg_names if n not in consts]
        read = written = 0
        for name, value in zip(names, args, strict=False):
            if not isinstance(value, torch.Tensor):
                continue
            if not _used(variant.kernel.__name__, name, consts):
                continue
            if name in ("y_ptr", "z_ptr", "r_ptr", "out_ptr", "c_ptr"):
                written += _nbytes(value)
            else:
                read += _nbytes(value)
        name = variant.kernel.__name__.strip("_").removesuffix("_kernel")
        self.launches.append(Launch(name, self.current, read, written))

    def total(self, phase: str | None = None) -> int:
        return sum(x.bytes for x in self.launches if phase in (None, x.phase))

    def records(self) -> list[LaunchRecord]:
        """Every launch as the reports write it."""
        return [x.record() for x in self.launches]


def _used(kernel: str, name: str, consts: dict[str, int | bool]) -> bool:
    """Whether a launch's pointer argument is read (absent ones are passed as another)."""
    if name == "noise_ptr":
        return bool(consts.get("HAS_NOISE"))
    if name == "g_ptr":
        return bool(consts.get("HAS_SCALE"))
    if name == "r_ptr":
        return bool(consts.get("TERMS"))
    if name == "bias_ptr":
        return bool(consts.get("HAS_BIAS"))
    if kernel in ("_decode_kernel", "_packed_mm_kernel") and name in ("l2_ptr", "l3_ptr"):
        return consts.get("FMT") == 0  # HiF4's two levels; the others pass their scale
    return True


class _Mode(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: OpOverload[..., object], types: tuple[type, ...],
                           args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recorder.op(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record every op and Triton launch in the region, on ``meta`` tensors, as a CUDA
    tensor would run them: the Triton kernels chosen (and not run), bf16 compute."""
    from fp4rl import kernels
    from fp4rl.kernels import triton_quant

    recorder = Recorder()
    launch = lambda variant, grid, *args: recorder.kernel(variant, args)  # noqa: E731
    with mock.patch.object(kernels, "_triton_for", lambda device: triton_quant), \
            mock.patch.object(triton_quant.Variant, "launch", launch), \
            mock.patch("fp4rl.nn.linear.active_compute_dtype", lambda x: torch.bfloat16), \
            _Mode(recorder):
        yield recorder


def _fp4_step(recipe: str, m: int, k: int, n: int, micro_batches: int) -> Recorder:
    from fp4rl.nn import FP4Linear, get_recipe

    meta = torch.device("meta")
    layer = FP4Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=meta),
                                  get_recipe(recipe))
    layer.hold()  # one step's micro-batches, as the trainer holds the weights for a step
    try:
        return _run(lambda x: layer(x), m, k, micro_batches)
    finally:
        layer.release()


def _bf16_step(m: int, k: int, n: int, micro_batches: int) -> Recorder:
    weight = torch.empty(n, k, device="meta", requires_grad=True)
    return _run(lambda x: torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()),
                m, k, micro_batches)


def _run(forward: Callable[[torch.Tensor], torch.Tensor], m: int, k: int,
         micro_batches: int) -> Recorder:
    rec = Recorder()
    for _ in range(micro_batches):
        x = torch.empty(m, k, device="meta", requires_grad=True)
        with recording() as one:
            with one.phase("forward"):
                y = forward(x)
            with one.phase("backward"):
                y.backward(torch.empty_like(y))
        rec.launches += one.launches
    return rec


class PassBytes(TypedDict):
    """The two layers' bytes in one pass (forward or backward)."""

    fp4_bytes: int
    bf16_bytes: int


class Roofline(TypedDict):
    """The two layers' roofline times on one GPU, and their ratio."""

    fp4_s: float
    bf16_s: float
    ratio: float


class LinearTraffic(TypedDict):
    """The JSON record of a :class:`Traffic` (``fp4rl bench linear --traffic``)."""

    shape: list[int]
    recipe: str
    micro_batches: int
    fp4_bytes: int
    bf16_bytes: int
    ratio: float
    target: float | None
    passes: dict[str, PassBytes]
    fp4_launches: list[LaunchRecord]
    bf16_launches: list[LaunchRecord]
    roofline: dict[str, Roofline]


@dataclass
class Traffic:
    """The two layers' launches for one shape."""

    shape: tuple[int, int, int]
    recipe: str
    micro_batches: int
    fp4: Recorder
    bf16: Recorder

    @property
    def ratio(self) -> float:
        return self.fp4.total() / self.bf16.total()

    def target(self) -> float | None:
        return TARGETS.get(self.micro_batches) if self.shape == TARGET_SHAPE else None

    def as_dict(self) -> LinearTraffic:
        roof = {gpu: (sum(x.seconds(gpu) for x in self.fp4.launches),
                      sum(x.seconds(gpu) for x in self.bf16.launches))
                for gpu in GPUS}
        return {"shape": list(self.shape), "recipe": self.recipe,
                "micro_batches": self.micro_batches, "fp4_bytes": self.fp4.total(),
                "bf16_bytes": self.bf16.total(), "ratio": self.ratio,
                "target": self.target(),
                "passes": {p: {"fp4_bytes": self.fp4.total(p),
                               "bf16_bytes": self.bf16.total(p)}
                           for p in ("forward", "backward")},
                "fp4_launches": self.fp4.records(),
                "bf16_launches": self.bf16.records(),
                "roofline": {gpu: {"fp4_s": fp4, "bf16_s": bf16, "ratio": fp4 / bf16}
                             for gpu, (fp4, bf16) in roof.items()}}


def linear_traffic(recipe: str = "hif4", shape: tuple[int, int, int] = TARGET_SHAPE,
                   micro_batches: int = 1) -> Traffic:
    """The bytes of ``micro_batches`` forward + backward passes of an FP4 linear of
    ``recipe`` (``shape`` = tokens, in_features, out_features) and of the bf16 baseline."""
    m, k, n = shape
    return Traffic(shape, recipe, micro_batches, _fp4_step(recipe, m, k, n, micro_batches),
                   _bf16_step(m, k, n, micro_batches))


#: the packed rollout linear's bytes against bf16's at 64 tokens
ROLLOUT_TARGET = (64, 0.4)
#: the storage a rollout report's ``fp4_bytes`` and ``ratio`` count: the 4-bit codes and
#: scales, as the packed store runs (what the target is set for)
ROLLOUT_FP4_STORAGE = "packed"
#: the rollout linears the report compares: the dequantized store, the packed store as it
#: runs (the fused kernel up to :data:`~fp4rl.kernels.FUSED_MAX_ROWS` tokens), and the
#: packed store's other path (decode into a bf16 weight, then the bf16 GEMM)
ROLLOUT_STORAGES = ("dequantized", "packed", "packed_decode")


@dataclass
class RolloutTraffic:
    """One rollout linear's launches for each of :data:`ROLLOUT_STORAGES`, and a bf16
    linear's."""

    recipe: str
    tokens: int
    shape: tuple[int, int]
    bf16: Recorder
    storages: dict[str, Recorder]

    def ratio(self, storage: str) -> float:
        return self.storages[storage].total() / self.bf16.total()

    def as_dict(self) -> dict[str, object]:
        """The JSON record: the linear's keys (:class:`LinearTraffic`: ``shape`` as tokens,
        in, out; ``fp4_bytes``, ``bf16_bytes``, ``ratio``, ``target``, the launches), the
        FP4 side being the store of 4-bit codes as it runs (:data:`ROLLOUT_FP4_STORAGE`,
        named by ``storage``); then per storage its bytes, ratio to bf16 and launches,
        flat (``packed_bytes``, ``packed_ratio``, ``packed_launches``, ...)."""
        fp4 = self.storages[ROLLOUT_FP4_STORAGE]
        tokens, target = ROLLOUT_TARGET
        out: dict[str, object] = {
            "shape": [self.tokens, *self.shape], "recipe": self.recipe, "tokens": self.tokens,
            "storage": ROLLOUT_FP4_STORAGE, "fp4_bytes": fp4.total(),
            "bf16_bytes": self.bf16.total(), "ratio": self.ratio(ROLLOUT_FP4_STORAGE),
            "target": target if self.tokens == tokens else None,
            "fp4_launches": fp4.records(), "bf16_launches": self.bf16.records()}
        for name, rec in self.storages.items():
            out |= {f"{name}_bytes": rec.total(), f"{name}_ratio": self.ratio(name),
                    f"{name}_launches": rec.records()}
        return out


def rollout_traffic(recipe: str = "hif4", tokens: int = 64,
                    shape: tuple[int, int] = (2048, 11008)) -> RolloutTraffic:
    """The bytes of one rollout linear (``shape`` = in, out features) at ``tokens`` rows,
    as the vLLM method computes it on a GPU (the recovery's activation operator, then the
    store's GEMM), for each of :data:`ROLLOUT_STORAGES`, against a bf16 linear whose
    weight is bf16 (vLLM's own). The activation, decode and packed GEMM operators are
    custom ops: each counts as reading its inputs and writing its outputs once; past the
    fused kernel's token count the packed GEMM operator decodes, then multiplies, and is
    counted as those two launches (a scaled GEMM's epilogue passes not included)."""
    from fp4rl.gemm import PackedOperand, mm
    from fp4rl.nn import get_recipe
    from fp4rl.recovery import make_recovery
    from fp4rl.recovery.ops import TracedActivation
    from fp4rl.rollout.vllm.config import WeightStorage
    from fp4rl.rollout.vllm.stores import DequantizedStore, keep_packed

    k, n = shape
    r = get_recipe(recipe).rollout
    recovery = make_recovery(r.recovery, r.activations, k, 0, weight_format=r.weights)
    meta, bf16 = torch.device("meta"), torch.bfloat16
    w = torch.empty(n, k, device=meta)
    x = torch.empty(tokens, k, device=meta, dtype=bf16)
    with recording() as base:
        torch.nn.functional.linear(x, torch.empty(n, k, device=meta, dtype=bf16))
    activation = TracedActivation(recovery)
    runs: dict[str, Recorder] = {}
    for name in ROLLOUT_STORAGES:
        storage = WeightStorage.DEQUANTIZED if name == "dequantized" else WeightStorage.PACKED
        with recording():  # built as on a GPU (which decides whether it fuses); not counted
            part = recovery.weight_operand(w, packed=storage is WeightStorage.PACKED)
            # the store each layout's scheme keeps (fp4rl.rollout.vllm.method)
            store = keep_packed([part], bf16, prepack=False) \
                if storage is WeightStorage.PACKED else \
                DequantizedStore.of([part], bf16, prepack=False)
        with recording() as rec:
            acts = activation(x, bf16)
            if name == "packed_decode":  # the packed weight decoded, then the bf16 GEMM
                assert isinstance(part, PackedOperand)
                mm(acts, part.decode(bf16).t(), bf16)
            else:
                store.apply(acts, bf16, None)
        runs[name] = rec
    return RolloutTraffic(recipe, tokens, (k, n), base, runs)


def render_rollout(traffic: RolloutTraffic, console: Console) -> None:
    """One line per storage, and the target."""
    k, n = traffic.shape
    console.print(f"bytes moved by one rollout linear ({traffic.recipe}, "
                  f"{traffic.tokens} tokens x {k} -> {n}), against bf16 "
                  f"({traffic.bf16.total() / 1e6:,.2f} MB):", markup=False)
    for storage, rec in traffic.storages.items():
        launches = ", ".join(f"{x.name} {x.bytes / 1e6:,.2f}" for x in rec.launches)
        console.print(f"  {storage}: {rec.total() / 1e6:,.2f} MB, "
                      f"{traffic.ratio(storage):.2f}x ({launches})", markup=False)
    tokens, target = ROLLOUT_TARGET
    if traffic.tokens == tokens:
        ratio = traffic.ratio("packed")
        console.print(f"target: the packed linear <= {target}x bf16's bytes at {tokens} "
                      f"tokens: {'met' if ratio <= target else 'missed'} ({ratio:.2f}x)",
                      markup=False)


def render(traffic: Traffic, console: Console) -> None:
    """The bytes per phase and per launch, the roofline times, the target."""
    from rich.table import Table

    m, k, n = traffic.shape
    table = Table(title=f"bytes moved, {traffic.recipe} linear against bf16 nn.Linear, "
                        f"{m} tokens x {k} -> {n}, {traffic.micro_batches} micro-batch(es), "
                        "forward + backward (MB)")
    for col in ("phase", "launch", "fp4 read", "fp4 written", "bf16 read", "bf16 written"):
        table.add_column(col, justify="right")
    for phase in ("forward", "backward"):
        rows: dict[str, list[int]] = {}
        for side, rec in ((0, traffic.fp4), (2, traffic.bf16)):
            for x in rec.launches:
                if x.phase == phase:
                    r = rows.setdefault(x.name, [0, 0, 0, 0])
                    r[side] += x.read
                    r[side + 1] += x.written
        for name, r in rows.items():
            table.add_row(phase, name, *(f"{v / 1e6:,.1f}" for v in r))
        table.add_row(phase, "total", f"{traffic.fp4.total(phase) / 1e6:,.1f}", "",
                      f"{traffic.bf16.total(phase) / 1e6:,.1f}", "")
    console.print(table)
    d = traffic.as_dict()
    console.print(f"total: fp4 {d['fp4_bytes'] / 1e6:,.1f} MB, bf16 {d['bf16_bytes'] / 1e6:,.1f}"
                  f" MB, ratio {d['ratio']:.2f}x", markup=False)
    for gpu, roof in d["roofline"].items():
        bandwidth, peak = GPUS[gpu]
        console.print(f"roofline on {gpu} ({bandwidth / 1e12:.2f} TB/s, {peak / 1e12:.0f} "
                      f"TFLOP/s bf16): fp4 {roof['fp4_s'] * 1e6:,.1f} us, bf16 "
                      f"{roof['bf16_s'] * 1e6:,.1f} us, {roof['ratio']:.2f}x", markup=False)
    target = traffic.target()
    if target is not None:
        verdict = "met" if traffic.ratio <= target else "missed"
        console.print(f"target: fp4 bytes <= {target}x bf16 at this shape with "
                      f"{traffic.micro_batches} micro-batch(es): {verdict} "
                      f"({traffic.ratio:.2f}x)", markup=False)


__all__ = ["GPUS", "ROLLOUT_FP4_STORAGE", "ROLLOUT_STORAGES", "ROLLOUT_TARGET", "TARGETS",
           "TARGET_SHAPE", "Launch",
           "LaunchRecord", "LinearTraffic", "PassBytes", "Recorder", "RolloutTraffic",
           "Roofline", "Traffic", "linear_traffic", "recording", "render",
           "render_rollout", "rollout_traffic"]
