"""Padding: where a padded batch keeps its real tokens, so each microbatch runs at its own length.

A collator pads every sequence of a batch to the batch's longest. Cut along the batch dimension
only, a microbatch of short sequences would still run at that length. :func:`find_padding` reads
where the real tokens are, from the batch's own markers, as transformers' collators write them:

* ``attention_mask`` (``[B, T]``, 1 for real tokens, 0 for padding, on either side): each sample's
  real tokens run from its first 1 to its last 1;
* else ``labels`` (``[B, T]`` integers, ``-100`` where no loss is counted): a sample ends after its
  last counted label. Only trailing positions are cut: leading ``-100`` labels may be real inputs
  (an instruction's prompt) that a causal model still reads.

Every tensor of the batch with the padded length in dimension 1 (``input_ids``, ``labels``,
``position_ids``, the mask itself) is cut to the same window. Whether the model's result is the same
for a cut microbatch is not assumed here: the strategy checks it (``strategies/padding_check.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

IGNORE_INDEX = -100
MASK_KEY = "attention_mask"
LABELS_KEY = "labels"


@dataclass(frozen=True)
class Padding:
    """Where the real tokens of one padded batch are (plain data, identical on every rank).

    Attributes:
        source: the path of the item read (its attention mask or its labels).
        length: the padded length ``T``.
        starts: per sample, the first position to keep.
        ends: per sample, one past the last position to keep (``<= starts`` for a sample with none).
        items: paths of the tensors cut along dimension 1.
    """

    source: tuple
    length: int
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    items: tuple[tuple, ...]

    @property
    def layout(self) -> tuple:
        """What decides whether cutting is exact for a model: the marker read, the items cut, and the
        sides padded. A new layout is checked again."""
        left = any(0 < s < self.length for s in self.starts)
        right = any(0 < e < self.length for e in self.ends)
        return (self.source, self.items, left, right)

    def content_lengths(self) -> list[int]:
        """Positions each sample keeps (0 for a sample with no real token)."""
        return [max(0, e - s) for s, e in zip(self.starts, self.ends)]

    def window(self, samples: Sequence[int]) -> tuple[int, int] | None:
        """``(start, end)`` positions a microbatch of ``samples`` keeps; None: all of them (nothing
        to cut, or no sample with a real token)."""
        spans = [(self.starts[i], self.ends[i]) for i in samples if self.ends[i] > self.starts[i]]
        if not spans:
            return None
        start, end = min(s for s, _ in spans), max(e for _, e in spans)
        return None if (start, end) == (0, self.length) else (start, end)


def find_padding(leaves: Mapping[tuple, object], tensor_items: Sequence[tuple]) -> Padding | None:
    """Where the real tokens of a batch are, or None when it has no marker of padding.

    Args:
        leaves: every leaf of the batch by its path.
        tensor_items: paths of the tensors cut along dimension 0 (their batch dimension).
    """
    marker = _marker(leaves, tensor_items, MASK_KEY) or _marker(leaves, tensor_items, LABELS_KEY)
    if marker is None:
        return None
    path, values = marker
    batch_size, length = values.shape
    if path[-1] == MASK_KEY:
        real = values != 0
        any_real = real.any(dim=1)
        positions = torch.arange(length, device=values.device)
        starts = torch.where(any_real, torch.where(real, positions, length).amin(dim=1), length)
        ends = torch.where(any_real, torch.where(real, positions + 1, 0).amax(dim=1), 0)
    else:
        counted = values != IGNORE_INDEX
        positions = torch.arange(length, device=values.device)
        ends = torch.where(counted, positions + 1, 0).amax(dim=1)
        starts = torch.zeros(batch_size, dtype=torch.long)
    items = tuple(
        p for p in tensor_items
        if isinstance(leaves[p], Tensor) and leaves[p].dim() >= 2 and leaves[p].shape[:2] == (batch_size, length)
    )
    return Padding(path, int(length), tuple(int(s) for s in starts.tolist()), tuple(int(e) for e in ends.tolist()), items)


def _marker(leaves: Mapping[tuple, object], tensor_items: Sequence[tuple], key: str) -> tuple[tuple, Tensor] | None:
    """The first 2-D integer (or boolean) tensor named ``key`` cut along dimension 0."""
    for path in tensor_items:
        value = leaves[path]
        if path and path[-1] == key and isinstance(value, Tensor) and value.dim() == 2 and (
            not value.is_floating_point() and not value.is_complex()
        ) and value.shape[1] > 1:
            return path, value.detach()
    return None
