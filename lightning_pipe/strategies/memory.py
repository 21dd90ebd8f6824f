"""The strategy's memory support: memory plans per (stage, microbatch), the budget, probes.

:class:`StrategyMemory` is what ``ElasticPipelineStrategy.memory`` holds. It turns the strategy's
``memory_budget``/``recompute``/``offload``/``mlp_chunk_size`` arguments into a static
:class:`~lightning_pipe.planning.memory_model.MemoryPlan`, installs the plan of every
:class:`~lightning_pipe.planning.plan.PipelinePlan` (``plan.memory``; empty means the static one),
gives the executor the block wrappers of the current plan, accounts saved activations against the
budget during training steps, and answers the MemoryPlanner callback (profile, shapes, static bytes).
Lightning-free: it reads the strategy through a :class:`~lightning_pipe.strategies.context.PipelineContext`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe.planning.chunk_memory import ChunkMemory, chunk_memory, chunk_shapes
from lightning_pipe.planning.cost_model import MicrobatchShape
from lightning_pipe.planning.memory_lowering import lower_memory_plan
from lightning_pipe.planning.memory_model import (
    FULL,
    KEEP_ATTENTION,
    NONE,
    MemoryPlan,
    MemoryProfile,
    StageMemory,
    UnitMemory,
    fit_linear,
    parse_size,
)
from lightning_pipe.planning.memory_planner import MemoryPlanResult, plan_memory
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.profiling.memory_profile import (
    ProbeRecord,
    gather_records,
    measure_stages,
    probe_microbatches,
    sequence_lengths,
)
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime._torch_compat import record_found_inf, tree_flatten
from lightning_pipe.runtime.memory import DEFAULT_MLP_NAMES, MemoryRuntime
from lightning_pipe.runtime.memory_accounting import StepMemory
from lightning_pipe.runtime.optimizer_offload import StageOptimizers, StageStep
from lightning_pipe.runtime.packing import PackingPlan
from lightning_pipe.schedules import validate
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b
from lightning_pipe.schedules.ir import Program
from lightning_pipe.strategies.context import PipelineContext

log = logging.getLogger(__name__)

RecomputeSpec = Union[str, int, StageMemory, MemoryPlan, None]
"""``"none"``, ``"full"``, ``"keep_attention"``, ``"auto"``, every-k-th integer, StageMemory or MemoryPlan."""

# Optimizer state bytes per parameter byte, by optimizer class name (before the first step creates it).
_OPTIMIZER_STATE = {"Adam": 2.0, "AdamW": 2.0, "Adamax": 2.0, "NAdam": 2.0, "RAdam": 2.0, "Adagrad": 1.0,
                    "RMSprop": 1.0, "Adadelta": 2.0}


class StrategyMemory:
    """Memory plans, budget and probes of one ``ElasticPipelineStrategy``.

    Args:
        memory_budget: bytes per device (or a size text like ``"40GiB"``) for parameters, gradients,
            optimizer state and saved activations; None: no budget.
        recompute: see :data:`RecomputeSpec`; ``"auto"`` plans once, from the first batch, the
            fastest plan that fits ``memory_budget`` (with packing, every batch: each has its own chunks).
        offload: True, False, or blocks per stage whose saved activations go to host memory.
        mlp_chunk_size: chunk size for position-wise MLPs (HelixPipe), or None.
        mlp_modules: attribute names of the MLP submodules to chunk.
        planning_margin: fraction of the budget kept free when planning (measurement noise).
        optimizer_offload: per-stage host optimizers stepping during backward (SPipe,
            ``runtime/optimizer_offload.py``).

    With ``optimizer_offload`` and a gradient scaler (``precision="16-mixed"``), the strategy sets
    :attr:`grad_scaler`: each step's loss scale is read from it (:attr:`step_loss_scale`), the stage
    steps unscale and check their gradients, every rank agrees on the overflow, and the scaler's own
    update arithmetic runs on the agreed result (:meth:`_update_loss_scale`).
    """

    def __init__(
        self,
        memory_budget: str | int | None = None,
        recompute: RecomputeSpec = None,
        offload: bool | int = False,
        mlp_chunk_size: int | None = None,
        mlp_modules: Sequence[str] = DEFAULT_MLP_NAMES,
        planning_margin: float = 0.05,
        optimizer_offload: bool = False,
    ) -> None:
        try:
            self.budget: int | None = None if memory_budget is None else parse_size(memory_budget)
        except ValueError as error:
            raise ValueError(f"`memory_budget={memory_budget!r}`: {error}") from None
        self.auto = recompute == "auto"
        if self.auto and self.budget is None:
            raise ValueError("`recompute='auto'` chooses a plan under `memory_budget`: set `memory_budget` (e.g. '40GiB').")
        if isinstance(offload, bool) is False and (not isinstance(offload, int) or offload < 0):
            raise ValueError(f"`offload={offload!r}`: use True, False or a number of blocks per stage.")
        if mlp_chunk_size is not None and mlp_chunk_size < 1:
            raise ValueError(f"`mlp_chunk_size` must be None or >= 1, got {mlp_chunk_size}.")
        if isinstance(recompute, MemoryPlan):
            self.static_plan = recompute
        else:
            self.static_plan = MemoryPlan.from_options(None if self.auto else recompute, offload, mlp_chunk_size)
        self.mlp_chunk_size = mlp_chunk_size
        self.mlp_modules = tuple(mlp_modules)
        self.planning_margin = planning_margin
        self.plan: MemoryPlan = self.static_plan
        self.runtime: MemoryRuntime | None = None
        self.profile: MemoryProfile | None = None
        self.last_step: StepMemory | None = None
        self.last_result: MemoryPlanResult | None = None
        self.track = False  # account saved activations even without a budget or a plan
        self._context: PipelineContext | None = None
        self._planned_auto = False
        self._batch_tensors: list[Tensor] = []
        self.optimizer_offload = optimizer_offload
        self.stage_optimizers: StageOptimizers | None = None
        self.last_stage_steps: dict[int, StageStep] = {}
        self._offload_layout: tuple | None = None
        self.grad_scaler: torch.amp.GradScaler | None = None  # 16-mixed with optimizer offload
        self.step_loss_scale: float | None = None  # the loss scale of the running step (None: unscaled)
        self.last_overflow = False  # whether the last offloaded step was undone for a non-finite gradient
        self._loaded_optimizer_state: dict | None = None  # from a checkpoint, until the host optimizers exist
        self._lowered: tuple[Program, MemoryPlan, tuple[int, ...], Program] | None = None  # see program_with_plan

    # --- wiring ----------------------------------------------------------------------------------

    def setup(self, context: PipelineContext) -> None:
        """Create the rank's memory runtime (after the stage runner exists)."""
        self._context = context
        self.runtime = MemoryRuntime(
            context.runner.stack.blocks, context.device, context.layout.pipeline_rank,
            mlp_names=self.mlp_modules, budget_bytes=self.budget,
        )

    @property
    def context(self) -> PipelineContext:
        """The strategy's context (after :meth:`setup`)."""
        if self._context is None:
            raise RuntimeError("`StrategyMemory` is used before the strategy's setup gave it its context.")
        return self._context

    def install(self, plan: PipelinePlan, program: Program) -> None:
        """Adopt ``plan.memory`` (None: the static plan from the strategy's arguments).

        Raises:
            ValueError: ``keep_attention`` with a split-backward (zero-bubble) program.
        """
        memory = plan.memory if plan.memory is not None else self.static_plan
        split = program.splits_backward
        if split and memory.uses(KEEP_ATTENTION):
            raise ValueError(
                f"`recompute='keep_attention'` needs one backward pass per microbatch, but schedule {program.name!r} "
                "splits backward into I and W passes (selective checkpointing allows one). Use `recompute='full'` or a "
                "schedule without split backward (1f1b, gpipe, interleaved_1f1b)."
            )
        if self.stage_optimizers is not None and self._offload_layout != (tuple(plan.boundaries), program.stage_to_rank):
            raise ValueError(
                "`optimizer_offload=True` keeps each stage's optimizer on the host of the rank that runs it; a plan that "
                f"moves units (boundaries {tuple(plan.boundaries)}, placement {program.stage_to_rank}) is not supported. "
                "Disable repartitioning callbacks or `optimizer_offload`."
            )
        self.plan = memory

    def set_budget(self, budget: str | int | None) -> None:
        """Set the per-device budget enforced on accounted bytes."""
        self.budget = None if budget is None else parse_size(budget)
        if self.runtime is not None:
            self.runtime.counter.budget_bytes = self.budget

    @property
    def active(self) -> bool:
        """Whether steps run with block wrappers and saved-activation accounting."""
        return self.track or self.budget is not None or self.auto or self.optimizer_offload or not self.plan.is_empty

    # --- steps -----------------------------------------------------------------------------------

    def before_step(self, batch: Any, rest: tuple) -> Callable[[int, int], Any] | None:
        """Plan once for ``recompute='auto'``; the executor's ``block_wrapper`` for this step (or None)."""
        if self.auto and (not self._planned_auto or self._packs(batch)):
            # packed batches: every batch has its own chunks, planned per (stage, chunk) each step
            result = self.plan_batch(batch, rest, self.budget)
            self.static_plan = result.plan
            self.plan = result.plan
            self._planned_auto = True
        if not self.active or self.runtime is None:
            return None
        if self.optimizer_offload:
            self._step_microbatches = self.context.split_batch(batch).plan.num_microbatches
            self._start_optimizer_offload()
        # the batch is held by the loader anyway: saved views of it (token ids) are not activations
        self._batch_tensors = [leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, Tensor)]
        spans, plan, runtime = self.context.current().spans, self.plan, self.runtime

        def block_wrapper(stage: int, microbatch: int):
            span = spans[stage]
            choice = plan.choice(stage, microbatch)
            modes = choice.block_modes(span.end_block - span.first_block)
            return runtime.wrapper(stage, microbatch, span.first_block, modes, choice.mlp_chunk_size)

        return block_wrapper

    def program_with_plan(self, program: Program) -> Program:
        """``program`` with this step's memory plan written in as memory actions (``planning.memory_lowering``).

        Called after :meth:`before_step` (``recompute='auto'`` decides the plan there). The executor runs
        the actions as markers and the block wrapper of :meth:`before_step`, armed from the same plan,
        performs them, so the memory plan of a step can be read off the program it ran
        (``read_memory_plan(strategy.memory.program_with_plan(strategy.program))``). The last lowering is
        kept. Elastic-depth layout programs (which refuse memory plans) are returned as they are.
        """
        if self.plan.is_empty or type(program) is not Program or program.pair_ranks is not None:
            return program
        boundaries = tuple(self.context.current().boundaries)
        kept = self._lowered
        if kept is not None and kept[0] is program and kept[1] is self.plan and kept[2] == boundaries:
            return kept[3]
        lowered = validate(lower_memory_plan(program, self.plan, boundaries))
        self._lowered = (program, self.plan, boundaries, lowered)
        return lowered

    @contextlib.contextmanager
    def accounting(self, train: bool):
        """Count saved activations (and enforce the budget) around a training step's program."""
        if not train or not self.active or self.runtime is None:
            yield
            return
        excluded = self._owned_parameters() + self._batch_tensors
        with self.runtime.step(excluded, int(self.rank_static_bytes())) as step:
            yield
        self.last_step = step
        self._batch_tensors = []
        if self.stage_optimizers is not None:  # wait for the stage steps, weights back before the next forward
            scaled = self.step_loss_scale is not None
            self.last_overflow = self.stage_optimizers.finish(agree=self._agree_overflow if scaled else None)
            self.last_stage_steps = dict(self.stage_optimizers.records)
            if scaled:
                self._update_loss_scale(self.last_overflow)
            self.step_loss_scale = None

    # --- optimizer offload -----------------------------------------------------------------------

    def _start_optimizer_offload(self) -> None:
        if self.stage_optimizers is None:
            self.stage_optimizers = StageOptimizers(self._single_optimizer(), self._stage_parameters())
            current = self.context.current()
            self._offload_layout = (tuple(current.boundaries), current.program.stage_to_rank)
            if self._loaded_optimizer_state is not None:  # resumed: the checkpoint's state goes to the host
                self.stage_optimizers.load_state_dict(self._loaded_optimizer_state)
                self._loaded_optimizer_state = None
        self.step_loss_scale = self._current_loss_scale()
        self.stage_optimizers.start_step(self._step_microbatches, loss_scale=self.step_loss_scale)

    def offloaded_optimizer_state(self, optimizer: Optimizer) -> dict[str, dict[int, Any]] | None:
        """This rank's host-side state of ``optimizer`` for a checkpoint, or None if it is not offloaded.

        ``{"state": {index: state}, "master_weights": {index: master}}`` numbered like ``optimizer``
        (see :meth:`StageOptimizers.state_dict`). Before the first step of a resumed run, the state
        loaded from the checkpoint (not yet on the host optimizers, which the first step creates).
        """
        if not self.optimizer_offload:
            return None
        if self.stage_optimizers is not None and self.stage_optimizers.user_optimizer is optimizer:
            return self.stage_optimizers.state_dict()
        if self._loaded_optimizer_state is not None:
            return self._loaded_optimizer_state
        return None

    def load_offloaded_optimizer_state(self, state: dict[str, dict[int, Any]]) -> None:
        """Give the host optimizers the checkpoint's entries of this rank's parameters (now, or when the
        first step creates them), so a resumed run continues with the saved moments and masters."""
        if self.stage_optimizers is not None:
            self.stage_optimizers.load_state_dict(state)
        else:
            self._loaded_optimizer_state = state

    def _current_loss_scale(self) -> float | None:
        """The gradient scaler's scale for this step (None without an enabled scaler).

        ``GradScaler.scale`` creates the scale tensor on first use (from ``init_scale``, or from a
        loaded checkpoint's value), so it is called once on a dummy tensor before reading the scale.
        """
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return None
        scaler.scale(torch.ones((), device=self.context.device))
        return float(scaler.get_scale())

    def _agree_overflow(self, overflow: bool) -> bool:
        """Whether any rank (every pipeline and data-parallel rank) found a non-finite gradient.

        A collective over the default process group: all ranks undo their stage steps together, so
        replicas and stages never disagree about which updates happened.
        """
        if not collectives.is_initialized():
            return overflow
        flag = torch.tensor(float(overflow), device=self.context.device)
        collectives.all_reduce_tensor(flag, "max", "the agreement on a gradient overflow (16-mixed)")
        return bool(flag.item() > 0)

    def _update_loss_scale(self, overflow: bool) -> None:
        """Advance the scaler exactly as ``GradScaler.update`` does after ``scaler.step``.

        Lightning's ``unscale_``/``step`` never see the gradients here (the host optimizers own the
        step), so the agreed overflow is recorded as the scaler's found-inf for this iteration and its
        own ``update`` runs: backoff on overflow, growth after ``growth_interval`` clean steps, and the
        growth tracker reset, all in the scaler's state that Lightning checkpoints.
        """
        scaler = self.grad_scaler
        assert scaler is not None
        found_inf = torch.full((), float(overflow), dtype=torch.float32, device=self.context.device)
        record_found_inf(scaler, self.stage_optimizers, found_inf)
        scaler.update()

    def _single_optimizer(self) -> Optimizer:
        context = self.context
        trainer = context.module.trainer
        optimizers = context.optimizers()
        problems = []
        if len(optimizers) != 1:
            problems.append(f"{len(optimizers)} optimizers (one is supported)")
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} (1 is supported)")
        if trainer.gradient_clip_val:
            problems.append(f"gradient_clip_val={trainer.gradient_clip_val} (clipping needs every stage's gradients first)")
        if context.layout.data_parallel_size > 1:
            problems.append(f"data parallel size {context.layout.data_parallel_size} (gradients would have to be averaged first)")
        if context.current().shared_parameters:
            problems.append("parameters tied across ranks (their gradients are summed after the pipeline)")
        if problems:
            raise ValueError(f"`optimizer_offload=True` does not support: {'; '.join(problems)}.")
        optimizer = optimizers[0]
        return getattr(optimizer, "optimizer", optimizer)

    def _stage_parameters(self) -> dict[int, list]:
        current = self.context.current()
        layout = current.unit_layout
        params = dict(self.context.module.named_parameters())
        result = {}
        for stage, span in current.spans.items():
            units = [1 + b for b in range(span.first_block, span.end_block)]
            units += [0] if span.is_first else []
            units += [layout.num_units - 1] if span.is_last else []
            names = [n for u in units for n in layout.unit_names[u] if n in params]
            result[stage] = [params[n] for n in names if params[n].device.type != "meta"]
        return result

    def close(self) -> None:
        """Stop optimizer-offload threads (teardown)."""
        if self.stage_optimizers is not None:
            self.stage_optimizers.close()

    # --- numbers for planners --------------------------------------------------------------------

    def static_bytes_per_parameter_byte(self) -> float:
        """Parameter + gradient + optimizer state bytes per parameter byte (2 + the optimizer's states)."""
        optimizers = [getattr(o, "optimizer", o) for o in (self._context.optimizers() if self._context else [])]
        return 2.0 + max((_OPTIMIZER_STATE.get(type(o).__name__, _momentum(o)) for o in optimizers), default=0.0)

    def rank_static_bytes(self) -> float:
        """Static bytes this rank holds (its real parameters, their gradients and optimizer state)."""
        params = self._owned_parameters()
        return sum(p.numel() * p.element_size() for p in params) * self.static_bytes_per_parameter_byte()

    def _owned_parameters(self) -> list[Tensor]:
        return [p for p in self.context.module.parameters() if p.device.type != "meta"]

    def microbatch_shapes(
        self, batch: Any, lengths: Callable[[Any], Sequence[int]] | None = None, plan: PipelinePlan | None = None
    ) -> list[MicrobatchShape]:
        """Shapes of the batch's microbatches as the strategy splits it (by ``plan``'s microbatching if given).

        Packed microbatches (chunks) are priced by their pieces (``planning/chunk_memory.py``:
        ``chunk_shapes``), not by the width of their packed row."""
        split = self.context.split_batch(batch, plan)
        if isinstance(split.plan, PackingPlan):
            return chunk_shapes(split.plan.pieces)
        measure = lengths or sequence_lengths
        shape = self.profile.shape if self.profile is not None else MicrobatchShape.from_lengths
        return [shape(measure(mb)) for mb in split.microbatches]

    def chunk_memory(self, batch: Any, plan: PipelinePlan | None = None) -> ChunkMemory | None:
        """What the batch's packed and sliced microbatches keep per block beyond the memory profile
        (masks, a slice's context, the key/value store; ``planning/chunk_memory.py``), or None when
        the strategy does not pack."""
        packing = self.context.split_batch(batch, plan).plan
        if not isinstance(packing, PackingPlan):
            return None
        assert self.profile is not None
        hidden = max(unit.hidden for unit in self.profile.units[1:-1]) if self.profile.num_blocks else 0
        element = next(
            (p.element_size() for p in self.context.module.parameters() if p.is_floating_point()), 4
        )
        backend = packing.packer.attention_backend
        masked = backend == "masked_sdpa" or (backend is None and self.context.device.type != "cuda")
        return chunk_memory(packing.pieces, packing.sequence_lengths, hidden, element, masked=masked)

    def _packs(self, batch: Any) -> bool:
        return isinstance(self.context.split_batch(batch).plan, PackingPlan)

    def _program_for_split(self, batch: Any, plan: PipelinePlan | None, count: int) -> Program | None:
        """Sliced 1F1B when the batch's packing cuts sequences into slices (what the step will run)."""
        packing = self.context.split_batch(batch, plan).plan
        if isinstance(packing, PackingPlan) and packing.is_sliced:
            program = sliced_1f1b(self.context.pipeline_parallel_size, count, packing.slices, packing.pipelines)
            validate(program)
            return program
        return None

    def measure_profile(self, batch: Any, rest: tuple = (0,), probe_length: int | None = 512) -> MemoryProfile:
        """Probe this rank's stages on the batch's first microbatch, share with the pipeline, fit."""
        context, current = self.context, self.context.current()
        assert self.runtime is not None
        first = context.split_batch(batch).microbatches[0]
        probes = [(p, *rest) for p in probe_microbatches(first, probe_length)]
        records = measure_stages(
            context.runner, self.runtime, "training_step", probes, list(current.spans.values()),
            self._owned_parameters(), context.device, step_context=context.train_step_context,
        )
        records = gather_records(records, context.groups.pipeline if context.pipeline_parallel_size > 1 else None)
        self.profile = build_profile(records, context.module, current.unit_layout, self.static_bytes_per_parameter_byte())
        return self.profile

    def plan_batch(
        self, batch: Any, rest: tuple = (0,), budget: int | None = None, lengths: Callable | None = None,
        plan: PipelinePlan | None = None, **planner_options: Any,
    ) -> MemoryPlanResult:
        """The fastest plan under ``budget`` for this batch (probing first if no profile yet), for the
        running partition, family and microbatches, or those of ``plan`` (a draft being merged).

        The pipeline's first rank plans and sends the plan to the others (a collective of the
        pipeline): the MILP stops at its time limit, which may come at different points on different
        ranks, and every rank of a pipeline must run the same plan."""
        return self.share_plan(self.memory_request(batch, rest, budget, lengths, plan, **planner_options))

    def memory_request(
        self, batch: Any, rest: tuple = (0,), budget: int | None = None, lengths: Callable | None = None,
        plan: PipelinePlan | None = None, **planner_options: Any,
    ) -> MemoryRequest:
        """What :meth:`plan_batch` plans for this batch (probing first if no profile yet, a collective),
        as plain data: equal requests get equal plans, so a planner may solve one ahead of time."""
        current = self.context.current()
        budget = self.budget if budget is None else budget
        if budget is None:
            raise ValueError("No memory budget: pass `budget=` to MemoryPlanner or `memory_budget=` to the strategy.")
        if self.profile is None:
            self.measure_profile(batch, rest)
        shapes = self.microbatch_shapes(batch, lengths, plan)
        options = {"mlp_chunk_size": self.mlp_chunk_size, **planner_options}
        program = current.program if plan is None else self.context.program_for_plan(plan)
        boundaries = current.boundaries if plan is None else plan.boundaries
        sliced = self._program_for_split(batch, plan, len(shapes))
        if sliced is not None:
            program = sliced
        elif len(shapes) != program.num_microbatches:  # a short batch, or packed: microbatches not the plan's count
            schedule = current.schedule if plan is None else plan.schedule
            program = self.context.program_for_plan(PipelinePlan(boundaries, schedule, len(shapes)))
        return MemoryRequest(
            program, tuple(boundaries), tuple(shapes), self.profile, budget * (1.0 - self.planning_margin),
            self.chunk_memory(batch, plan), tuple(options.items()),
        )

    @property
    def plans_here(self) -> bool:
        """Whether this rank solves its pipeline's memory plans (the pipeline's first rank)."""
        return self.context.global_rank == self.context.layout.pipeline_ranks()[0]

    def share_plan(self, request: MemoryRequest | None, solved: MemoryPlanResult | None = None) -> MemoryPlanResult:
        """The pipeline's first rank solves ``request`` (or takes ``solved``, solved ahead), every rank gets it
        (``request`` is read on the first rank only)."""
        first = self.context.layout.pipeline_ranks()[0]
        result = None
        if self.plans_here:  # one rank decides: the MILP's time limit may end differently elsewhere
            result = solved if solved is not None else request.solve()
        if self.context.layout.pipeline_parallel_size > 1:
            result = collectives.broadcast_object(
                result, first, self.context.groups.pipeline, f"the memory plan of rank {first} (its pipeline's first)"
            )
        self.last_result = result
        log.debug("memory plan (%s): %s", result.method, result.plan.to_dict())
        return result


