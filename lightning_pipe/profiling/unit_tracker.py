"""Which unit of an unchanged module is running, in forward and in backward; probe microbatches.

:class:`UnitTracker` is the mechanism the cost probe (meta device) and the unit timer (real device)
share: forward pre-hooks and forward hooks on the blocks give the unit running in forward, gradient
hooks on the blocks' inputs and outputs give the unit backward has reached. Nothing is asked of
the user's module and the hooks are removed on exit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Self

from lightning_pipe.profiling.probing import token_tensor
from lightning_pipe.runtime._torch_compat import tree_flatten, tree_map

__all__ = ["SavedBytes", "UnitTracker", "nbytes_of", "resize_microbatch", "step_loss", "unit_name"]


class UnitTracker:
    """Tracks the unit running in forward and in backward, from hooks on the blocks.

    Forward: ``pre`` until block 0 starts, block ``i`` from its start until the next block starts
    (code between blocks counts for the block before), ``post`` after the last block returns.
    Backward: starts in ``start_unit`` (``post``, or the last block of a stage that is not last);
    when the gradient of block ``i``'s output is complete, block ``i``'s backward begins; when the
    gradient of block ``i``'s inputs is complete, the unit before it begins (``pre`` for block 0).

    Args:
        blocks: the block stack's blocks.
        on_switch: called as ``on_switch(direction, unit)`` (``"forward"``/``"backward"``) at
            every change, after the tracker's state changed.
    """

    def __init__(self, blocks: Sequence[nn.Module], on_switch: Callable[[str, int], None] | None = None) -> None:
        self.blocks = list(blocks)
        self.num_blocks = len(self.blocks)
        self.on_switch = on_switch
        self.forward_unit = 0
        self.backward_unit = self.num_blocks + 1
        self.positions = 0  # dimension -2 of the first tensor block 0 received
        self.outputs: dict[int, int] = {}  # unit -> bytes of its output tensors (last call)
        self._handles: list[Any] = []

    def _switch(self, direction: str, unit: int) -> None:
        if direction == "forward":
            self.forward_unit = unit
        else:
            self.backward_unit = unit
        if self.on_switch is not None:
            self.on_switch(direction, unit)

    def _grad_hook(self, unit: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            self._switch("backward", unit)

        return hook

    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            if index == 0:
                self.outputs[0] = sum(nbytes_of(t) for t in tensors if t.is_floating_point())
                hidden = [t for t in tensors if t.is_floating_point() and t.dim() >= 2]
                self.positions = int(hidden[0].shape[-2]) if hidden else 0
            if torch.is_grad_enabled():
                for tensor in tensors:
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(index))  # unit of the block before (pre: 0)
            self._switch("forward", index + 1)

        return hook

    def _post_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
            self.outputs[index + 1] = sum(nbytes_of(t) for t in tensors)
            if torch.is_grad_enabled():
                for tensor in tensors:
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(index + 1))
            if index == self.num_blocks - 1:
                self._switch("forward", self.num_blocks + 1)

        return hook

    def __enter__(self) -> Self:
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._post_hook(index), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class SavedBytes:
    """Bytes autograd keeps for backward, per forward unit: saved-tensor hooks over a :class:`UnitTracker`.

    Each storage counts once; ``excluded`` tensors (parameters, the batch, received inputs) and
    whatever :meth:`exclude` adds later do not count, since they live anyway.
    """

    def __init__(self, tracker: UnitTracker, excluded: Sequence[Tensor] = ()) -> None:
        self.tracker = tracker
        self._keep: list[Any] = []  # storages stay alive, so their ids stay unique
        self._seen: set[int] = set()
        self.saved: dict[int, int] = defaultdict(int)
        self.exclude(excluded)

    def exclude(self, tensors: Sequence[Tensor]) -> None:
        """Never count ``tensors``' storages."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._keep.append(storage)
            self._seen.add(id(storage))

    def pack(self, tensor: Tensor) -> Tensor:
        """The saved-tensor hook's pack: count the storage once, keep the tensor as is."""
        storage = tensor.untyped_storage()
        if id(storage) not in self._seen:
            self._seen.add(id(storage))
            self._keep.append(storage)
            self.saved[self.tracker.forward_unit] += storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: Tensor) -> Tensor:
        """The saved-tensor hook's unpack (identity)."""
        return tensor

    def hooks(self) -> Any:
        """The context manager that installs :meth:`pack`/:meth:`unpack`."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def nbytes_of(tensor: Tensor) -> int:
    """Bytes of a tensor's elements (not of its whole storage)."""
    return tensor.numel() * tensor.element_size()


def resize_microbatch(
    microbatch: Any, num_sequences: int, length: int, device: torch.device | str | None = None
) -> Any:
    """A microbatch of ``num_sequences`` samples of ``length`` positions, shaped like ``microbatch``.

    The token tensor (``sequence_lengths``'s: the first integer ``[B, T, ...]`` tensor) sets ``B``
    and ``T``; every tensor whose first dimension is ``B`` gets ``num_sequences`` rows, and whose
    first two dimensions are ``(B, T)`` also ``length`` positions. On the meta device the result
    holds no values; on a real device samples and positions are repeated cyclically (token ids stay
    valid ids). Other leaves are kept.

    Args:
        microbatch: an example microbatch.
        num_sequences: samples in the result.
        length: positions per sample of the result.
        device: ``"meta"`` for a shape-only microbatch; None keeps each tensor's device.
    """
    tokens = token_tensor(microbatch)
    batch, positions = int(tokens.shape[0]), int(tokens.shape[1])

    def resize(leaf: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return leaf
        shape = list(leaf.shape)
        rows = leaf.dim() >= 1 and shape[0] == batch
        cols = rows and leaf.dim() >= 2 and shape[1] == positions
        if rows:
            shape[0] = num_sequences
        if cols:
            shape[1] = length
        if device is not None and torch.device(device).type == "meta":
            return torch.empty(shape, dtype=leaf.dtype, device="meta")
        out = leaf
        if rows:
            out = out.index_select(0, torch.arange(num_sequences, device=leaf.device) % batch)
        if cols:
            out = out.index_select(1, torch.arange(length, device=leaf.device) % positions)
        return out if device is None else out.to(device)

    return tree_map(resize, microbatch)


def step_loss(output: Any) -> Tensor | None:
    """The loss in what a training step returned (a tensor or ``{"loss": tensor}``), else None."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return None


def unit_name(unit: int, num_units: int) -> str:
    """``"pre"``, ``"block.<i>"`` or ``"post"``."""
    return "pre" if unit == 0 else "post" if unit == num_units - 1 else f"block.{unit - 1}"
