"""What packed and sliced chunks hold beyond a memory profile measured on whole, unpacked sequences.

A :class:`~lightning_pipe.planning.memory_model.MemoryProfile` is fitted from probes of unpacked
microbatches (``profiling/memory_profile.py``), where causal attention saves no mask and no copy of
its keys and values. A chunk (``runtime/packing.py``, ``planning/chunking.py``) runs attention
differently, and its blocks keep more (measured per block with saved-tensor hooks on the GPT example
on CPU, ``tests/planning/test_chunk_memory.py`` pins the formulas):

* **masked attention** (a packed row of several sequences under masked SDPA, and every row whose
  first piece is a slice): the mask ``[rows, context + rows]`` in the activations' dtype, saved for
  attention's backward;
* **a slice's context**: attention runs over the earlier slices' keys and values concatenated with
  the row's own, a new tensor of ``context + rows`` tokens of keys and values, saved for backward;
* **the key/value store**: a slice's own keys and values stay in the step's
  :class:`~lightning_pipe.model.attention.KeyValueStore` from its forward to its backward, because
  later slices attend to them and return gradients into them (InfiniPipe's Eq. 5: the context's
  K/V and the dK/dV buffers). They are views of the block's projection output, so the whole
  projection's storage (queries, keys and values of the row: ``3 * hidden`` per token for a fused
  projection) stays alive, whatever the memory plan does, and later slices' backwards add the
  gradients of the slice's keys and values (``2 * hidden`` per token of the slice). Counted for the
  whole life of the slice (the gradients exist only from the first later backward on: an upper bound).

The first two are *attention bytes*: a block recomputed in full or offloaded does not keep them
(they are made again in the recomputation), one that keeps attention (``keep_attention``) does. The
third is *kept bytes*: no plan removes them. :class:`ChunkMemory` carries both per microbatch, per
block; :func:`~lightning_pipe.planning.memory_model.predict_memory` and
:func:`~lightning_pipe.planning.memory_planner.plan_memory` add them to the profile's numbers.

Pure numbers: pieces ``(sequence, start, length)`` in, bytes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_pipe.planning.cost_model import MicrobatchShape

PieceTuple = tuple[int, int, int]
"""``(sequence, start, length)``: tokens ``start .. start + length`` of one sequence of the batch."""


@dataclass(frozen=True)
class ChunkMemory:
    """Bytes per block that each microbatch (chunk) keeps beyond the memory profile's prediction.

    Attributes:
        attention: per microbatch, bytes per block saved for attention's backward (mask, the
            concatenated keys and values of a slice's context): kept unless the block is fully
            recomputed or offloaded.
        kept: per microbatch, bytes per block the step's key/value store holds from the slice's
            forward to its backward, whatever the memory plan (0 for rows without a slice).
    """

    attention: tuple[float, ...]
    kept: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.attention) != len(self.kept):
            raise ValueError(
                f"`ChunkMemory`: {len(self.attention)} attention entries but {len(self.kept)} kept entries."
            )
        if min((*self.attention, *self.kept), default=0.0) < 0:
            raise ValueError("`ChunkMemory`: bytes must be >= 0.")

    @property
    def num_microbatches(self) -> int:
        """Microbatches described."""
        return len(self.kept)

    @classmethod
    def empty(cls, num_microbatches: int) -> ChunkMemory:
        """Nothing beyond the profile (unpacked microbatches)."""
        return cls((0.0,) * num_microbatches, (0.0,) * num_microbatches)


def chunk_shapes(pieces: Sequence[Sequence[PieceTuple]]) -> list[MicrobatchShape]:
    """What the cost and memory models price for each chunk: its pieces as sequences, tokens, and
    ``sum((c + s)^2 - c^2)`` over pieces starting at ``c`` with ``s`` tokens (Eq. 1's attention term;
    ``planning/chunking.py``'s :attr:`Chunk.shape`)."""
    shapes = []
    for group in pieces:
        if not group:
            raise ValueError("`chunk_shapes`: a chunk without pieces.")
        squared = sum((a + n) ** 2 - a * a for _, a, n in group)
        shapes.append(MicrobatchShape(len(group), sum(n for _, _, n in group), float(squared)))
    return shapes


def chunk_memory(
    pieces: Sequence[Sequence[PieceTuple]],
    sequence_lengths: Sequence[int],
    hidden: int,
    element_bytes: int,
    *,
    masked: bool = True,
    masked_slices: bool = True,
    key_value_width: int | None = None,
    stored_width: int | None = None,
) -> ChunkMemory:
    """Bytes per block each chunk keeps beyond an unpacked profile (see the module's docstring).

    Args:
        pieces: per microbatch, its pieces ``(sequence, start, length)``; a slice (a piece that is
            not a whole sequence) comes first in its row.
        sequence_lengths: real tokens of each sequence of the batch (to tell slices from whole ones).
        hidden: the blocks' width (features per position).
        element_bytes: bytes per element of the activations (8 for float64, 2 for bfloat16).
        masked: whether packed rows run masked SDPA (CPU; False when a varlen kernel runs them: no
            mask).
        masked_slices: whether slices run masked SDPA (this project's
            :class:`~lightning_pipe.model.attention.SlicedAttention` does, on every device; False
            models a kernel that takes the context's keys and values without a mask, as InfiniPipe's).
        key_value_width: features per token of keys plus values (default ``2 * hidden``; smaller
            with grouped-query attention).
        stored_width: features per token of the storage a slice's keys and values keep alive
            (default ``3 * hidden``: a fused query/key/value projection).

    Returns:
        The :class:`ChunkMemory` of the microbatches.
    """
    kv = 2 * hidden if key_value_width is None else key_value_width
    stored = 3 * hidden if stored_width is None else stored_width
    attention, kept = [], []
    for group in pieces:
        rows = sum(n for _, _, n in group)
        sequence, start, length = group[0]
        sliced = length != sequence_lengths[sequence]
        context = start if sliced else 0
        extra = 0.0
        if (sliced and masked_slices) or (not sliced and masked and len(group) > 1):
            extra += element_bytes * rows * (context + rows)  # the mask
        if sliced:
            extra += element_bytes * kv * (context + rows)  # earlier slices' keys and values, with the row's own
        attention.append(float(extra))
        kept.append(float(element_bytes * (stored * rows + kv * length)) if sliced else 0.0)
    return ChunkMemory(tuple(attention), tuple(kept))