@dataclass(frozen=True, eq=True)
class MemoryRequest:
    """Everything a memory plan is solved from (``planning.memory_planner.plan_memory``'s arguments)."""

    program: Program
    boundaries: tuple[int, ...]
    shapes: tuple[MicrobatchShape, ...]
    profile: MemoryProfile
    budget: float
    chunks: ChunkMemory | None
    options: tuple[tuple[str, Any], ...]

    def solve(self) -> MemoryPlanResult:
        """The plan (pure computation: safe on a lookahead thread)."""
        return plan_memory(
            self.program, self.boundaries, list(self.shapes), self.profile, self.budget, chunks=self.chunks,
            **dict(self.options),
        )


def _momentum(optimizer: Optimizer) -> float:
    return 1.0 if any(group.get("momentum", 0) for group in optimizer.param_groups) else 0.0


def build_profile(records: list[ProbeRecord], module: torch.nn.Module, layout: Any, static_per_byte: float) -> MemoryProfile:
    """Fit per-unit linear saved bytes from probe records; parameter sizes from the module (meta included)."""
    offsets = sorted(r.lengths[0] - r.positions for r in records if r.positions > 0 and r.lengths)
    offset = offsets[len(offsets) // 2] if offsets and offsets[0] >= 0 else 0
    summed: dict[tuple, int] = defaultdict(int)
    hidden: dict[int, int] = defaultdict(int)
    for r in records:
        summed[(r.unit, r.mode, r.lengths)] += r.saved_bytes
        hidden[r.unit] = max(hidden[r.unit], r.hidden)
    per_unit: dict[tuple[int, str], list] = defaultdict(list)
    for (unit, mode, lengths), nbytes in summed.items():
        shape = MicrobatchShape.from_lengths([max(1, n - offset) for n in lengths])
        per_unit[(unit, mode)].append((shape, float(nbytes)))
    tensors = dict(module.named_parameters(remove_duplicate=False))
    units = []
    for unit, names in enumerate(layout.unit_names):
        params = [tensors[n] for n in names if n in tensors]
        saved = {}
        for mode in (NONE, FULL, KEEP_ATTENTION):
            points = per_unit.get((unit, mode))
            if points:
                saved[mode] = fit_linear(points)
        if NONE not in saved:
            raise RuntimeError(f"The memory probe measured nothing for unit {unit}; every unit must be owned by a rank.")
        name = "pre" if unit == 0 else "post" if unit == layout.num_units - 1 else f"block.{unit - 1}"
        units.append(
            UnitMemory(
                name, saved, parameter_bytes=float(sum(p.numel() * p.element_size() for p in params)),
                parameters=float(sum(p.numel() for p in params)), hidden=hidden[unit],
            )
        )
    return MemoryProfile(tuple(units), static_per_byte, offset)
