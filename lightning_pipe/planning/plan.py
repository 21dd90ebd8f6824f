"""``PipelinePlan``: everything about *how* a step runs that may change from one batch to the next."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_pipe.planning.chunking import PlannedChunks
from lightning_pipe.planning.memory_model import MemoryPlan
from lightning_pipe.schedules import Schedule, resolve_schedule


def _default_schedule() -> Schedule:
    return resolve_schedule("1f1b")


@dataclass(frozen=True)
class PipelinePlan:
    """How the next step runs; never what it computes (docs/architecture.md).

    A plan is computed deterministically from (batch metadata, configuration, cost model), so every
    rank derives the same one. Its parts are typed: a :class:`~lightning_pipe.schedules.Schedule`
    (a family name, DSL text or dict given here is resolved to one), a
    :class:`~lightning_pipe.planning.memory_model.MemoryPlan` (a mapping in ``MemoryPlan.to_dict``
    form is read into one), and the microbatching (a count and optional sizes).

    Attributes:
        boundaries: block boundaries of the stages, ``[0, ..., num_blocks]``; stage ``k`` runs blocks
            ``boundaries[k] <= i < boundaries[k + 1]`` (the first also ``pre``, the last ``post``).
        schedule: the schedule family with its options.
        num_microbatches: microbatches per batch.
        memory: recompute/offload per (stage, microbatch); None: the strategy's static plan (its
            ``recompute``/``offload`` arguments).
        microbatch_sizes: samples of each microbatch, in order (uneven microbatches sized by work,
            ``planning.microbatching``); None: the batch is split evenly (``torch.tensor_split``'s
            rule). Sizes describe one batch: they must sum to its batch size.
        chunks: the batch's microbatches as packed and sliced chunks (InfiniPipe's, for a strategy
            with ``packing=Packer(..., slicing=True)``); None: the packer makes its own. Chunks
            describe one batch, like sizes; ``num_microbatches`` is their count.
        widths: data-parallel replicas of every stage (elastic depth, FlexPipe): stage ``k`` runs on
            ``widths[k]`` ranks, taken in rank order, and splits its microbatches between them
            (``planning/layout.py``); ``sum(widths)`` is the number of processes. None: one replica
            per stage on every pipeline (the strategy's fixed data parallelism). Needs
            ``ElasticPipelineStrategy(elastic_depth=True)``.
    """

    boundaries: tuple[int, ...]
    schedule: Schedule = field(default_factory=_default_schedule)
    num_microbatches: int = 4
    memory: MemoryPlan | None = field(default=None, hash=False)
    microbatch_sizes: tuple[int, ...] | None = None
    chunks: PlannedChunks | None = None
    widths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        if not isinstance(self.schedule, Schedule):
            object.__setattr__(self, "schedule", resolve_schedule(self.schedule))
        if isinstance(self.memory, Mapping):
            object.__setattr__(self, "memory", MemoryPlan.from_dict(self.memory) if self.memory else None)
        elif self.memory is not None and not isinstance(self.memory, MemoryPlan):
            raise TypeError(f"`PipelinePlan.memory` must be a MemoryPlan or None, got {type(self.memory).__name__}.")
        count = self.num_microbatches
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"`PipelinePlan.num_microbatches` must be an integer >= 1, got {self.num_microbatches!r}.")
        if self.microbatch_sizes is not None:
            sizes = check_microbatch_sizes(self.microbatch_sizes)
            if len(sizes) != self.num_microbatches:
                raise ValueError(
                    f"`PipelinePlan.microbatch_sizes` {list(sizes)} gives {len(sizes)} microbatches but "
                    f"`num_microbatches={self.num_microbatches}`; give one size per microbatch."
                )
            object.__setattr__(self, "microbatch_sizes", sizes)
        if self.chunks is not None:
            if not isinstance(self.chunks, PlannedChunks):
                raise TypeError(f"`PipelinePlan.chunks` must be PlannedChunks or None, got {type(self.chunks).__name__}.")
            if self.microbatch_sizes is not None or self.chunks.num_microbatches != count:
                raise ValueError(
                    f"`PipelinePlan.chunks` holds {self.chunks.num_microbatches} microbatches: give "
                    f"`num_microbatches={self.chunks.num_microbatches}` and no `microbatch_sizes` (got {count}, "
                    f"{self.microbatch_sizes})."
                )
        if self.widths is not None:
            widths = tuple(int(w) for w in self.widths)
            if len(widths) != len(self.boundaries) - 1 or min(widths, default=0) < 1:
                raise ValueError(
                    f"`PipelinePlan.widths` {list(widths)} must give every one of the {len(self.boundaries) - 1} stages "
                    "of `boundaries` a width >= 1."
                )
            object.__setattr__(self, "widths", widths)

    @property
    def num_stages(self) -> int:
        """Number of stages the boundaries define."""
        return len(self.boundaries) - 1

    def blocks_per_stage(self) -> list[int]:
        """Number of blocks of every stage."""
        return [b - a for a, b in zip(self.boundaries, self.boundaries[1:])]

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary (checkpoints, logs): boundaries, schedule name, microbatching, memory."""
        return {
            "boundaries": list(self.boundaries),
            "schedule": self.schedule.name,
            "num_microbatches": self.num_microbatches,
            "microbatch_sizes": None if self.microbatch_sizes is None else list(self.microbatch_sizes),
            "chunk_groups": None if self.chunks is None else list(self.chunks.slices),
            "chunk_pipelines": None if self.chunks is None or self.chunks.pipelines is None else list(self.chunks.pipelines),
            "memory": {} if self.memory is None else self.memory.to_dict(),
            "widths": None if self.widths is None else list(self.widths),
        }


def check_microbatch_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of positive integers.

    Raises:
        ValueError: for an empty sequence or a size that is not an integer >= 1.
    """
    values = tuple(sizes)
    if not values or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in values):
        raise ValueError(f"Microbatch sizes must be integers >= 1 (samples per microbatch), got {list(values)}.")
    return tuple(int(n) for n in values)
