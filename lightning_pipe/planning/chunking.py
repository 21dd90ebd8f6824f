"""Workload-balanced chunking (InfiniPipe, Algorithm 1): a batch's sequences as chunks of near-equal cost.

A *chunk* is one microbatch of the pipeline: a set of *pieces*, each a run of tokens of one sequence
(InfiniPipe §3.1.1, Fig. 5):

* **batched**: whole short sequences packed together (no context);
* **split**: one non-final slice of a long sequence, attending to the ``context`` tokens of its
  sequence before it (their keys and values);
* **hybrid**: the tail (last) slice of a long sequence, with its context, plus packed short
  sequences. Two tails never share a chunk (both sequences would have to be co-scheduled).

Costs follow Eq. 1: a piece starting at ``c`` with ``s`` tokens costs ``alpha1 * ((c + s)^2 - c^2) +
alpha2 * s``, plus ``beta`` per chunk: attention's quadratic term, which telescopes over the slices of
a sequence (``sum ((c+s)^2 - c^2) = length^2``). In this project's cost model that is a
:class:`~lightning_pipe.planning.cost_model.MicrobatchShape` whose ``sum_squared_lengths`` is
``sum ((c + s)^2 - c^2)`` (:attr:`Chunk.shape`), so :class:`CostModel` prices chunks unchanged.

:func:`chunk_batch` is Algorithm 1 with the reading notes' fixes: ``M.split`` cuts the longest
sequence into ``num_slices`` slices of equal time (binary search on the time; earlier slices are
longer); every sequence longer than the first slice is cut with the same mesh (its rest is its
tail); each tail opens a bucket; short sequences, longest first, go best-fit into the bucket of
lowest time per token that stays within the time limit ``T_t`` and the token limit ``T_m``; when none
does, ``T_t`` rises to the smallest bucket time (among buckets with room for the tokens) plus the
sequence's time; when no bucket has room for its tokens, it opens a new bucket.

:class:`PlannedChunks` is a batch's chunks as plan data (``PipelinePlan.chunks``, proposed like
microbatch sizes); :func:`chunk_program` the program they run with.

Pure computation: numbers in, chunks out. The strategy runs them (``runtime/packing.py`` packs
and slices the rows, docs/long_sequences.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_pipe.planning.cost_model import CostModel, LinearCost, MicrobatchShape
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b
from lightning_pipe.schedules.ir import Program

BATCHED = "batched"
SPLIT = "split"
HYBRID = "hybrid"


@dataclass(frozen=True)
class Piece:
    """Tokens ``start .. start + length`` of sequence ``sequence`` of the batch."""

    sequence: int
    start: int
    length: int


@dataclass(frozen=True)
class Chunk:
    """One microbatch: pieces of sequences, at most one of them with context (a slice).

    Attributes:
        pieces: the slice with context first (if any), then whole sequences.
        kind: ``"batched"``, ``"split"`` or ``"hybrid"``.
    """

    pieces: tuple[Piece, ...]
    kind: str

    @property
    def tokens(self) -> int:
        """Tokens of the chunk (no padding)."""
        return sum(p.length for p in self.pieces)

    @property
    def context(self) -> int:
        """Tokens of the sliced sequence before this chunk's slice (0 for a batched chunk)."""
        return self.pieces[0].start if self.pieces else 0

    @property
    def shape(self) -> MicrobatchShape:
        """What the cost model prices: ``sum_squared_lengths = sum((c + s)^2 - c^2)`` over pieces."""
        squared = sum((p.start + p.length) ** 2 - p.start**2 for p in self.pieces)
        return MicrobatchShape(len(self.pieces), self.tokens, float(squared))


@dataclass(frozen=True)
class ChunkPlan:
    """A batch turned into chunks, in schedule order.

    Attributes:
        chunks: sliced sequences first (longest first, each sequence's slices in order, its tail's
            hybrid chunk last), then the batched chunks.
        slices: chunks per scheduled sequence group, in order (``sliced_1f1b``'s ``slices``): a
            sliced sequence's chunks form one group, every batched chunk a group of its own.
        mesh: the slice lengths of the longest sequence (``M.split``).
        time_limit: ``T_t`` after packing (seconds, raised by the perturbation of line 16).
        token_limit: ``T_m``, the most tokens of a chunk.
    """

    chunks: tuple[Chunk, ...]
    slices: tuple[int, ...]
    mesh: tuple[int, ...]
    time_limit: float
    token_limit: int

    @property
    def shapes(self) -> list[MicrobatchShape]:
        """Every chunk's cost-model shape, in schedule order."""
        return [chunk.shape for chunk in self.chunks]


