"""``PipelinePlan``: everything about *how* a step runs that may change from one batch to the next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PipelinePlan:
    """How the next step runs; never what it computes (docs/architecture.md).

    A plan is computed deterministically from (batch metadata, configuration, cost model), so every
    rank derives the same one.

    Attributes:
        boundaries: block boundaries of the stages, ``[0, ..., num_blocks]``; stage ``k`` runs blocks
            ``boundaries[k] <= i < boundaries[k + 1]`` (the first also ``pre``, the last ``post``).
        schedule: a schedule family name, DSL spec, or ``Schedule`` (see ``lightning_pipe.schedules``).
        num_microbatches: microbatches per batch.
        memory: per-stage memory options (recompute/offload); empty means none.
    """

    boundaries: tuple[int, ...]
    schedule: Any = "1f1b"
    num_microbatches: int = 4
    memory: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def num_stages(self) -> int:
        """Number of stages the boundaries define."""
        return len(self.boundaries) - 1

    def blocks_per_stage(self) -> list[int]:
        """Number of blocks of every stage."""
        return [b - a for a, b in zip(self.boundaries, self.boundaries[1:])]
