"""Pipeline and data-parallel process groups over ``world = pipeline x data-parallel`` ranks."""

from __future__ import annotations

import atexit
import functools
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    """Where a global rank sits in the 2-D layout.

    Ranks are numbered ``global = pipeline_rank * data_parallel_size + data_parallel_rank``
    (Megatron's order): the replicas of one stage are neighbours, so the large data-parallel
    all-reduce stays within a node and the small pipeline transfers cross nodes.
    """

    world_size: int
    pipeline_parallel_size: int
    global_rank: int

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size < 1 or self.world_size % self.pipeline_parallel_size:
            raise ValueError(
                f"`pipeline_parallel_size={self.pipeline_parallel_size}` must divide the number of processes "
                f"({self.world_size} = devices x nodes); the other factor is the data-parallel size."
            )

    @property
    def data_parallel_size(self) -> int:
        """Replicas of every stage."""
        return self.world_size // self.pipeline_parallel_size

    @property
    def pipeline_rank(self) -> int:
        """Position of this rank in its pipeline."""
        return self.global_rank // self.data_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Which replica of its stage this rank is."""
        return self.global_rank % self.data_parallel_size

    def pipeline_ranks(self, data_parallel_rank: int | None = None) -> list[int]:
        """Global ranks of one pipeline, in stage order (default: this rank's pipeline)."""
        d = self.data_parallel_rank if data_parallel_rank is None else data_parallel_rank
        return [p * self.data_parallel_size + d for p in range(self.pipeline_parallel_size)]

    def data_parallel_ranks(self, pipeline_rank: int | None = None) -> list[int]:
        """Global ranks holding replicas of one pipeline rank (default: this rank's)."""
        p = self.pipeline_rank if pipeline_rank is None else pipeline_rank
        return [p * self.data_parallel_size + d for d in range(self.data_parallel_size)]


@dataclass(frozen=True)
class ProcessGroups:
    """This rank's pipeline group, data-parallel group, and the group of its pipeline's two ends.

    ``ends`` joins the first and last rank of the pipeline; tied parameters (input and output
    embeddings) live on both and their gradients are summed over it. ``outcome`` is a gloo group of the
    pipeline's ranks for each step's loss and logs (``runtime/outcome_channel.py``: its receives are
    posted early, so nothing else may use it); None with one pipeline rank.
    """

    layout: RankLayout
    pipeline: dist.ProcessGroup
    data_parallel: dist.ProcessGroup
    ends: dist.ProcessGroup | None
    outcome: dist.ProcessGroup | None = None


def create_process_groups(layout: RankLayout, timeout: timedelta | None = None) -> ProcessGroups:
    """Create every pipeline and data-parallel group (a collective: all ranks must call it).

    Args:
        layout: the rank layout.
        timeout: how long any operation of these groups may wait for a peer (the strategy's
            ``timeout``); None: torch's default for the backend (30 minutes), which lets a frozen
            peer hang the others for that long.
    """
    pipeline = data_parallel = ends = outcome = None
    for d in range(layout.data_parallel_size):
        ranks = layout.pipeline_ranks(d)
        group = dist.new_group(ranks, timeout=timeout)
        ends_group = dist.new_group([ranks[0], ranks[-1]], timeout=timeout) if len(ranks) > 1 else None
        outcome_group = dist.new_group(ranks, timeout=timeout, backend="gloo") if len(ranks) > 1 else None
        if d == layout.data_parallel_rank:
            pipeline, ends, outcome = group, ends_group, outcome_group
    for p in range(layout.pipeline_parallel_size):
        group = dist.new_group(layout.data_parallel_ranks(p), timeout=timeout)
        if p == layout.pipeline_rank:
            data_parallel = group
    assert pipeline is not None and data_parallel is not None
    return ProcessGroups(layout, pipeline, data_parallel, ends, outcome)


def default_group() -> dist.ProcessGroup | None:
    """This process's default process group: a new object whenever it is destroyed and made again
    (groups made from an earlier one cannot be used then)."""
    return dist.group.WORLD


def destroy_default_group() -> None:
    """End this process's default process group if it has one (a worker's own, before it exits)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@functools.cache
def destroy_default_group_at_exit() -> None:
    """End this process's default process group when the interpreter exits normally, before its
    finalization: a process that exits with the group alive can abort there (SIGABRT, "terminate
    called without an active exception") while gloo's threads release tensors (pytorch/pytorch#190489).
    For processes that run the user's script to its end (the popen launcher, torchrun), where the
    group must outlive one ``trainer.fit`` (a ``trainer.predict`` may follow). Registered once."""
    atexit.register(destroy_default_group)
