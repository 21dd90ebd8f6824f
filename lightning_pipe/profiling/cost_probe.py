"""What every unit of an unchanged module costs, counted on the meta device from its own step function.

:func:`count_units` runs the user's step on the **meta device** (parameters swapped for meta
tensors; the probe batch is a real host tensor, resized from the example, so masks built from it
stay real and data-dependent checks on them run; nothing else is allocated, any shape can be probed) with the hooks of
:class:`~lightning_pipe.profiling.unit_tracker.UnitTracker`, which tell which unit (``pre``, a block,
``post``) forward runs and backward has reached. Per unit, forward and backward: the FLOPs of every
ATen op (``torch.utils.flop_counter``'s formulas), the bytes it reads and writes, the number of ops,
and the bytes autograd saves for backward (``saved_tensors_hooks``; parameters and the batch are not
activations; a storage counts once, for the unit that saved it first: the same rule as
``memory_accounting``). Seconds come from an assumed :class:`DeviceSpeed` (a roofline per op plus a
fixed overhead per op), not from a clock; ``unit_timing.py`` measures real seconds.
:func:`fit_cost_model` fits a :class:`~lightning_pipe.planning.CostModel` to the counts.

On meta, ``scaled_dot_product_attention`` would take the math path and save the ``[B, H, T, T]``
attention matrix; real devices run a fused kernel that saves ``q, k, v``, the output and a
log-sum-exp. The meta probe therefore routes it to the CPU flash kernel when a CPU would use it
(no dropout, equal head sizes, no grouped-query expansion): its saved tensors are those of flash
and memory-efficient attention on CUDA too. Autocast does not apply on the meta device: under
mixed precision, saved bytes are counted in the parameters' dtype (an overestimate).

Lengths follow the batch: a probe microbatch has ``num_sequences`` samples of ``length`` positions
of its token tensor (``sequence_lengths``). When the blocks see fewer positions than the batch holds
(ids ``[B, T + 1]`` feed ``T``), :attr:`UnitCount.positions` records it and
:func:`fit_cost_model` fits in the positions the blocks see (``length_offset``).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import nnls
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from lightning_pipe.model.blocks import BlockStack
from lightning_pipe.model.placeholders import real_devices
from lightning_pipe.model.units import UnitLayout
from lightning_pipe.planning.cost_model import CostModel, LinearCost, MicrobatchShape, UnitCost
from lightning_pipe.planning.fit import UnitFit, fit_linear_cost
from lightning_pipe.profiling.probing import metrics_untouched
from lightning_pipe.profiling.unit_tracker import (
    SavedBytes,
    UnitTracker,
    nbytes_of,
    resize_microbatch,
    step_loss,
    unit_name,
)
from lightning_pipe.runtime._torch_compat import (
    TorchDispatchMode,
    flash_attention_cpu_ops,
    meta_autocast_disabled,
    tensor_registries,
    tree_flatten,
    tree_map,
)

__all__ = [
    "CostEstimate",
    "DeviceSpeed",
    "MetaProbeError",
    "UnitCount",
    "count_units",
    "fit_cost_model",
    "length_offset",
]


class MetaProbeError(RuntimeError):
    """The user's step cannot run on meta tensors (it reads values: ``.item()``, data-dependent branches)."""


@dataclass(frozen=True)
class DeviceSpeed:
    """An assumed device, to turn counted work into seconds without running anything.

    An op costs ``max(flops / flops_per_second, bytes / memory_bandwidth) + op_overhead`` (a
    roofline plus the fixed cost of dispatching one eager op). Only ratios between units matter to
    the partition planner; absolute seconds matter when the repartition trigger compares a gain
    with a measured migration, which is why :class:`~lightning_pipe.callbacks.ElasticRepartition`
    rescales predictions by measured step times.

    Attributes:
        flops_per_second: sustained FLOP/s of matrix products.
        memory_bandwidth: bytes per second of elementwise ops.
        op_overhead: seconds per op (dispatch, kernel launch).
    """

    flops_per_second: float
    memory_bandwidth: float
    op_overhead: float

    @classmethod
    def for_device(cls, device: torch.device | str) -> DeviceSpeed:
        """Defaults: CPU 50 GFLOP/s, 10 GB/s, 5 us per op (a few cores in float32); CUDA 150 TFLOP/s,
        1.5 TB/s, 10 us per op (an A100/H100-class GPU in 16-bit at about half of peak)."""
        if torch.device(device).type == "cuda":
            return cls(150e12, 1.5e12, 10e-6)
        return cls(50e9, 10e9, 5e-6)

    def seconds(self, flops: float, nbytes: float) -> float:
        """Seconds of one op doing ``flops`` and moving ``nbytes``."""
        return max(flops / self.flops_per_second, nbytes / self.memory_bandwidth) + self.op_overhead