@dataclass(frozen=True)
class PlannedChunks:
    """A batch's microbatches as chunks: the microbatching part of a
    :class:`~lightning_pipe.planning.plan.PipelinePlan` when the strategy packs and slices.

    Plain data, checked on construction: every token of every sequence is in exactly one piece, a
    sliced sequence's pieces are in order, each scheduled group is whole.

    Attributes:
        pieces: per microbatch (schedule order), its pieces ``(sequence, start, length)``; a slice
            that is not a whole sequence comes first in its row.
        slices: microbatches per scheduled group (``sliced_1f1b``'s ``slices``), summing to the
            number of microbatches.
        sequence_lengths: real tokens of each sequence of the batch the chunks were made for.
        pipelines: InfiniPipe's sequence grouping (§3.3.2, ``planning/grouping.py``): entries of
            ``slices`` per consecutive 1F1B pipeline of the step (gradients accumulate across them);
            None: one pipeline.
    """

    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    slices: tuple[int, ...]
    sequence_lengths: tuple[int, ...]
    pipelines: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        pieces = tuple(tuple((int(i), int(a), int(n)) for i, a, n in group) for group in self.pieces)
        object.__setattr__(self, "pieces", pieces)
        object.__setattr__(self, "slices", tuple(int(c) for c in self.slices))
        object.__setattr__(self, "sequence_lengths", tuple(int(n) for n in self.sequence_lengths))
        if not pieces or any(not group for group in pieces):
            raise ValueError("`PlannedChunks.pieces`: every microbatch needs at least one piece.")
        if sum(self.slices) != len(pieces) or min(self.slices) < 1:
            raise ValueError(f"`PlannedChunks.slices` {list(self.slices)} must be >= 1 and sum to the {len(pieces)} microbatches.")
        if self.pipelines is not None:
            pipelines = tuple(int(c) for c in self.pipelines)
            if not pipelines or min(pipelines) < 1 or sum(pipelines) != len(self.slices):
                raise ValueError(
                    f"`PlannedChunks.pipelines` {list(pipelines)} must be >= 1 and sum to the {len(self.slices)} "
                    "scheduled groups of `slices`."
                )
            object.__setattr__(self, "pipelines", None if len(pipelines) == 1 else pipelines)
        covered: dict[int, int] = {}
        for m, group in enumerate(pieces):
            for position, (i, a, n) in enumerate(group):
                if not 0 <= i < len(self.sequence_lengths) or n < 1 or covered.get(i, 0) != a:
                    raise ValueError(
                        f"`PlannedChunks`: piece {(i, a, n)} of microbatch {m} does not continue sequence {i} "
                        f"(tokens 0 to {covered.get(i, 0)} placed before it, lengths {list(self.sequence_lengths)[:8]}...)."
                    )
                if position > 0 and n != self.sequence_lengths[i]:
                    raise ValueError(f"`PlannedChunks`: microbatch {m} holds a slice of sequence {i} after its first piece.")
                covered[i] = a + n
        missing = [i for i, n in enumerate(self.sequence_lengths) if n > 0 and covered.get(i, 0) != n]
        if missing:
            raise ValueError(f"`PlannedChunks`: sequences {missing[:8]} are not covered to their ends.")

    @classmethod
    def from_plan(cls, plan: ChunkPlan, sequence_lengths: Sequence[int]) -> PlannedChunks:
        """Algorithm 1's chunks (:func:`chunk_batch`) as plan data."""
        pieces = tuple(tuple((p.sequence, p.start, p.length) for p in chunk.pieces) for chunk in plan.chunks)
        return cls(pieces, plan.slices, tuple(sequence_lengths))

    @property
    def num_microbatches(self) -> int:
        """Chunks (microbatches) of the batch."""
        return len(self.pieces)

    @property
    def is_sliced(self) -> bool:
        """Whether a sequence is cut into slices or the batch runs as several pipelines (the step runs
        sliced 1F1B)."""
        return any(count > 1 for count in self.slices) or self.pipelines is not None

    @property
    def shapes(self) -> list[MicrobatchShape]:
        """What the cost model prices for each chunk (``sum((c + s)^2 - c^2)`` over its pieces)."""
        return [
            MicrobatchShape(len(group), sum(n for _, _, n in group), float(sum((a + n) ** 2 - a * a for _, a, n in group)))
            for group in self.pieces
        ]


