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
cast to bf16 each micro-batch, the weight once a step (autocast's cast cache holds it
across the micro-batches of one autocast region), one GEMM forward, two backward, the
gradients cast back to fp32. The FP4 linear is counted along both of its paths: quantize
first (each operand quantized by a pass of its own, then a bf16 GEMM; ``Q(W)`` kept for
the step) and quantize on load (``FP4RL_QUANTIZE_ON_LOAD=1``: activations and gradients
quantized inside the GEMM, :mod:`fp4rl.kernels.triton_qmm`), which reads each operand
once but quantizes a tile once per program along the output's other axis: the report
counts those values (``requantized``), arithmetic that the bytes do not show.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict
from unittest import mock

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from rich.console import Console

    from fp4rl.kernels.triton_quant import Variant

#: name: (HBM bytes/s, dense bf16 FLOP/s)
GPUS = {"H100": (3.35e12, 990e12), "H200": (4.8e12, 990e12)}
#: the default shape: 512 tokens of Qwen2.5-3B's up_proj
TARGET_SHAPE = (512, 2048, 11008)
#: the FP4 linear's bytes against bf16's on the quantize-on-load path, at every shape and
#: micro-batch count: formats whose scales are per block, and those with an FP32 scale on
#: top (NVFP4's per tensor or per token: a pass over the operand to find its amax)
TARGETS = {False: 1.1, True: 1.25}
#: the FP4 linear's two paths (:func:`fp4rl.kernels.quantize_on_load` chooses)
PATHS = ("quantize_first", "on_load")

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
    requantized: int