@dataclass(frozen=True)
class UnitCount:
    """What one unit did on one probe microbatch (meta device).

    Attributes:
        unit: 0 for ``pre``, ``1 + i`` for block ``i``, ``num_blocks + 1`` for ``post``.
        num_sequences: samples in the probe microbatch.
        length: positions per sample of the probe's token tensor.
        positions: positions per sample the blocks process (dimension -2 of a block's input).
        forward_flops: FLOPs of the unit's forward ops.
        backward_flops: FLOPs of its backward ops.
        forward_seconds: assumed seconds of its forward (:class:`DeviceSpeed`).
        backward_seconds: assumed seconds of its backward.
        num_forward_ops: ATen ops in its forward.
        saved_bytes: bytes autograd keeps from its forward for backward.
        output_bytes: bytes of the tensors the unit hands on (a block's output; 0 for ``post``).
    """

    unit: int
    num_sequences: int
    length: int
    positions: int
    forward_flops: float
    backward_flops: float
    forward_seconds: float
    backward_seconds: float
    num_forward_ops: int
    saved_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class CostEstimate:
    """A cost model and how to read batches for it.

    Attributes:
        cost_model: per-unit costs for the planner.
        length_offset: positions per sample the batch holds beyond what the blocks process;
            :meth:`shape` removes it (1 when ids ``[B, T + 1]`` feed ``T`` positions).
        source: ``"meta"`` (counted), ``"profile"`` (timed), or ``"given"``.
        fits: the per-unit fits behind a timed model (empty otherwise).
    """

    cost_model: CostModel
    length_offset: int = 0
    source: str = "given"
    fits: tuple[UnitFit, ...] = ()

    def shape(self, lengths: Sequence[int]) -> MicrobatchShape:
        """The shape the units see for samples of the batch's ``lengths``."""
        return MicrobatchShape.from_lengths([max(1, int(n) - self.length_offset) for n in lengths])

    def to_dict(self) -> dict:
        """The cost model's JSON profile plus ``length_offset`` (``CostModel.load`` reads it too)."""
        return {**self.cost_model.to_dict(), "length_offset": self.length_offset, "source": self.source}

    @classmethod
    def from_dict(cls, data: dict) -> CostEstimate:
        """Inverse of :meth:`to_dict`; a plain ``CostModel`` profile gets ``length_offset`` 0."""
        return cls(CostModel.from_dict(data), int(data.get("length_offset", 0)), str(data.get("source", "given")))


@contextlib.contextmanager
def _on_meta(root: nn.Module) -> Iterator[list[Tensor]]:
    """Swap every parameter and buffer of ``root`` for a meta tensor (ties kept); restore after.

    Yields the meta parameters (each tensor once).
    """
    swapped: list[tuple[dict, str, Tensor]] = []
    meta_of: dict[int, Tensor] = {}
    for module in root.modules():
        for registry in tensor_registries(module):
            for name, tensor in list(registry.items()):
                if tensor is None:
                    continue
                meta = meta_of.get(id(tensor))
                if meta is None:
                    meta = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, nn.Parameter):
                        meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
                    meta_of[id(tensor)] = meta
                swapped.append((registry, name, tensor))
                registry[name] = meta
    try:
        yield [t for t in meta_of.values() if isinstance(t, nn.Parameter)]
    finally:
        for registry, name, tensor in swapped:
            registry[name] = tensor


class _MetaFunctions(TorchFunctionMode):
    """On meta: real tensors meeting meta ones go to meta; attention takes the fused kernel's path.

    The batch stays real, and so does what is computed from it alone: ``device="meta"`` (a mask
    built on ``embeds.device``) means the batch's device, so data-dependent checks on masks
    (transformers' ``.all()``) run.

    A mode does not see calls made inside a function it handles (``F.multi_head_attention_forward``
    calling ``F.scaled_dot_product_attention``), so while it is active the module attribute
    ``torch.nn.functional.scaled_dot_product_attention`` is replaced too (restored on exit; only
    meta calls are routed).
    """

    def __init__(self, device: torch.device, batch: list[Tensor]) -> None:
        super().__init__()
        self.device = device
        self.meta_of = {id(t): t.detach().to("meta") for t in batch}  # one meta twin per batch tensor

    def _to_meta(self, value: Any) -> Any:
        if isinstance(value, Tensor) and not value.is_meta:
            meta = self.meta_of.get(id(value))
            return value.detach().to("meta") if meta is None else meta
        return value

    def __enter__(self):
        self._original = F.scaled_dot_product_attention
        original = self._original

        def scaled_dot_product_attention(query, key, value, *args, **kwargs):
            routed = _fused_attention(query, key, value, *args, **kwargs) if query.is_meta else None
            return original(query, key, value, *args, **kwargs) if routed is None else routed

        F.scaled_dot_product_attention = scaled_dot_product_attention
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._original
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args, kwargs = real_devices(func, args, kwargs, self.device)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if any(t.is_meta for t in leaves) and not all(t.is_meta for t in leaves):
            args, kwargs = tree_map(self._to_meta, (args, kwargs))
        if func is self._original:
            routed = _fused_attention(*args, **kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)


