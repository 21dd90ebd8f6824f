"""The microbatch plan: how one batch is cut into microbatches, decided once per step.

:func:`plan_microbatches` looks at a batch once and returns a :class:`MicrobatchPlan`, plain data
that every rank computes identically from the same batch: which samples form each microbatch, each
microbatch's share of the batch's loss, the length each runs at, and where each item of the batch
is cut. :meth:`MicrobatchPlan.split` cuts the batch by that plan. The step, the memory planner, the
cost probes and the profilers all read one plan (``ElasticPipelineStrategy.split_batch``); none
cuts the batch its own way.

The split is checked, not assumed:

* every tensor is cut along its batch dimension (``batch_dim``: dimension 0 unless told otherwise,
  per item or by a hook), and all of them must agree on the batch size, or the batch is refused
  with every item's shape;
* lists of per-sample values (strings, numbers) of the batch's length are cut with the tensors;
  other non-tensor values (a scalar, a list of another length) are given whole to every microbatch;
* objects that hold tensors but are neither tensors, mappings, sequences nor dataclasses are
  refused: they cannot be cut unambiguously.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

from lightning_pipe.runtime._torch_compat import tensor_version
from lightning_pipe.runtime.padding import Padding, find_padding

BatchDim = Union[int, Mapping[Any, Union[int, None]], Callable[[tuple, Any], Union[int, None]]]
"""Where a batch's tensors keep their samples: one dimension for all, a mapping from an item's key
(top-level key or index, or its whole path as a tuple) to its dimension, or a hook
``batch_dim(path, value) -> int | None``. ``None`` gives that item whole to every microbatch."""

WHOLE = "whole"
TENSOR = "tensor"
SEQUENCE = "sequence"
_SCALARS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class BatchItem:
    """One leaf of a batch and how it is cut.

    Attributes:
        path: keys from the batch to the leaf (``(0,)``, ``("input_ids",)``, ``("meta", "ids")``).
        kind: ``"tensor"`` (cut along ``dim``), ``"sequence"`` (a per-sample list, cut like the
            samples), or ``"whole"`` (given whole to every microbatch).
        dim: the batch dimension of a tensor item.
    """

    path: tuple
    kind: str
    dim: int = 0


@dataclass(frozen=True)
class MicrobatchPlan:
    """How one batch is cut into microbatches (plain data, identical on every rank).

    Attributes:
        batch_size: samples in the batch.
        sample_ranges: ``(start, end)`` of each microbatch's samples, in order.
        weights: each microbatch's share of the batch's loss, summing to 1: its share of samples
            (the loss weighting of the step may replace it, see ``runtime/loss_weights.py``).
        windows: per microbatch, the ``(start, end)`` positions its padded tensors keep along
            dimension 1 (each microbatch at its own length, ``runtime/padding.py``); None: all.
        items: how every leaf of the batch is cut.
        order: the batch's samples in the order they are cut into ``sample_ranges`` (grouped by
            length); None: as the batch gives them.
        padding: where the batch's real tokens are, when the plan cuts padding.
    """

    batch_size: int
    sample_ranges: tuple[tuple[int, int], ...]
    weights: tuple[float, ...]
    windows: tuple[tuple[int, int] | None, ...]
    items: tuple[BatchItem, ...]
    order: tuple[int, ...] | None = None
    padding: Padding | None = None

    @property
    def num_microbatches(self) -> int:
        """Microbatches in this plan (fewer than asked for when the batch has fewer samples)."""
        return len(self.sample_ranges)

    @property
    def sizes(self) -> list[int]:
        """Samples of each microbatch."""
        return [end - start for start, end in self.sample_ranges]

    @property
    def lengths(self) -> list[int | None]:
        """The length each microbatch runs at (None: the batch's own)."""
        return [None if w is None else w[1] - w[0] for w in self.windows]

    def samples(self, microbatch: int) -> list[int]:
        """Indices in the batch of the samples of ``microbatch``."""
        start, end = self.sample_ranges[microbatch]
        return list(self.order[start:end]) if self.order is not None else list(range(start, end))

    def split(self, batch: Any) -> list[Any]:
        """Cut ``batch`` (the batch this plan was made for) into its microbatches."""
        cut = {item.path: item for item in self.items}
        if self.order is not None:
            batch = _rebuild(batch, (), cut, _Reorder(self.order))
        trimmed = {item.path for item in self.items if self.padding is not None and item.path in self.padding.items}
        return [
            _rebuild(batch, (), cut, _Cut(start, end, window, trimmed))
            for (start, end), window in zip(self.sample_ranges, self.windows, strict=True)
        ]

    def untrimmed(self) -> MicrobatchPlan:
        """The same samples per microbatch at the batch's full length."""
        return dataclasses.replace(self, windows=(None,) * len(self.windows))


def plan_microbatches(
    batch: Any,
    num_microbatches: int,
    batch_dim: BatchDim = 0,
    microbatch_sizes: Sequence[int] | None = None,
    trim_padding: bool = False,
    group_by_length: bool = False,
    grouped_sizes: Callable[[list[int]], Sequence[int]] | None = None,
) -> MicrobatchPlan:
    """Plan the microbatches of ``batch``: ``num_microbatches`` of them, or one per sample if fewer.

    Samples go to microbatches in order; the first ``B % num_microbatches`` take one more
    (``torch.tensor_split``'s rule), unless ``microbatch_sizes`` says how many each takes (uneven microbatches
    sized by work, ``planning.microbatching``). Each microbatch's weight is its share of samples
    either way, so the batch's loss is the same.

    Args:
        batch: what the dataloader yields (tensors in tuples, lists, mappings, dataclasses).
        num_microbatches: microbatches wanted.
        batch_dim: where the tensors keep their samples (see :data:`BatchDim`).
        microbatch_sizes: samples of each microbatch, in order (``num_microbatches`` positive integers summing
            to the batch size); None: even.
        trim_padding: cut each microbatch's padded tensors to its own real tokens (a batch with an
            ``attention_mask`` or ``labels``, batch dimension 0; ``runtime/padding.py``).
        group_by_length: with ``trim_padding``, first order the samples by their real length
            (longest first), so that each microbatch holds sequences of similar length. Not with
            ``microbatch_sizes``: sizes are planned for the batch's own order.
        grouped_sizes: with ``group_by_length``, the rule that sizes the microbatches of the ordered
            samples, given their real lengths longest first (a planner's, for example
            ``planning.microbatching.padded_microbatch_sizes``); None: even counts.

    Raises:
        ValueError: the tensors disagree on the batch size, an item has no such dimension, no
            tensor has a batch dimension, an object holding tensors cannot be cut, or ``microbatch_sizes`` do
            not fit the batch.
    """
    if num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be at least 1, got {num_microbatches}.")
    leaves = list(_leaves(batch, ()))
    items, sizes = [], {}
    for path, value in leaves:
        if isinstance(value, Tensor):
            dim = _batch_dim_of(batch_dim, path, value)
            if dim is None or (value.dim() == 0 and not _explicit(batch_dim, path)):
                items.append(BatchItem(path, WHOLE))
                continue
            if not -value.dim() <= dim < value.dim():
                raise ValueError(
                    f"{describe_path(path)} has shape {tuple(value.shape)}, without a batch dimension {dim}: give its "
                    "dimension in `batch_dim` (a mapping per item, or a hook returning None to give it whole)."
                )
            dim = dim % value.dim()
            items.append(BatchItem(path, TENSOR, dim))
            sizes[path] = (value.shape[dim], tuple(value.shape), dim)
        elif _holds_tensors(value):
            raise ValueError(
                f"{describe_path(path)} is a {type(value).__name__} holding tensors, which lightning-pipe cannot cut into "
                "microbatches unambiguously: return tensors, or tuples/lists/dicts/dataclasses of them, from the "
                "dataloader (or `transfer_batch_to_device`)."
            )
        else:
            items.append(BatchItem(path, WHOLE))
    if not sizes:
        raise ValueError(
            f"Cannot split a batch of type {type(batch).__name__} into microbatches: it holds no tensor with a batch "
            "dimension. Return tensors (or lists/tuples/dicts of them) from the dataloader."
        )
    batch_size = _agreed_size(sizes, batch_dim)
    for index, item in enumerate(items):
        value = dict(leaves)[item.path] if item.kind == WHOLE else None
        if item.kind == WHOLE and _is_sequence_leaf(value) and len(value) == batch_size:
            items[index] = BatchItem(item.path, SEQUENCE)
    ranges = (
        sample_ranges(batch_size, num_microbatches)
        if microbatch_sizes is None
        else sized_ranges(batch_size, num_microbatches, microbatch_sizes)
    )
    weights = tuple((end - start) / batch_size for start, end in ranges)
    plan = MicrobatchPlan(batch_size, ranges, weights, (None,) * len(ranges), tuple(items))
    if trim_padding and batch_dim == 0:
        grouping = group_by_length and microbatch_sizes is None
        plan = _trimmed(plan, dict(leaves), grouping, grouped_sizes if grouping else None)
    return plan


def _trimmed(
    plan: MicrobatchPlan, leaves: dict[tuple, Any], group_by_length: bool,
    grouped_sizes: Callable[[list[int]], Sequence[int]] | None,
) -> MicrobatchPlan:
    """``plan`` with each microbatch cut to its real tokens (unchanged if the batch shows no padding)."""
    padding = find_padding(leaves, [item.path for item in plan.items if item.kind == TENSOR and item.dim == 0])
    if padding is None or not padding.items:
        return plan
    order = None
    if group_by_length and plan.num_microbatches > 1:
        lengths = padding.content_lengths()
        ranked = tuple(sorted(range(plan.batch_size), key=lambda i: -lengths[i]))  # stable: ties keep their order
        order = ranked if ranked != tuple(range(plan.batch_size)) else None
        if grouped_sizes is not None:
            sizes = grouped_sizes([int(lengths[i]) for i in ranked])
            ranges = sized_ranges(plan.batch_size, plan.num_microbatches, sizes)
            weights = tuple((end - start) / plan.batch_size for start, end in ranges)
            plan = dataclasses.replace(plan, sample_ranges=ranges, weights=weights)
    plan = dataclasses.replace(plan, order=order, padding=padding)
    windows = tuple(padding.window(plan.samples(mb)) for mb in range(plan.num_microbatches))
    if all(w is None for w in windows) and order is None:
        return dataclasses.replace(plan, padding=None)
    return dataclasses.replace(plan, windows=windows)


def sample_ranges(batch_size: int, num_microbatches: int) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each microbatch's samples: ``min(num_microbatches, batch_size)`` of them,
    in order, the first ``batch_size % count`` one sample larger (``torch.tensor_split``'s rule)."""
    count = min(num_microbatches, batch_size)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + batch_size // count + (1 if i < batch_size % count else 0))
    return tuple((bounds[i], bounds[i + 1]) for i in range(count))


def sized_ranges(batch_size: int, num_microbatches: int, sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of microbatches of the given ``sizes`` (samples each, in order).

    Raises:
        ValueError: if there are not ``num_microbatches`` sizes, one is below 1, or they do not sum
            to ``batch_size``.
    """
    values = [int(n) for n in sizes]
    if len(values) != num_microbatches or any(n < 1 for n in values) or sum(values) != batch_size:
        raise ValueError(
            f"Microbatch sizes {values} do not fit a batch of {batch_size} samples in {num_microbatches} microbatches: "
            f"give {num_microbatches} sizes >= 1 summing to {batch_size} (a plan's `microbatch_sizes` describe one batch)."
        )
    bounds = [0]
    for n in values:
        bounds.append(bounds[-1] + n)
    return tuple((bounds[i], bounds[i + 1]) for i in range(len(values)))


def batch_size_of(batch: Any, batch_dim: BatchDim = 0) -> int:
    """Samples in ``batch`` (checked as :func:`plan_microbatches` checks them)."""
    return plan_microbatches(batch, 1, batch_dim).batch_size


def split_batch(batch: Any, num_microbatches: int, batch_dim: BatchDim = 0) -> list[Any]:
    """Plan and cut in one call (for tools outside a training step; the step reuses its plan)."""
    return plan_microbatches(batch, num_microbatches, batch_dim).split(batch)


def batch_contents(value: Any) -> tuple:
    """What a batch's split depends on, comparable with ``==``: its containers' types and keys, the
    identity and in-place version of its tensors, the identity of other objects, the values of its
    plain leaves. A batch moved to the device it is already on is a new container of the same
    tensors: the same contents (so a split made when a planner looked at the next batch serves the
    step); a tensor changed in place since (a hook masking tokens) is not. Equal contents mean the
    same batch only while the objects are alive: keep the batch with what is remembered for it."""
    if isinstance(value, Tensor):
        return ("T", id(value), tensor_version(value))
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, Mapping):
        return (type(value), tuple((key, batch_contents(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(batch_contents(item) for item in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), tuple((f.name, batch_contents(getattr(value, f.name))) for f in dataclasses.fields(value)))
    return ("O", id(value))


def tensor_shapes(value: Any) -> list[tuple[int, ...]]:
    """Shapes of the tensors in ``value`` (a batch or a microbatch), in the batch's walking order."""
    return [tuple(leaf.shape) for _, leaf in _leaves(value, ()) if isinstance(leaf, Tensor)]


def describe_path(path: tuple) -> str:
    """``batch[0]``, ``batch['input_ids']``, ``batch.field``: how messages name an item."""
    text = "batch"
    for key in path:
        text += f".{key[1:]}" if isinstance(key, str) and key.startswith(".") else f"[{key!r}]"
    return text


# --- walking a batch ---------------------------------------------------------------------------


def _is_sequence_leaf(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(v, _SCALARS) for v in value)


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _leaves(value: Any, path: tuple):
    """``(path, leaf)`` pairs: tensors, per-sample lists of plain values, and everything else."""
    if isinstance(value, Tensor) or isinstance(value, _SCALARS) or _is_sequence_leaf(value):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _leaves(item, path + (index,))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), path + ("." + f.name,))
    else:
        yield path, value


def _holds_tensors(value: Any) -> bool:
    attributes = getattr(value, "__dict__", None)
    return isinstance(attributes, dict) and any(isinstance(v, Tensor) for v in attributes.values())


@dataclass(frozen=True)
class _Cut:
    """One microbatch: samples ``start:end`` and, for the padded tensors, positions ``window``."""

    start: int
    end: int
    window: tuple[int, int] | None
    trimmed: set

    def tensor(self, path: tuple, value: Tensor, dim: int) -> Tensor:
        value = value.narrow(dim, self.start, self.end - self.start)
        if self.window is not None and path in self.trimmed:
            value = value.narrow(1, self.window[0], self.window[1] - self.window[0])
        return value

    def sequence(self, value: Any) -> Any:
        return value[self.start:self.end]


@dataclass(frozen=True)
class _Reorder:
    """The whole batch with its samples in ``order``."""

    order: tuple[int, ...]

    def tensor(self, path: tuple, value: Tensor, dim: int) -> Tensor:
        return value.index_select(dim, torch.tensor(self.order, device=value.device))

    def sequence(self, value: Any) -> Any:
        return type(value)(value[i] for i in self.order)


def _rebuild(value: Any, path: tuple, cut: dict[tuple, BatchItem], how: _Cut | _Reorder) -> Any:
    item = cut.get(path)
    if item is not None:
        if item.kind == TENSOR:
            return how.tensor(path, value, item.dim)
        if item.kind == SEQUENCE:
            return how.sequence(value)
        return value
    if isinstance(value, Mapping):
        parts = {key: _rebuild(v, path + (key,), cut, how) for key, v in value.items()}
        try:
            return type(value)(parts)
        except TypeError:  # a mapping type without a dict constructor
            return parts
    if _is_namedtuple(value):
        return type(value)(*(_rebuild(v, path + (i,), cut, how) for i, v in enumerate(value)))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, path + (i,), cut, how) for i, v in enumerate(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _rebuild(getattr(value, f.name), path + ("." + f.name,), cut, how)
            for f in dataclasses.fields(value) if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


# --- batch dimensions --------------------------------------------------------------------------


def _explicit(batch_dim: BatchDim, path: tuple) -> bool:
    if isinstance(batch_dim, Mapping):
        return path in batch_dim or (len(path) > 0 and path[0] in batch_dim)
    return callable(batch_dim)


def _batch_dim_of(batch_dim: BatchDim, path: tuple, value: Tensor) -> int | None:
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, (int, Mapping)) and not callable(batch_dim):
        raise TypeError(f"`batch_dim` must be an int, a mapping or a callable, got {type(batch_dim).__name__}.")
    if isinstance(batch_dim, int):
        return batch_dim
    if isinstance(batch_dim, Mapping):
        if path in batch_dim:
            return batch_dim[path]
        if path and path[0] in batch_dim:
            return batch_dim[path[0]]
        return 0
    return batch_dim(path, value)


