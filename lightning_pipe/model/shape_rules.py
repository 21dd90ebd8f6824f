"""Output shapes of a block at a new input length, without running it.

A stage runs the blocks before its own as meta-device twins to learn the shapes of their outputs
(``model/stage_runner.py``). Memoised per input signature, that costs a probe per block for every
new length, and with each microbatch at its own length nearly every microbatch is new. But a
transformer block's output sizes are copies of its input sizes (batch, length, width): after two
probes at different lengths, :class:`ShapeRules` knows, for each output size, which input sizes it
can be a copy of (or that it is a constant), and predicts the next length's shapes when every
explanation consistent with all probes so far gives the same number. When they disagree, or the
call's structure (tree, ranks, dtypes, plain values) is new, the block is probed as before, and
the probe is one more observation.

A prediction is a shape, never a value: outputs of blocks a stage does not run are placeholders
(a placeholder reaching real compute is refused), and the tensors a stage receives are allocated
from the sizes the sender puts in the message header (``runtime/p2p.py``, ``describe``), so a
wrong prediction cannot change a result; the executor forgets a block's rules when a received size
contradicts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model._torch_compat import tree_flatten

_PLAIN = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)
_MAX_OBSERVATIONS = 6


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (what a block's output leaf is, for placeholders)."""

    shape: torch.Size
    dtype: torch.dtype


BlockOutput = tuple[list[Any], Any]
"""A block call's output as leaves (a :class:`TensorSpec` per tensor, plain values as they are) and
its tree spec."""


def call_structure(value: Any) -> tuple[Any, tuple[int, ...]]:
    """What a call's arguments are apart from their sizes (tree, and per leaf its rank and dtype or
    its plain value), and all their sizes in order."""
    leaves, spec = tree_flatten(value)
    described, sizes = [], []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            described.append(("T", leaf.dim(), leaf.dtype, leaf.requires_grad))
            sizes += list(leaf.shape)
        elif isinstance(leaf, _PLAIN):
            described.append(leaf)
        else:
            described.append(("O", type(leaf).__qualname__))
    return (str(spec), tuple(described)), tuple(sizes)


class ShapeRules:
    """Learns, per block and call structure, each output size as a copy of an input size or a
    constant, from probes; predicts the output at new sizes when that is unambiguous."""

    def __init__(self) -> None:
        self._observations: dict[tuple[int, Any], list[tuple[tuple[int, ...], BlockOutput]]] = {}

    def observe(self, block: int, arguments: Any, output: BlockOutput) -> None:
        """Record a probe of ``block`` on ``arguments`` (args and kwargs) that gave ``output``."""
        structure, sizes = call_structure(arguments)
        seen = self._observations.setdefault((block, structure), [])
        if all(s != sizes for s, _ in seen):
            seen.append((sizes, output))
            del seen[:-_MAX_OBSERVATIONS]

    def forget(self, block: int) -> None:
        """Drop everything learned about ``block`` (a prediction was contradicted)."""
        for key in [k for k in self._observations if k[0] == block]:
            del self._observations[key]

    def predict(self, block: int, arguments: Any) -> BlockOutput | None:
        """``block``'s output at ``arguments``' sizes, or None when the probes so far do not settle it."""
        structure, sizes = call_structure(arguments)
        seen = self._observations.get((block, structure), [])
        if len(seen) < 2:
            return None
        (_, (first_leaves, spec)) = seen[0]
        if any(str(s) != str(spec) or not _same_kind(first_leaves, leaves) for _, (leaves, s) in seen[1:]):
            return None
        predicted = []
        for position, leaf in enumerate(first_leaves):
            if not isinstance(leaf, TensorSpec):
                predicted.append(leaf)
                continue
            shape = []
            for dim in range(len(leaf.shape)):
                outputs = [leaves[position].shape[dim] for _, (leaves, _) in seen]
                value = _settled(outputs, [s for s, _ in seen], sizes)
                if value is None:
                    return None
                shape.append(value)
            predicted.append(TensorSpec(torch.Size(shape), leaf.dtype))
        return predicted, spec


def _same_kind(first: list[Any], other: list[Any]) -> bool:
    """The same leaves: tensors of the same rank and dtype where ``first`` has them, equal values elsewhere."""
    if len(first) != len(other):
        return False
    for a, b in zip(first, other):
        if isinstance(a, TensorSpec) != isinstance(b, TensorSpec):
            return False
        if isinstance(a, TensorSpec) and (len(a.shape) != len(b.shape) or a.dtype != b.dtype):
            return False
        if not isinstance(a, TensorSpec) and a != b:
            return False
    return True


def _settled(outputs: list[int], observed_sizes: list[tuple[int, ...]], sizes: tuple[int, ...]) -> int | None:
    """The one value every explanation of ``outputs`` (a copy of input size ``j`` in every probe, or
    a constant) gives at ``sizes``; None if they disagree or none explains them."""
    values = {sizes[j] for j in range(len(sizes)) if all(o[j] == out for o, out in zip(observed_sizes, outputs))}
    if len(set(outputs)) == 1:
        values.add(outputs[0])
    return values.pop() if len(values) == 1 else None