@dataclass
class Launch:
    """One op or kernel launch: what it read and wrote, its FLOPs, the pass it ran in."""

    name: str
    phase: str
    read: int
    written: int
    flops: int = 0
    #: operand values a quantize-on-load GEMM quantizes (each tile once per program)
    requantized: int = 0

    @property
    def bytes(self) -> int:
        return self.read + self.written

    def seconds(self, gpu: str) -> float:
        bandwidth, peak = GPUS[gpu]
        return max(self.bytes / bandwidth, self.flops / peak)

    def record(self) -> LaunchRecord:
        """This launch as the reports write it (its fields, in their order)."""
        return {"name": self.name, "phase": self.phase, "read": self.read,
                "written": self.written, "flops": self.flops, "requantized": self.requantized}


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
        flops = requantized = 0
        if func.name() == "fp4rl::qmm":  # (a, a_code, ..., b, b_code, ...): code -1 as it is
            from fp4rl.kernels.triton_qmm import requantized_values

            a, b = args[0], args[4]
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            (m, k), n = a.shape, b.shape[1]
            flops = 2 * m * k * n
            requantized = requantized_values(m, k, n, args[1] != -1, args[5] != -1)
        elif func in _GEMMS:
            a, b = _tensors(args)[-2:] if func is aten.addmm.default else _tensors(args)[:2]
            flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * \
                (a.shape[0] if a.dim() == 3 else 1)
        elif func.name() == "fp4rl::packed_mm":  # (terms x tokens, in) x (out, in)
            x, rows, cols, terms = args[0], args[4], args[5], args[6]
            # the operator's schema: (Tensor a, Tensor[] fields, str, str, int rows, ...,
            # Tensor? r_values, ...): with an n:m second term ``a`` holds the first alone
            assert isinstance(x, torch.Tensor)
            assert isinstance(rows, int) and isinstance(cols, int) and isinstance(terms, int)
            nm = len(args) > 11 and args[11] is not None
            m = x.shape[0] if nm else x.shape[0] // terms
            flops = 2 * m * terms * rows * cols
            from fp4rl.kernels.triton_packed_mm import k_split

            part = k_split(m, rows, cols, terms)
            if part < cols:  # split K: fp32 partial sums out, added in a second kernel
                partials = -(-cols // part) * terms * m * rows * 4
                self.launches += [Launch("packed_mm", self.current, read, partials, flops),
                                  Launch("packed_reduce", self.current, partials, written)]
                return
        name = _NAMES.get(func, str(func.overloadpacket.__name__))
        self.launches.append(Launch(name, self.current, read, written, flops, requantized))

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
            if name in ("y_ptr", "z_ptr", "out_ptr", "c_ptr", "m_ptr") or \
                    (name == "r_ptr" and variant.kernel.__name__ != "_packed_mm_kernel"):
                written += _nbytes(value)
            else:
                read += _nbytes(value)
        name = variant.kernel.__name__.strip("_").removesuffix("_kernel")
        self.launches.append(Launch(name, self.current, read, written))

    def total(self, phase: str | None = None) -> int:
        return sum(x.bytes for x in self.launches if phase in (None, x.phase))

    def requantized(self) -> int:
        return sum(x.requantized for x in self.launches)

    def records(self) -> list[LaunchRecord]:
        """Every launch as the reports write it."""
        return [x.record() for x in self.launches]


def _used(kernel: str, name: str, consts: dict[str, int | bool]) -> bool:
    """Whether a launch's pointer argument is read (absent ones are passed as another)."""
    if name == "noise_ptr":
        return bool(consts.get("HAS_NOISE"))
    if name == "g_ptr":
        return bool(consts.get("HAS_SCALE"))
    if kernel == "_packed_mm_kernel" and name in ("r_ptr", "bits_ptr"):
        return bool(consts.get("NM"))  # an n:m second term's values and bits
    if name == "r_ptr":
        return kernel == "_resq_nm_kernel" or bool(consts.get("TERMS"))
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
    from fp4rl.kernels import dispatch, triton_quant

    recorder = Recorder()
    launch = lambda variant, grid, *args: recorder.kernel(variant, args)  # noqa: E731
    with mock.patch.object(dispatch, "triton_for", lambda device: triton_quant), \
            mock.patch.object(triton_quant.Variant, "launch", launch), \
            mock.patch("fp4rl.nn.linear.active_compute_dtype", lambda x: torch.bfloat16), \
            _Mode(recorder):
        yield recorder


def _fp4_step(recipe: str, m: int, k: int, n: int, micro_batches: int,
              path: str = "quantize_first") -> tuple[Recorder, str | None]:
    """The layer's launches along ``path``, and (on the on-load path) why the layer
    quantized first instead, as its warning says, or None."""
    import warnings

    from fp4rl.nn import FP4Linear, get_recipe

    meta = torch.device("meta")
    layer = FP4Linear.from_linear(torch.nn.Linear(k, n, bias=False, device=meta),
                                  get_recipe(recipe))
    flag = {"FP4RL_QUANTIZE_ON_LOAD": "1" if path == "on_load" else "0"}
    layer.hold()  # one step's micro-batches, as the trainer holds the weights for a step
    try:
        with mock.patch.dict(os.environ, flag), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            rec = _run(lambda x: layer(x), m, k, micro_batches)
    finally:
        layer.release()
    why = [str(w.message) for w in said if "FP4RL_QUANTIZE_ON_LOAD" in str(w.message)]
    return rec, (why[0].split("quantizes first (", 1)[-1].removesuffix(")") if why else None)


def _bf16_step(m: int, k: int, n: int, micro_batches: int) -> Recorder:
    weight = torch.empty(n, k, device="meta", requires_grad=True)
    cast: list[torch.Tensor] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not cast:  # once a step, recorded in the first micro-batch's forward
            cast.append(weight.bfloat16())
        return torch.nn.functional.linear(x.bfloat16(), cast[0])

    return _run(forward, m, k, micro_batches)


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


class PathTraffic(TypedDict):
    """One of the FP4 linear's paths in the JSON report."""

    fp4_bytes: int
    ratio: float
    requantized: int
    passes: dict[str, PassBytes]
    fp4_launches: list[LaunchRecord]
    roofline: dict[str, Roofline]


class LinearTraffic(TypedDict):
    """The JSON record of a :class:`Traffic` (``fp4rl bench linear --traffic``): the keys
    of the path the layer runs by default (``path``) at the top, each path in ``paths``."""

    shape: list[int]
    recipe: str
    micro_batches: int
    baseline: str
    path: str
    fp4_bytes: int
    bf16_bytes: int
    ratio: float
    target: float | None
    target_path: str
    not_on_load: str | None
    passes: dict[str, PassBytes]
    fp4_launches: list[LaunchRecord]
    bf16_launches: list[LaunchRecord]
    roofline: dict[str, Roofline]
    paths: dict[str, PathTraffic]


#: how the bf16 side is computed, as the report states it
BASELINE = ("nn.Linear under autocast with FP32 masters: the input cast to bf16 each "
            "micro-batch, the weight once a step, the gradients cast back to fp32")


@dataclass
class Traffic:
    """The two layers' launches for one shape: the FP4 linear along each path."""

    shape: tuple[int, int, int]
    recipe: str
    micro_batches: int
    paths: dict[str, Recorder]
    bf16: Recorder
    #: whether the recipe's formats carry an FP32 scale on top of their blocks
    tensor_scale: bool = False
    #: why the layer quantizes first on the on-load setting too, or None where it does not
    not_on_load: str | None = None

    @property
    def fp4(self) -> Recorder:
        """The path the layer runs by default (quantize first)."""
        return self.paths["quantize_first"]

    def path_ratio(self, path: str) -> float:
        return self.paths[path].total() / self.bf16.total()

    @property
    def ratio(self) -> float:
        return self.path_ratio("quantize_first")

    def target(self) -> float:
        """The bytes target of the quantize-on-load path (every shape, every count)."""
        return TARGETS[self.tensor_scale]

    def _roofline(self, rec: Recorder) -> dict[str, Roofline]:
        out: dict[str, Roofline] = {}
        for gpu in GPUS:
            fp4 = sum(x.seconds(gpu) for x in rec.launches)
            bf16 = sum(x.seconds(gpu) for x in self.bf16.launches)
            out[gpu] = {"fp4_s": fp4, "bf16_s": bf16, "ratio": fp4 / bf16}
        return out

    def _path(self, path: str) -> PathTraffic:
        rec = self.paths[path]
        return {"fp4_bytes": rec.total(), "ratio": self.path_ratio(path),
                "requantized": rec.requantized(),
                "passes": {p: {"fp4_bytes": rec.total(p), "bf16_bytes": self.bf16.total(p)}
                           for p in ("forward", "backward")},
                "fp4_launches": rec.records(), "roofline": self._roofline(rec)}

    def as_dict(self) -> LinearTraffic:
        paths = {p: self._path(p) for p in self.paths}
        first = paths["quantize_first"]
        return {"shape": list(self.shape), "recipe": self.recipe,
                "micro_batches": self.micro_batches, "baseline": BASELINE,
                "path": "quantize_first", "fp4_bytes": first["fp4_bytes"],
                "bf16_bytes": self.bf16.total(), "ratio": first["ratio"],
                "target": self.target(), "target_path": "on_load",
                "not_on_load": self.not_on_load,
                "passes": first["passes"], "fp4_launches": first["fp4_launches"],
                "bf16_launches": self.bf16.records(), "roofline": first["roofline"],
                "paths": paths}


def linear_traffic(recipe: str = "hif4", shape: tuple[int, int, int] = TARGET_SHAPE,
                   micro_batches: int = 1) -> Traffic:
    """The bytes of ``micro_batches`` forward + backward passes of an FP4 linear of
    ``recipe`` (``shape`` = tokens, in_features, out_features) along each of its
    :data:`PATHS`, and of the bf16 baseline (:data:`BASELINE`)."""
    from fp4rl.formats import NumberFormat
    from fp4rl.nn import get_recipe

    m, k, n = shape
    train = get_recipe(recipe).train
    scaled = any(isinstance(f, NumberFormat) and f.has_tensor_scale
                 for f in (train.activations, train.gradients))
    runs = {p: _fp4_step(recipe, m, k, n, micro_batches, p) for p in PATHS}
    return Traffic(shape, recipe, micro_batches, {p: rec for p, (rec, _) in runs.items()},
                   _bf16_step(m, k, n, micro_batches), scaled, runs["on_load"][1])


#: the packed rollout linear's bytes against bf16's up to 64 tokens (a decode step, bound
#: by the weight's bytes; 64 is also the report's default token count)
ROLLOUT_TARGET = (64, 0.4)
#: the packed rollout linear's bytes against bf16's at every larger token count (a large
#: decode batch, a prefill)
ROLLOUT_LARGE_TARGET = 1.0
#: the storage a rollout report's ``fp4_bytes`` and ``ratio`` count: the 4-bit codes and
#: scales, as the packed store runs (what the target is set for)
ROLLOUT_FP4_STORAGE = "packed"
#: the rollout linears the report compares: the dequantized store, the packed store as it
#: runs on a GPU (the fused kernel, at every token count), and the packed store's other
#: path (decode into a bf16 weight, then the bf16 GEMM: a CPU, or a batch-invariant forward)
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
        out: dict[str, object] = {
            "shape": [self.tokens, *self.shape], "recipe": self.recipe, "tokens": self.tokens,
            "storage": ROLLOUT_FP4_STORAGE, "fp4_bytes": fp4.total(),
            "bf16_bytes": self.bf16.total(), "ratio": self.ratio(ROLLOUT_FP4_STORAGE),
            "target": rollout_target(self.tokens),
            "fp4_launches": fp4.records(), "bf16_launches": self.bf16.records()}
        for name, rec in self.storages.items():
            out |= {f"{name}_bytes": rec.total(), f"{name}_ratio": self.ratio(name),
                    f"{name}_launches": rec.records()}
        return out


def rollout_target(tokens: int) -> float:
    """The packed rollout linear's bytes target against bf16's at ``tokens`` rows."""
    limit, small = ROLLOUT_TARGET
    return small if tokens <= limit else ROLLOUT_LARGE_TARGET


def rollout_traffic(recipe: str = "hif4", tokens: int = 64,
                    shape: tuple[int, int] = (2048, 11008)) -> RolloutTraffic:
    """The bytes of one rollout linear (``shape`` = in, out features) at ``tokens`` rows,
    as the vLLM method computes it on a GPU (the recovery's activation operator, then the
    store's GEMM), for each of :data:`ROLLOUT_STORAGES`, against a bf16 linear whose
    weight is bf16 (vLLM's own). The activation, decode and packed GEMM operators are
    custom ops: each counts as reading its inputs and writing its outputs once (the model
    of every GEMM in these reports, bf16's included); the packed GEMM's split of K, where it
    takes one, adds its fp32 partial sums, written and read back by a second launch.

    What one read of each input leaves out: a GEMM kernel re-reads a tile of one operand
    for every tile of the output along the other axis. The packed kernel reads each weight
    tile (codes and scales) once per row tile, ``ceil(tokens / BM)`` times
    (:func:`~fp4rl.kernels.triton_packed_mm.height`: once up to 128 tokens, 2 at 256, 16 at
    2048 for one term; ResQ's two terms take 64-row tiles: 4 at 256, 32 at 2048), and the
    activations once per 64 outputs; a bf16 GEMM re-reads its operands the same way, once
    per tile of its own. Those re-reads mostly hit the L2 cache (the codes of
    2048 x 11008 are 12.7 MB; an H100's L2 holds 50 MB), which this count does not model:
    it is the floor of HBM bytes, not a cache simulation."""
    from fp4rl.gemm import Operand, PackedOperand, mm
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
            if name == "packed_decode":  # the packed weight decoded, then the bf16 GEMM
                assert isinstance(part, PackedOperand)
                mm([a for a in activation(x, bf16) if isinstance(a, Operand)],
                   part.decode(bf16).t(), bf16)
            else:
                store.apply(activation(x, bf16, packed=store.takes_nm()), bf16, None)
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
    tokens = ROLLOUT_TARGET[0]
    target = rollout_target(traffic.tokens)
    where = f"up to {tokens}" if traffic.tokens <= tokens else f"above {tokens}"
    ratio = traffic.ratio("packed")
    console.print(f"target: the packed linear <= {target}x bf16's bytes {where} tokens: "
                  f"{'met' if ratio <= target else 'missed'} ({ratio:.2f}x)", markup=False)


def render(traffic: Traffic, console: Console) -> None:
    """The bytes per phase and per launch of each path and of bf16, the roofline times,
    the quantized values of the on-load path, the target."""
    from rich.table import Table

    m, k, n = traffic.shape
    table = Table(title=f"bytes moved, {traffic.recipe} linear against bf16 nn.Linear, "
                        f"{m} tokens x {k} -> {n}, {traffic.micro_batches} micro-batch(es), "
                        "forward + backward (MB read / written)")
    sides = [(p.replace("_", " "), rec) for p, rec in traffic.paths.items()]
    sides.append(("bf16", traffic.bf16))
    for col in ("phase", "launch", *(name for name, _ in sides)):
        table.add_column(col, justify="right")
    for phase in ("forward", "backward"):
        rows: dict[str, list[list[int]]] = {}
        for i, (_, rec) in enumerate(sides):
            for x in rec.launches:
                if x.phase == phase:
                    cell = rows.setdefault(x.name, [[0, 0] for _ in sides])[i]
                    cell[0] += x.read
                    cell[1] += x.written
        for name, cells in rows.items():
            table.add_row(phase, name, *(f"{r / 1e6:,.1f} / {w / 1e6:,.1f}" if r or w else ""
                                         for r, w in cells))
        table.add_row(phase, "total", *(f"{rec.total(phase) / 1e6:,.1f}" for _, rec in sides))
    console.print(table)
    d = traffic.as_dict()
    console.print(f"bf16 baseline: {d['baseline']}: {d['bf16_bytes'] / 1e6:,.1f} MB",
                  markup=False)
    for path, one in d["paths"].items():
        values = m * k + k * n + 2 * m * n  # what quantize passes read: X, W, dY twice
        extra = (f"; quantizes {one['requantized'] / 1e6:,.0f} M values, "
                 f"{one['requantized'] / values:.0f}x the operands' (arithmetic the bytes "
                 "do not show)") if one["requantized"] else ""
        roofs = ", ".join(f"{gpu} {r['ratio']:.2f}x" for gpu, r in one["roofline"].items())
        console.print(f"{path}: fp4 {one['fp4_bytes'] / 1e6:,.1f} MB, {one['ratio']:.2f}x bf16"
                      f" (roofline without that arithmetic: {roofs}){extra}", markup=False)
    target = traffic.target()
    ratio = traffic.path_ratio("on_load")
    verdict = f"{'met' if ratio <= target else 'missed'} ({ratio:.2f}x)"
    if traffic.not_on_load is not None:  # the on-load row is the quantize-first path
        verdict = f"does not apply: this recipe quantizes first ({traffic.not_on_load})"
    console.print(f"target: the on-load path's bytes <= {target}x bf16 at every shape and "
                  f"micro-batch count: {verdict}", markup=False)


__all__ = ["BASELINE", "GPUS", "PATHS", "ROLLOUT_FP4_STORAGE", "ROLLOUT_LARGE_TARGET",
           "ROLLOUT_STORAGES", "ROLLOUT_TARGET", "TARGETS", "TARGET_SHAPE", "Launch",
           "LaunchRecord", "LinearTraffic", "PassBytes", "PathTraffic", "Recorder",
           "RolloutTraffic", "Roofline", "Traffic", "linear_traffic", "recording", "render",
           "render_rollout", "rollout_target", "rollout_traffic"]