def _agreed_size(sizes: dict[tuple, tuple[int, tuple, int]], batch_dim: BatchDim) -> int:
    distinct = {size for size, _, _ in sizes.values()}
    if len(distinct) == 1:
        return distinct.pop()
    listing = ", ".join(
        f"{describe_path(path)} {shape} -> {size} (dim {dim})" for path, (size, shape, dim) in sizes.items()
    )
    setting = f"`batch_dim={batch_dim!r}`" if not callable(batch_dim) else "the `batch_dim` hook"
    raise ValueError(
        f"The batch's tensors disagree on the batch size along {setting}: {listing}. Every tensor must hold the "
        "same samples along its batch dimension (inputs and targets of one batch must have the same number of "
        "samples). For time-major tensors ((T, B, ...), as `nn.TransformerEncoder` with `batch_first=False` "
        "takes them) give each item's dimension, e.g. `batch_dim={0: 1, 1: 0}`, or a hook "
        "`batch_dim=lambda path, tensor: ...` (None gives an item whole to every microbatch)."
    )


@dataclass
class SplitBatch:
    """A batch's microbatch plan and the microbatches cut by it (what one step runs).

    Attributes:
        plan: the plan (plain data).
        microbatches: the batch cut by the plan, in order.
    """

    plan: MicrobatchPlan
    microbatches: list[Any]