def chunk_program(plan: Any, num_ranks: int) -> Program:
    """The training program of a :class:`~lightning_pipe.planning.plan.PipelinePlan` with chunks:
    sliced 1F1B when a sequence is sliced (backward last slice first; one pipeline after the other
    when the chunks are grouped into several), else the plan's family.

    Raises:
        ValueError: sliced chunks with a family other than ``"1f1b"``.
    """
    chunks = plan.chunks
    if not chunks.is_sliced:
        return plan.schedule.build(num_ranks, chunks.num_microbatches)
    if plan.schedule.name != "1f1b":
        raise ValueError(
            f"Sliced chunks run as sliced 1F1B; schedule {plan.schedule.name!r} cannot run them: use '1f1b'."
        )
    return sliced_1f1b(num_ranks, chunks.num_microbatches, chunks.slices, chunks.pipelines)


def chunk_time_model(cost_model: CostModel) -> LinearCost:
    """Seconds of one chunk on the whole pipeline (forward plus backward, all units summed), the
    balance target of Algorithm 1."""
    units = cost_model.units
    return LinearCost(
        constant=sum(u.forward.constant + u.backward.constant for u in units),
        per_token=sum(u.forward.per_token + u.backward.per_token for u in units),
        per_squared_length=sum(u.forward.per_squared_length + u.backward.per_squared_length for u in units),
    )


def piece_time(time: LinearCost, context: int, length: int) -> float:
    """Eq. 1 without the per-chunk constant: ``alpha1 ((c+s)^2 - c^2) + alpha2 s``."""
    return time.per_squared_length * ((context + length) ** 2 - context**2) + time.per_token * length


def split_mesh(length: int, num_slices: int, time: LinearCost) -> tuple[int, ...]:
    """Cut a sequence of ``length`` tokens into ``num_slices`` slices of (near) equal time.

    Slice ``i`` attends to the slices before it, so later slices are shorter. Binary search on the
    per-slice time ``tau``: from context 0, each slice takes the most tokens whose time fits ``tau``;
    the smallest ``tau`` whose ``num_slices`` slices cover ``length`` wins; the last slice takes the rest.

    Raises:
        ValueError: ``num_slices`` is below 1 or above ``length``.
    """
    if not 1 <= num_slices <= max(length, 1):
        raise ValueError(f"`num_slices` must be in [1, {length}] for a sequence of {length} tokens, got {num_slices}.")
    if num_slices == 1:
        return (length,)

    def slices_for(tau: float) -> list[int]:
        out, context = [], 0
        for _ in range(num_slices - 1):
            s = _most_tokens(time, context, tau)
            s = max(1, min(s, length - context - (num_slices - 1 - len(out))))
            out.append(s)
            context += s
        out.append(length - context)
        return out

    low, high = 0.0, piece_time(time, 0, length) + time.constant
    for _ in range(100):
        tau = (low + high) / 2
        last = slices_for(tau)[-1]
        if piece_time(time, length - last, last) > tau:
            low = tau
        else:
            high = tau
    return tuple(slices_for(high))


def _most_tokens(time: LinearCost, context: int, tau: float) -> int:
    """Largest ``s`` with ``alpha1 (s^2 + 2 c s) + alpha2 s <= tau``."""
    a, b = time.per_squared_length, 2 * time.per_squared_length * context + time.per_token
    if a == 0:
        return int(tau / b) if b > 0 else 10**18
    return int((-b + math.sqrt(b * b + 4 * a * tau)) / (2 * a))


@dataclass
class _Bucket:
    pieces: list[Piece]
    time: float
    tokens: int
    order: int