def _to_meta(value: Any) -> Any:
    return value.detach().to("meta") if isinstance(value, Tensor) and not value.is_meta else value


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The CPU flash kernel where a CPU would choose it (see the module docstring), else None."""
    fused = (
        dropout_p == 0.0
        and not enable_gqa
        and query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and query.shape[-1] == key.shape[-1] == value.shape[-1]
        and query.is_floating_point()
    )
    if not fused:
        return None
    return _FLASH_CPU(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


_FLASH_CPU, _FLASH_CPU_BACKWARD = flash_attention_cpu_ops()


def _op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    packet = func.overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    if packet is _FLASH_CPU:  # not in torch's registry
        return float(sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape))
    if packet is _FLASH_CPU_BACKWARD:
        return float(sdpa_backward_flop_count(args[0].shape, args[1].shape, args[2].shape, args[3].shape))
    return 0.0


class _WorkCounter(TorchDispatchMode):
    """Per unit and direction: FLOPs, bytes moved, ops, assumed seconds."""

    def __init__(self, tracker: UnitTracker, speed: DeviceSpeed) -> None:
        super().__init__()
        self.tracker = tracker
        self.speed = speed
        self.backward = False
        self.flops: dict[tuple[bool, int], float] = defaultdict(float)
        self.seconds: dict[tuple[bool, int], float] = defaultdict(float)
        self.ops: dict[tuple[bool, int], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = _op_flops(func, args, kwargs, out)
        nbytes = (
            0
            if func.is_view
            else sum(nbytes_of(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, Tensor))
        )
        key = (self.backward, self.tracker.backward_unit if self.backward else self.tracker.forward_unit)
        self.flops[key] += flops
        self.seconds[key] += self.speed.seconds(flops, nbytes)
        self.ops[key] += 1
        return out


@contextlib.contextmanager
def _silent_log(root: nn.Module):
    """``self.log`` does nothing while probing (the instance attribute shadows the method)."""
    if not hasattr(root, "log"):
        yield
        return
    root.log = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del root.log


def count_units(
    root: nn.Module,
    stack: BlockStack,
    step_name: str,
    step_args: tuple,
    shapes: Sequence[tuple[int, int]],
    speed: DeviceSpeed | None = None,
) -> list[UnitCount]:
    """Run the user's step on the meta device for every probe shape and count each unit's work.

    Args:
        root: the user's module (its parameters are swapped for meta tensors during the probe and
            put back; nothing else changes).
        stack: its block stack.
        step_name: ``"training_step"``.
        step_args: an example of the step's arguments (microbatch first; only its structure and
            dtypes are used).
        shapes: ``(num_sequences, length)`` of every probe microbatch.
        speed: the assumed device (default: :meth:`DeviceSpeed.for_device` of the first parameter).

    Returns:
        One :class:`UnitCount` per unit and shape.

    Raises:
        MetaProbeError: if the step cannot run on meta tensors (data-dependent Python control flow,
            ``.item()``); the message says to profile with real tensors instead.
    """
    if speed is None:
        device = next((p.device for p in root.parameters() if not p.is_meta), torch.device("cpu"))
        speed = DeviceSpeed.for_device(device)
    num_blocks = stack.num_blocks
    counts = []
    for num_sequences, length in shapes:
        tracker = UnitTracker(stack.blocks)
        work = _WorkCounter(tracker, speed)
        microbatch = resize_microbatch(step_args[0], num_sequences, length, device=torch.device("cpu"))
        batch_tensors = [t for t in tree_flatten(microbatch)[0] if isinstance(t, Tensor)]
        functions = _MetaFunctions(torch.device("cpu"), batch_tensors)
        with metrics_untouched(root), _on_meta(root) as params, _silent_log(root), tracker, torch.enable_grad(), \
                meta_autocast_disabled():
            saved = SavedBytes(tracker, params + batch_tensors + list(functions.meta_of.values()))
            try:
                with functions, work, saved.hooks():
                    output = getattr(root, step_name)(microbatch, *step_args[1:])
                    loss = step_loss(output)
                    trainable = [p for p in params if p.requires_grad]
                    if loss is not None and loss.requires_grad and trainable:
                        work.backward = True
                        torch.autograd.grad(loss, trainable, allow_unused=True)
            except Exception as error:
                raise MetaProbeError(
                    f"The meta-device cost probe could not run `{type(root).__name__}.{step_name}` on meta tensors "
                    f"({type(error).__name__}: {error}). Steps that read tensor values (`.item()`, data-dependent "
                    "branches) need measured costs: add the `PipelineProfiler` callback or pass `cost_model=` a profile."
                ) from error
        positions = tracker.positions or length
        for unit in range(num_blocks + 2):
            counts.append(
                UnitCount(
                    unit=unit,
                    num_sequences=num_sequences,
                    length=length,
                    positions=positions,
                    forward_flops=work.flops[(False, unit)],
                    backward_flops=work.flops[(True, unit)],
                    forward_seconds=work.seconds[(False, unit)],
                    backward_seconds=work.seconds[(True, unit)],
                    num_forward_ops=work.ops[(False, unit)],
                    saved_bytes=saved.saved[unit],
                    output_bytes=0 if unit == num_blocks + 1 else tracker.outputs.get(unit, 0),
                )
            )
    return counts


# --- fitting -------------------------------------------------------------------------------------


def length_offset(lengths_and_positions: Sequence[tuple[int, int]]) -> int:
    """Median of ``length - positions`` over probes (0 when unknown or negative)."""
    offsets = sorted(length - positions for length, positions in lengths_and_positions if positions > 0)
    offset = offsets[len(offsets) // 2] if offsets else 0
    return max(offset, 0)


def _fit(shapes: Sequence[MicrobatchShape], values: Sequence[float]) -> LinearCost:
    """Non-negative linear fit (relative residuals when all values are positive)."""
    measured = np.asarray(values, dtype=float)
    if (measured == 0).all():
        return LinearCost()
    if (measured > 0).all() and len(measured) >= 3:
        return fit_linear_cost(shapes, measured, holdout_fraction=0.0).cost
    features = np.array([[1.0, s.tokens, s.sum_squared_lengths] for s in shapes], dtype=float)
    scale = np.abs(features).max(axis=0)
    scale[scale == 0] = 1.0
    solution, _ = nnls(features / scale, measured)
    return LinearCost(*(float(c) for c in solution / scale))


def _parameter_bytes(module: nn.Module, layout: UnitLayout) -> list[tuple[float, float]]:
    """Per unit: (parameter bytes, bytes of parameters that train)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    out = []
    for names in layout.unit_names:
        owned = [params[n] for n in names if n in params]
        out.append(
            (float(sum(nbytes_of(p) for p in owned)), float(sum(nbytes_of(p) for p in owned if p.requires_grad)))
        )
    return out


