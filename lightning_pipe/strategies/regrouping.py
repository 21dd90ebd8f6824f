"""Elastic depth in the strategy: live regrouping of ranks between stage/width layouts (FlexPipe).

With ``ElasticPipelineStrategy(elastic_depth=True)`` a plan may give its stages data-parallel widths
(``PipelinePlan.widths``): 4 processes may run 4 stages x 1, 2 x 2, 1 x 4 (data parallel), or uneven
layouts such as ``(2, 1, 1)`` or ``(1, 3)``, and the layout may change between any two optimizer
steps, also inside an accumulation window. :class:`Regrouping` is what the strategy calls for it
(docs/repartitioning.md, section 9.7):

1. **Data.** The strategy runs as one pipeline over all processes (no ``DistributedSampler``): every
   rank reads the global batch and splits it once into the microbatch plan.
2. **Program.** ``schedules.layout_program.layout_1f1b``: replica ``m % w`` of a width-``w`` stage
   runs microbatch ``m``; ``runtime.regroup.LayoutExecutor`` sends each activation to the replica
   that runs it next.
3. **Gradients.** Loss weights normalise by the whole batch, so each replica's gradient is a
   partial sum: the optimizer step sums them over the stage's replicas.
4. **Groups.** One group per contiguous rank range of two or more ranks (every replica set of every
   layout of widths), created once at setup; activations travel on the world group. That is
   ``n (n - 1) / 2`` groups for ``n`` processes: fine for the 4 to 16 processes tested and planned
   here, too many for hundreds (then only the planner's candidate layouts' sets should be made).
5. **Moves.** ``runtime.migration.migrate`` moves parameters and optimizer state; around it the open
   window's partial gradients are summed on one keeper and only one new holder keeps the sum.
6. **Resume.** Checkpoints record the plan (boundaries and widths); a resumed run moves to that
   layout once the optimizer state is loaded (:meth:`Regrouping.saved_plan`), so it continues on
   the layout in effect at save time.
7. **Refusals**, before training: see :meth:`Regrouping.check_configuration` and
   :meth:`Regrouping.check_plan`.

A last stage of width ``w`` gathers its replicas' losses and logs on its first rank, which reports
the step as the last stage does without regrouping.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from torch import Tensor

from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime.regroup import (
    create_rank_groups,
    keep_moved_gradients,
    merge_replica_outcomes,
    sum_moved_gradients,
)
from lightning_pipe.schedules import Program
from lightning_pipe.schedules.layout_program import LayoutProgram, layout_1f1b

log = logging.getLogger(__name__)

_NAME = "ElasticPipelineStrategy(elastic_depth=True)"


def contiguous_rank_sets(world_size: int) -> list[tuple[int, ...]]:
    """Every contiguous range of two or more ranks: the replica sets of all layouts of widths.

    In the order every rank creates them (by size, then first rank).
    """
    return [tuple(range(start, start + size)) for size in range(2, world_size + 1) for start in range(world_size - size + 1)]


class Regrouping:
    """The strategy's state and helpers for layouts of stages with widths (see the module docstring)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, ...], Any] = {}
        self._programs: dict[tuple[tuple[int, ...], int], LayoutProgram] = {}

    @staticmethod
    def check_configuration(
        *,
        pipeline_parallel_size: int | None,
        schedule: Any,
        optimizer_offload: bool,
        packing: bool,
        ranks_per_device: int,
        memory_settings: dict[str, Any],
    ) -> None:
        """Refuse, at construction, what regrouping does not support yet (each message says what to change).

        Raises:
            ValueError: optimizer offload, packing, several ranks per device, a memory plan
                (recompute, offload, a budget), or a schedule other than 1F1B.
        """
        if optimizer_offload:
            raise ValueError(
                f"`{_NAME}` does not support `optimizer_offload=True`: the per-stage host optimizers are built for one "
                "layout. Turn one of them off."
            )
        if packing:
            raise ValueError(f"`{_NAME}` does not support `packing`: turn one of them off.")
        if ranks_per_device != 1:
            raise ValueError(f"`{_NAME}` needs one rank per device, got `ranks_per_device={ranks_per_device}`.")
        set_memory = {name: value for name, value in memory_settings.items() if value not in (None, False, "none")}
        if set_memory:
            raise ValueError(
                f"`{_NAME}` does not apply memory plans yet (recompute, offload, budgets are planned per layout): got "
                f"{set_memory}. Remove them or turn elastic depth off."
            )
        if getattr(schedule, "name", None) != "1f1b":
            raise ValueError(
                f"`{_NAME}` runs layouts with heterogeneous 1F1B; schedule {getattr(schedule, 'name', schedule)!r} is not "
                "supported. Use `schedule='1f1b'`."
            )
        if pipeline_parallel_size is not None:
            raise ValueError(
                f"`{_NAME}` chooses stages and widths per step over all processes: leave `pipeline_parallel_size` unset "
                f"(got {pipeline_parallel_size}); the plan's `widths` give the data parallelism."
            )

    def create_groups(self, world_size: int, timeout: timedelta) -> None:
        """Create every replica group up front (a collective of all ranks, once, at setup)."""
        self.groups = create_rank_groups(contiguous_rank_sets(world_size), timeout=timeout)

    def check_module(self, has_metrics: bool, shared: list[tuple[Tensor | None, tuple[int, ...]]]) -> None:
        """Refuse torchmetrics objects and parameters shared between units (tied embeddings), untested here.

        Raises:
            ValueError: naming what to change.
        """
        if has_metrics:
            raise ValueError(
                f"`{_NAME}` does not support torchmetrics objects in the module yet (their states would be updated on "
                "several replicas of the last stage). Log plain tensors, or turn elastic depth off."
            )
        if any(len(holders) > 1 for _, holders in shared):
            raise ValueError(
                f"`{_NAME}` does not support parameters used by several units (tied embeddings) yet: their holders "
                "would be replicas of stages with different widths. Untie them, or turn elastic depth off."
            )

    @staticmethod
    def check_plan(plan: PipelinePlan, world_size: int, enabled: bool) -> None:
        """Refuse a plan with widths the running configuration cannot run.

        Raises:
            ValueError: widths without elastic depth, with a schedule other than 1F1B, widths that
                do not cover the processes, or a memory plan together with widths.
        """
        if plan.widths is None:
            return
        if not enabled:
            raise ValueError(
                f"A plan with stage widths {list(plan.widths)} needs `{_NAME}` (the replica groups are created at setup)."
            )
        if plan.schedule.name != "1f1b":
            raise ValueError(
                f"A plan with stage widths {list(plan.widths)} runs heterogeneous 1F1B; its schedule is "
                f"{plan.schedule.name!r}. Propose `schedule='1f1b'` with widths, or no widths with other schedules."
            )
        if sum(plan.widths) != world_size:
            raise ValueError(f"Plan widths {list(plan.widths)} must sum to the {world_size} processes.")
        if plan.memory is not None and not plan.memory.is_empty:
            raise ValueError(f"`{_NAME}` does not apply memory plans yet; the plan with widths {list(plan.widths)} has one.")

    @staticmethod
    def saved_plan(record: dict[str, Any] | None, current: PipelinePlan, world_size: int) -> PipelinePlan | None:
        """The layout a checkpoint was saved under, for a resumed run to continue on it.

        Args:
            record: the checkpoint's ``"pipeline"`` entry (``plan`` with ``boundaries`` and ``widths``).
            current: the plan the resumed run starts with; its schedule and microbatching are kept.
            world_size: processes of the resumed run.

        Returns:
            ``current`` with the saved boundaries and widths, or None when there is nothing to
            restore (no record, no widths, the same layout) or the record does not fit this run
            (other process count or block count: logged, the run keeps its own layout, which is
            exact too).
        """
        saved = (record or {}).get("plan") or {}
        widths, boundaries = saved.get("widths"), saved.get("boundaries")
        if not widths or not boundaries:
            return None
        widths, boundaries = tuple(int(w) for w in widths), tuple(int(b) for b in boundaries)
        if sum(widths) != world_size or boundaries[-1] != current.boundaries[-1] or len(boundaries) != len(widths) + 1:
            log.warning(
                "The checkpoint's layout (widths %s over blocks %s) does not fit this run (%d processes, %d blocks); "
                "training resumes on the strategy's own layout.",
                list(widths), list(boundaries), world_size, current.boundaries[-1],
            )
            return None
        if widths == current.widths and boundaries == tuple(current.boundaries):
            return None
        return PipelinePlan(
            boundaries, current.schedule, current.num_microbatches, microbatch_sizes=current.microbatch_sizes,
            widths=widths,
        )

    def program(self, widths: tuple[int, ...], num_microbatches: int) -> LayoutProgram:
        """The heterogeneous 1F1B program of ``widths`` (built once per pair)."""
        key = (tuple(widths), num_microbatches)
        program = self._programs.get(key)
        if program is None:
            program = layout_1f1b(tuple(widths), num_microbatches)
            self._programs = {**dict(list(self._programs.items())[-31:]), key: program}
        return program

    @staticmethod
    def replicas(program: Program, rank: int) -> tuple[int, ...]:
        """The ranks running this rank's stage (itself alone without widths)."""
        if not isinstance(program, LayoutProgram):
            return (rank,)
        return program.devices_of(program.stages_of(rank)[0])

    def sum_gradients(self, parameters: list[Tensor], program: Program, rank: int) -> None:
        """At the optimizer step: sum the stage's partial gradients over its replicas."""
        replicas = self.replicas(program, rank)
        if len(replicas) > 1:
            collectives.reduce_gradients(
                parameters, self.groups[replicas], f"the gradient sum of a stage over its replicas {list(replicas)}"
            )

    def norm_share(self, local_squared_sum: Tensor, program: Program, rank: int) -> Tensor:
        """This rank's share of the global squared gradient norm: replicas hold the same sums, counted once."""
        return local_squared_sum / len(self.replicas(program, rank))

    def merge_outcome(self, outcome: Any, program: Program, rank: int) -> Any:
        """On a last stage of width > 1: gather every replica's microbatch results on its first rank."""
        if not isinstance(program, LayoutProgram) or program.stages_of(rank) != (program.num_stages - 1,):
            return outcome
        replicas = self.replicas(program, rank)
        if len(replicas) == 1:
            return outcome
        return merge_replica_outcomes(outcome, self.groups[replicas], replicas[0], rank)

    def gather_gradients(self, module: Any, old_holders: dict, new_holders: dict, rank: int) -> dict[str, int]:
        """Before a move: sum the partial gradients of moving parameters on their keepers."""
        parameters = {n: p for n, p in module.named_parameters(remove_duplicate=False) if not p.is_meta}
        return sum_moved_gradients(parameters, old_holders, new_holders, rank, self.groups)

    def keep_gradients(self, module: Any, new_holders: dict, keepers: dict[str, int], rank: int) -> None:
        """After a move: only one new holder of each moved parameter keeps the summed gradient."""
        parameters = {n: p for n, p in module.named_parameters(remove_duplicate=False) if not p.is_meta}
        keep_moved_gradients(parameters, new_holders, keepers, rank)