def chunk_batch(
    lengths: Sequence[int], num_slices: int, time: LinearCost, *, balance_length: bool = True
) -> ChunkPlan:
    """Algorithm 1: the batch's sequences as workload-balanced chunks.

    Args:
        lengths: tokens of each sequence of the batch.
        num_slices: ``N``, the slices of the longest sequence (1: nothing is cut, batch-level chunks).
        time: seconds of a chunk as a function of its shape (:func:`chunk_time_model`).
        balance_length: also keep every chunk within the token limit ``T_m`` when packing (InfiniPipe);
            False balances time only (the first row of Table 2).

    Returns:
        The :class:`ChunkPlan`.

    Raises:
        ValueError: ``lengths`` is empty or holds a length below 1.
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"`lengths` must be non-empty and every length >= 1, got {list(lengths)[:8]}.")
    longest = max(lengths)
    mesh = split_mesh(longest, num_slices, time)
    token_limit = mesh[0]
    contexts = [sum(mesh[:i]) for i in range(len(mesh))]
    time_limit = max(piece_time(time, c, s) for c, s in zip(contexts, mesh)) + time.constant

    sliced: list[tuple[int, list[Chunk], _Bucket]] = []  # (sequence, split chunks, tail bucket)
    short: list[int] = []
    buckets: list[_Bucket] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        if n <= token_limit:
            short.append(index)
            continue
        splits, start = [], 0
        for cut in mesh[:-1]:
            if n - start <= cut:
                break
            splits.append(Chunk((Piece(index, start, cut),), SPLIT))
            start += cut
        tail = Piece(index, start, n - start)
        bucket = _Bucket([tail], piece_time(time, start, n - start) + time.constant, tail.length, len(buckets))
        buckets.append(bucket)
        sliced.append((index, splits, bucket))

    for index in short:  # longest (= most expensive) first
        n = lengths[index]
        cost = piece_time(time, 0, n)
        if not buckets or min(b.tokens for b in buckets) + n > token_limit:
            buckets.append(_Bucket([Piece(index, 0, n)], cost + time.constant, n, len(buckets)))
            continue
        while True:
            fits = [
                b for b in sorted(buckets, key=lambda b: (b.time / b.tokens, b.order))
                if b.time + cost <= time_limit * (1 + 1e-12) and (not balance_length or b.tokens + n <= token_limit)
            ]
            if fits:
                chosen = fits[0]
                chosen.pieces.append(Piece(index, 0, n))
                chosen.time += cost
                chosen.tokens += n
                break
            roomy = [b for b in buckets if not balance_length or b.tokens + n <= token_limit]
            time_limit = min(b.time for b in roomy) + cost  # line 16, restricted to buckets with room

    chunks: list[Chunk] = []
    groups: list[int] = []
    for _, splits, bucket in sliced:
        tail, *rest = bucket.pieces
        kind = HYBRID if tail.start > 0 else BATCHED
        chunks += splits + [Chunk((tail, *sorted(rest, key=lambda p: p.sequence)), kind)]
        groups.append(len(splits) + 1)
    tails = {id(b) for _, _, b in sliced}
    for bucket in buckets:
        if id(bucket) not in tails:
            chunks.append(Chunk(tuple(sorted(bucket.pieces, key=lambda p: p.sequence)), BATCHED))
            groups.append(1)
    return ChunkPlan(tuple(chunks), tuple(groups), mesh, time_limit, token_limit)


def relative_std(values: Sequence[float]) -> float:
    """Population standard deviation over mean (Table 2's RSD), 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean if mean else 0.0


def chunk_pieces(
    lengths: Sequence[int], time: LinearCost, max_tokens: int
) -> tuple[tuple[tuple[tuple[int, int, int], ...], ...], tuple[int, ...]]:
    """Algorithm 1 with the fewest slices whose token limit fits ``max_tokens``, as plain pieces.

    Returns:
        per chunk its pieces ``(sequence, start, length)``, and the chunks of each scheduled group
        (what ``runtime.packing.Packer`` runs).
    """
    for num_slices in range(1, max(lengths) + 1):
        plan = chunk_batch(lengths, num_slices, time)
        if plan.token_limit <= max_tokens:
            break
    pieces = tuple(tuple((p.sequence, p.start, p.length) for p in chunk.pieces) for chunk in plan.chunks)
    return pieces, plan.slices