def fit_cost_model(
    counts: Sequence[UnitCount],
    module: nn.Module,
    layout: UnitLayout,
    optimizer_states_per_parameter: float = 2.0,
    latency: float = 0.0,
    bandwidth: float = math.inf,
) -> CostEstimate:
    """Fit a :class:`~lightning_pipe.planning.CostModel` to meta counts.

    Seconds and saved bytes are fitted per unit, linear in the tokens and squared lengths the blocks
    see (the batch's lengths minus the detected ``length_offset``); parameter and gradient bytes
    come from the module (meta parameters included), optimizer bytes are
    ``optimizer_states_per_parameter`` times the trained parameters' bytes (2 for Adam/AdamW, 1 for
    SGD with momentum, 0 for plain SGD).

    Args:
        counts: from :func:`count_units`, every unit on at least three shapes.
        module: the user's module.
        layout: its units.
        optimizer_states_per_parameter: optimizer state tensors per trained parameter.
        latency: seconds per point-to-point message of the model.
        bandwidth: bytes per second of a link between stages.
    """
    offset = length_offset([(c.length, c.positions) for c in counts])
    by_unit: dict[int, list[UnitCount]] = defaultdict(list)
    for count in counts:
        by_unit[count.unit].append(count)
    static = _parameter_bytes(module, layout)
    units = []
    for unit in range(layout.num_units):
        rows = by_unit.get(unit)
        if not rows:
            raise ValueError(f"No probe counts for unit {unit} ({unit_name(unit, layout.num_units)}).")
        shapes = [MicrobatchShape.from_lengths([max(1, r.length - offset)] * r.num_sequences) for r in rows]
        per_token = max(r.output_bytes / max(1, s.tokens) for r, s in zip(rows, shapes))
        parameter_bytes, trained_bytes = static[unit]
        units.append(
            UnitCost(
                name=unit_name(unit, layout.num_units),
                forward=_fit(shapes, [r.forward_seconds for r in rows]),
                backward=_fit(shapes, [r.backward_seconds for r in rows]),
                saved_bytes=_fit(shapes, [float(r.saved_bytes) for r in rows]),
                output_bytes_per_token=float(per_token),
                parameter_bytes=parameter_bytes,
                gradient_bytes=trained_bytes,
                optimizer_bytes=trained_bytes * optimizer_states_per_parameter,
            )
        )
    return CostEstimate(CostModel(tuple(units), latency=latency, bandwidth=bandwidth), offset, "meta")
