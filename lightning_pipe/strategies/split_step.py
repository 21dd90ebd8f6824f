"""``schedule="helix"`` (HelixPipe) and ``schedule="spipe"`` (SPipe) inside ``ElasticPipelineStrategy``.

Split-placement programs (``Program.pair_ranks``) run a stage's actions on several ranks, so the
strategy's contiguous stages, sharding and ``PipelineExecutor`` do not apply to them. The strategy
hands its setup, step, gradient synchronization and gradient norm to :class:`SplitPlacement` (one line
each); everything else (the microbatch plan, loss weights, log replay, metrics, clipping, accumulation,
checkpoints) is the strategy's own:

* **helix**: each block is cut at its attention (``model/sub_blocks.py``) on the first training batch,
  with the arguments the step gives block 0; the program's stages run the user's step through the
  stage runner (``runtime/helix.StepHelixStages``). Then each rank keeps only the parameters its units
  read (``runtime/helix.helix_holdings``: pre-attention of block ``l`` on rank ``l mod p``, its
  post-attention on the next rank, embedding and head side on rank 0); the rest become meta in the
  module and the optimizers, as a migration drops what a rank no longer holds. Every gradient is then
  whole on its one holder: no gradient sum, the clipping norm is summed over the pipeline. A model
  whose units would need one parameter on two ranks keeps the whole module on every rank, with the
  gradients summed over the pipeline after the step (every rank steps the same values).
  ``mlp_chunk_size`` runs each post-attention unit's MLP in sequence chunks (``SubBlockUnits.chunk_mlp``).
* **spipe**: parameters live in host shared memory, mapped by every process of the machine
  (``share_memory`` in the main process before the ranks fork). Stages are ranges of whole blocks
  (``runtime/spipe.StepSPipeStages``); the backward of a stage runs on another rank than its forward,
  which recomputes it from the checkpoint sent ahead. After the step the gradients are summed over the
  pipeline and each parameter is stepped by one rank only, its *owner* (the highest rank that computed
  a gradient for it: the backward rank of its stage), with the user's optimizer; the other ranks hold
  no gradient and no optimizer state for it. A barrier after every optimizer step (and one before
  every training step, for the stage optimizers' writes) lets the owners' updates land before any
  process reads the shared parameters again: the next forwards, and the state that checkpoints and the
  end of training gather from every process (without it, a process could gather a parameter its owner
  is still updating).

Evaluation (``validation_step``, ``test_step``, ``predict_step``) of a sharded helix module runs the
program's forwards (``F`` and their sends) through the pipeline, the last stage's logs replayed as in
training; otherwise (spipe, a helix module before its first training batch) every pipeline rank runs
the user's whole step (each holds or maps every parameter): exact, not pipelined.

Data parallelism: each replica's pipeline runs the program; after the pipeline's sum the gradients are
averaged over the replicas (spipe: every process of the machine maps the same parameters, and only
the owner in replica 0 steps each one).

Refused, with what to change: memory plans (``mlp_chunk_size`` too for spipe), packing, elastic
depth, ``plan="auto"``, explicit partitions, planning callbacks, devices other than the CPU, optimizer
offload for helix (and for spipe with data parallelism), and for spipe any start method but
``"fork"``, several nodes and modules that build layers in ``configure_model``.
SPipe's asynchronous per-stage host optimizers (``optimizer_offload=True``) run on the ranks of the
stages' backwards (one optimizer, no clipping or accumulation, no weights tied across those ranks).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe.model import StageRunner, analyze_units, find_blocks, move_real_tensors
from lightning_pipe.model._torch_compat import tree_flatten
from lightning_pipe.model.metrics import MetricStates, metrics_inert
from lightning_pipe.runtime import PointToPoint, collectives
from lightning_pipe.runtime.executor import StepOutcome, extract_loss
from lightning_pipe.runtime.helix import StepHelixStages, capture_block_call, helix_holdings, split_stack
from lightning_pipe.runtime.loss_weights import DeferredNormalization, raw_weight, upfront_weights
from lightning_pipe.runtime.migration import migrate
from lightning_pipe.runtime.optimizer_offload import StageOptimizers
from lightning_pipe.runtime.spipe import StepSPipeStages, check_shared_parameters
from lightning_pipe.runtime.split_executor import SplitPlacementExecutor
from lightning_pipe.runtime.split_step import LastStageRecorder, check_last_stage, run_split_step
from lightning_pipe.schedules import ActionType, Schedule, is_split_placement, split_program

__all__ = ["SplitPlacement"]

log = logging.getLogger(__name__)

# strategy argument -> its default; any other value is refused with split placement
_UNSUPPORTED = {
    "memory_budget": None, "recompute": None, "offload": False, "mlp_chunk_size": None, "optimizer_offload": False,
    "ranks_per_device": 1, "packing": False, "elastic_depth": False, "plan": "static",
}
# SPipe's asynchronous per-stage host optimizers; HelixPipe's chunked MLP
_SUPPORTED_BY = {"spipe": {"optimizer_offload"}, "helix": {"mlp_chunk_size"}}
# lightning_pipe.callbacks that plan or measure through the strategy's cost and memory models (by name: the
# strategies layer does not import callbacks)
_PLANNERS = frozenset(
    {"ElasticRepartition", "ElasticDepth", "MemoryPlanner", "ScheduleSwitch", "AutoPlanner", "PipelineProfiler"}
)


class SplitPlacement:
    """The strategy's setup, step and gradient handling for a HelixPipe or SPipe schedule.

    Args:
        schedule: the resolved ``"helix"`` or ``"spipe"`` schedule.
        arguments: the strategy's constructor arguments (checked for what split placement cannot do).

    Raises:
        ValueError: an argument split placement does not support, naming it.
    """

    def __init__(self, schedule: Schedule, arguments: dict[str, Any]) -> None:
        self.schedule = schedule
        self.kind = schedule.name
        for name, default in _UNSUPPORTED.items():
            if name not in _SUPPORTED_BY.get(self.kind, ()) and arguments.get(name, default) != default:
                raise ValueError(
                    f"`ElasticPipelineStrategy(schedule={self.kind!r})` does not support `{name}={arguments[name]!r}` "
                    f"(split placement runs its own program; docs/schedules.md). Leave `{name}` at its default or use "
                    "a schedule such as '1f1b'."
                )
        partition = arguments.get("partition", "balanced")
        if partition not in ("balanced", "uniform"):
            raise ValueError(
                f"`ElasticPipelineStrategy(schedule={self.kind!r})` places blocks by its own rule; `partition={partition!r}` "
                "cannot apply. Leave `partition` at its default."
            )
        if self.kind == "spipe" and arguments.get("start_method") != "fork":
            raise ValueError(
                "`ElasticPipelineStrategy(schedule='spipe')` keeps parameters in host shared memory that every rank maps, "
                "set up before the ranks start: pass `start_method='fork'` (processes started another way would each "
                f"hold their own copy), got `start_method={arguments.get('start_method')!r}`."
            )
        self.program = None
        self.stages: Any = None
        self.executor: SplitPlacementExecutor | None = None
        self._owners: dict[int, int] | None = None
        self.optimizer_offload = bool(arguments.get("optimizer_offload", False))
        self.mlp_chunk_size: int | None = arguments.get("mlp_chunk_size")
        self.sharded = False  # helix: parameters sharded by sub-block unit (after the first training batch)
        self.forward_program = None
        self.stage_optimizers: StageOptimizers | None = None

    @staticmethod
    def create(schedule: Schedule, arguments: dict[str, Any]) -> SplitPlacement | None:
        """A :class:`SplitPlacement` for a split-placement ``schedule``, else None."""
        return SplitPlacement(schedule, arguments) if is_split_placement(schedule) else None

    # --- before the processes start and at setup ---------------------------------------------------

    def validate_module(self, strategy: Any, module: Any) -> None:
        """Check the module fits the program (called in the main process before any rank starts, and on every
        rank at setup, where the trainer's callbacks are known); for spipe, move its parameters to host shared
        memory (before the fork)."""
        if strategy.layout.data_parallel_size > 1 and self.optimizer_offload:
            raise ValueError(
                "`schedule='spipe'` with `optimizer_offload=True` does not support data parallelism (the stage steps run "
                f"before the replicas' gradients are averaged): {strategy.world_size} processes with "
                f"`pipeline_parallel_size={strategy.pipeline_parallel_size}`. Turn `optimizer_offload` off or use as "
                "many devices as pipeline ranks."
            )
        if strategy.root_device.type != "cpu":
            raise ValueError(f"`schedule={self.kind!r}` runs on the CPU only so far (got {strategy.root_device}); use "
                             "`accelerator='cpu'` or another schedule.")
        trainer = getattr(module, "_trainer", None)
        planners = [type(c).__name__ for c in getattr(trainer, "callbacks", None) or [] if type(c).__name__ in _PLANNERS]
        if planners:
            raise ValueError(
                f"`schedule={self.kind!r}` runs a fixed split-placement program, which the planning callbacks "
                f"{planners} cannot change (nor price: their cost models know stages placed whole on one rank). "
                "Remove them, or use a schedule such as '1f1b'."
            )
        if self.kind == "spipe" and strategy.num_nodes > 1:
            raise ValueError("`schedule='spipe'` shares parameters in one machine's memory: use one node.")
        from lightning.pytorch.utilities.model_helpers import is_overridden

        if is_overridden("configure_model", module):
            if self.kind == "spipe":
                raise ValueError(
                    "`schedule='spipe'` needs the module's parameters before the ranks start (they go to shared memory "
                    "then): build the layers in `__init__`, not in `configure_model`."
                )
            return
        stack = find_blocks(module, strategy._blocks)
        split_program(self.schedule, strategy.pipeline_parallel_size, strategy.num_microbatches, len(stack.blocks))
        if self.kind == "spipe":
            module.share_memory()  # no-op for tensors already shared (at setup on the forked ranks)

    def setup(self, strategy: Any) -> None:
        """What ``ElasticPipelineStrategy._shard`` does for other schedules: program, stage runner, executor."""
        module = strategy.lightning_module
        stack = find_blocks(module, strategy._blocks)
        num_blocks = len(stack.blocks)
        program = split_program(self.schedule, strategy.pipeline_parallel_size, strategy.num_microbatches, num_blocks)
        check_last_stage(program)
        if self.kind == "spipe":  # every process of the machine (all replicas) maps the same parameters
            check_shared_parameters(module, None, strategy.global_rank)
        strategy.unit_layout = analyze_units(module, stack)
        # the plan's record (checkpoints, planners' merge): the strategy's default cut for the pipeline ranks
        strategy.boundaries = tuple(strategy.default_boundaries(strategy.pipeline_parallel_size))
        strategy.program, strategy.eval_program, strategy.spans = program, None, {}
        strategy._trim_padding = False  # microbatches run uncut (exact; the trimming check needs the 1F1B runtime)
        if self.sharded and module.trainer.state.fn == TrainerFn.FITTING:
            raise RuntimeError(
                "`trainer.fit` again in the processes where schedule='helix' already cut and sharded the module (each "
                "rank holds only its units' parameters, which a new optimizer cannot cover): resume from a "
                "checkpoint in a new run instead (`ckpt_path=`)."
            )
        move_real_tensors(module, strategy.root_device)  # a module sharded by an earlier call keeps its meta parameters
        strategy.runner = StageRunner(module, stack, device=strategy.root_device)
        strategy.executor = None
        strategy._shared = []
        strategy.metric_states = MetricStates(module, strategy.groups.data_parallel)
        self.p2p = PointToPoint(strategy.groups.pipeline, timeout=strategy._timeout)
        if self.sharded:  # validate/test/predict after fit in the same processes: the module stays cut
            self.stages.runner = strategy.runner
            layout = strategy.layout
            self.executor = SplitPlacementExecutor(
                self.stages, self.p2p, layout.pipeline_ranks(), layout.pipeline_rank, strategy.root_device
            )
            return
        self.program, self.stages, self._owners, self.executor = program, None, None, None

    def _prepare(self, strategy: Any, step_name: str, example: tuple) -> None:
        """On the first training batch: the stages (helix: blocks cut at their attention, captured with the
        arguments the step gives block 0) and the executor."""
        module, runner = strategy.lightning_module, strategy.runner
        with torch.random.fork_rng(devices=[]), metrics_inert(module):
            if self.kind == "helix":
                units = split_stack(module, runner.stack, step_name, example)
            else:
                args, kwargs = capture_block_call(module, runner.stack.blocks[0], step_name, example)
                with torch.no_grad():
                    output = runner.stack.blocks[0](*args, **kwargs)
                count = sum(isinstance(t, Tensor) for t in tree_flatten(output)[0])
                self.stages = StepSPipeStages(runner, self.program.num_stages, count, step_name, loss=_loss_of(step_name))
        if self.kind == "helix":
            units = self._shard(strategy, units)
            if self.mlp_chunk_size:  # HelixPipe's chunked MLP, inside each post-attention unit
                units = [u.chunk_mlp(self.mlp_chunk_size) for u in units]
            self.stages = StepHelixStages(runner, units, step_name, loss=_loss_of(step_name))
        if self.kind == "spipe" and strategy.world_size > 1:
            # an owner's update must be complete before any process reads the shared parameters again: the next
            # step's forwards, and the state a checkpoint or the end of training gathers from every process
            for optimizer in strategy.optimizers:
                inner = getattr(optimizer, "optimizer", optimizer)
                inner.register_step_post_hook(
                    lambda *args: collectives.barrier(operation="the barrier after an SPipe optimizer step")
                )
        layout = strategy.layout
        self.executor = SplitPlacementExecutor(
            self.stages, self.p2p, layout.pipeline_ranks(), layout.pipeline_rank, strategy.root_device
        )

    def _shard(self, strategy: Any, units: list) -> list:
        """HelixPipe's parameter layout: each rank keeps the parameters of the sub-block units it runs
        (``runtime/helix.helix_holdings``), the others become meta in the module and the optimizers (as a
        migration drops what a rank no longer holds). The units are rebound to the sharded blocks. A
        parameter the units would need on two ranks (or on none) keeps the module whole on every rank."""
        module, runner, layout = strategy.lightning_module, strategy.runner, strategy.unit_layout
        p = strategy.pipeline_parallel_size
        holdings = helix_holdings(module, runner.stack, units, layout.unit_names[0], layout.unit_names[-1], p)
        if holdings is None or p == 1:
            log.info("rank %d: helix keeps the whole module on every rank (a parameter is used by units of two "
                     "ranks, or by none)", strategy.global_rank)
            return units
        buffers = {name for name, _ in module.named_buffers(remove_duplicate=False)}
        me = strategy.layout.pipeline_rank
        migrate(module, [], holdings[me] | buffers, me, strategy.layout.pipeline_ranks(), strategy.groups.pipeline,
                strategy.optimizers, strategy.root_device)
        runner.parameters_changed()
        self.sharded = True
        return [units[0].rebind(block) for block in runner.stack.blocks]

    # --- the step --------------------------------------------------------------------------------

    def run(self, strategy: Any, step_name: str, args: tuple, train: bool) -> tuple[Tensor | None, StepOutcome]:
        """One step: the pipelined training step, or the whole evaluation step on this rank."""
        module = strategy.lightning_module
        if self.kind == "spipe" and strategy.world_size > 1:  # the owners' last updates are in place
            collectives.barrier(operation="the barrier before an SPipe step")
        if not train and self.sharded:
            return self._run_forward_only(strategy, step_name, args)
        if not train:  # every parameter is here (replicated, shared, or not yet sharded): the whole step
            output = getattr(module, step_name)(*args)
            return None, StepOutcome(step_outputs={0: output})
        batch, rest = args[0], args[1:]
        split = strategy.split_batch(batch, train=True)
        plan, microbatches = split.plan, split.microbatches
        if plan.num_microbatches != strategy.num_microbatches:
            raise ValueError(
                f"A batch has {plan.num_microbatches} microbatches' worth of samples, fewer than `num_microbatches="
                f"{strategy.num_microbatches}`, and schedule {self.kind!r} runs a fixed count. Use `drop_last=True` in "
                "the dataloader, or a batch size that is a multiple of the microbatches."
            )
        steps = [(mb, *rest) for mb in microbatches]
        if self.executor is None:
            self._prepare(strategy, step_name, steps[0])
        accumulate = module.trainer.accumulate_grad_batches
        weights = upfront_weights(strategy.loss_weights, microbatches, plan.sizes)
        deferred = None
        if self.optimizer_offload:  # the stage steps run during backward: weights must be known before it
            self._start_stage_optimizers(strategy, len(steps))
            scales = [w / accumulate for w in weights]
            recorder = LastStageRecorder(module, steps, None, _loss_of(step_name))
        elif strategy.loss_weights == "auto":  # counted targets are known after each forward: normalise after the step
            deferred = DeferredNormalization(list(module.parameters()))
            deferred.begin()
            sizes = plan.sizes
            scales = [1.0 / accumulate] * len(steps)
            recorder = LastStageRecorder(module, steps, lambda mb, record: raw_weight(record, sizes[mb]), _loss_of(step_name))
        else:
            scales = [w / accumulate for w in weights]
            recorder = LastStageRecorder(module, steps, None, _loss_of(step_name))
        self.stages.recorder, self.stages.step_name = recorder, step_name
        if strategy.metric_states and strategy._runs_last_stage():
            strategy.metric_states.begin()
        outcome = run_split_step(self.executor, self.program, steps, scales, recorder)
        if self.stage_optimizers is not None:  # wait for this rank's stage steps; results into the shared parameters
            self.stage_optimizers.finish()
        strategy.last_outcome = outcome
        return strategy._share_outcome(step_name, outcome, plan, weights, True, deferred)

    def _run_forward_only(self, strategy: Any, step_name: str, args: tuple) -> tuple[None, StepOutcome]:
        """An evaluation step of a sharded helix module: the program's forwards only."""
        module = strategy.lightning_module
        batch, rest = args[0], args[1:]
        split = strategy.split_batch(batch, train=False)
        plan, microbatches = split.plan, split.microbatches
        if plan.num_microbatches != self.program.num_microbatches:
            raise ValueError(
                f"An evaluation batch splits into {plan.num_microbatches} microbatches, and schedule 'helix' runs "
                f"{self.program.num_microbatches}: use evaluation batches of at least `num_microbatches` samples "
                "(`drop_last=True`)."
            )
        if self.forward_program is None:
            kept = (ActionType.FORWARD, ActionType.SEND_F, ActionType.RECV_F)
            actions = tuple(tuple(a for a in row if a.type in kept) for row in self.program.actions)
            self.forward_program = dataclasses.replace(self.program, name=f"{self.program.name} (forward)", actions=actions)
        steps = [(mb, *rest) for mb in microbatches]
        recorder = LastStageRecorder(module, steps, None, _loss_of(step_name), train=False)
        self.stages.recorder, self.stages.step_name = recorder, step_name
        if strategy.metric_states and strategy._runs_last_stage():
            strategy.metric_states.begin()
        outcome = run_split_step(self.executor, self.forward_program, steps, [1.0] * len(steps), recorder)
        strategy.last_outcome = outcome
        return strategy._share_outcome(step_name, outcome, plan, list(plan.weights), False, None)

    def _start_stage_optimizers(self, strategy: Any, num_microbatches: int) -> None:
        """SPipe's per-stage host optimizers (``runtime/optimizer_offload.StageOptimizers``) for the stages whose
        backward runs on this rank: each steps on a thread once its parameters' gradients are final."""
        if self.stage_optimizers is None:
            optimizer = self._single_optimizer(strategy)
            stage_params = self._stage_parameters(strategy)
            self.stage_optimizers = StageOptimizers(optimizer, stage_params)
            loaded = strategy.memory.offloaded_optimizer_state(optimizer)  # a resumed run's entries, if any
            if loaded is not None:
                self.stage_optimizers.load_state_dict(loaded)
            strategy.memory.stage_optimizers = self.stage_optimizers  # checkpoints read the host state there
        self.stage_optimizers.start_step(num_microbatches)

    def _single_optimizer(self, strategy: Any) -> Optimizer:
        trainer = strategy.lightning_module.trainer
        problems = []
        if len(strategy.optimizers) != 1:
            problems.append(f"{len(strategy.optimizers)} optimizers (one is supported)")
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"accumulate_grad_batches={trainer.accumulate_grad_batches} (1 is supported)")
        if trainer.gradient_clip_val:
            problems.append(f"gradient_clip_val={trainer.gradient_clip_val} (clipping needs every stage's gradients first)")
        if problems:
            raise ValueError(f"`schedule='spipe'` with `optimizer_offload=True` does not support: {'; '.join(problems)}.")
        optimizer = strategy.optimizers[0]
        return getattr(optimizer, "optimizer", optimizer)

    def _stage_parameters(self, strategy: Any) -> dict[int, list[Tensor]]:
        """Per stage whose backward runs on this rank, its parameters (blocks, and pre / post units)."""
        module, layout, program = strategy.lightning_module, strategy.unit_layout, self.program
        params = dict(module.named_parameters())
        per_stage = layout.num_blocks // program.num_stages
        me = strategy.layout.pipeline_rank
        result: dict[int, list[Tensor]] = {}
        seen: dict[str, int] = {}
        for stage in range(program.num_stages):
            units = [1 + b for b in range(stage * per_stage, (stage + 1) * per_stage)]
            units += [0] if stage == 0 else []
            units += [layout.num_units - 1] if stage == program.num_stages - 1 else []
            names = [n for u in units for n in layout.unit_names[u] if n in params]
            owner = program.backward_rank(stage, 0)
            for name in names:
                if seen.setdefault(name, owner) != owner:
                    raise ValueError(
                        f"`schedule='spipe'` with `optimizer_offload=True`: parameter `{name}` is used by stages whose "
                        f"backward runs on ranks {seen[name]} and {owner} (tied weights), so no single stage step sees "
                        "its whole gradient. Untie it or turn `optimizer_offload` off."
                    )
            if owner == me:
                result[stage] = [params[n] for n in names]
        return result

    # --- after the step ------------------------------------------------------------------------------

    def synchronize_gradients(self, strategy: Any, optimizer: Optimizer) -> None:
        """Sum every gradient over the pipeline (each was computed on one rank, or two for a parameter used by
        two stages); spipe: keep it only on the parameter's owner, which alone steps it."""
        params = strategy._owned_parameters(optimizer)
        group, layout = strategy.groups.pipeline, strategy.layout
        if self.kind == "spipe":
            owners = self._owners_of(params, strategy)
        if not self.sharded:  # sharded helix: every parameter lives on the one rank whose units use it
            collectives.reduce_gradients(params, group, operation=f"the {self.kind} gradient sum over the pipeline")
        collectives.average_gradients(  # each replica's pipeline ranks hold the same parameters, in one order
            params, strategy.groups.data_parallel, layout.data_parallel_size,
            operation=f"the {self.kind} gradient average over data-parallel replicas",
        )
        if self.kind == "spipe":  # one process steps each shared parameter: its owner in replica 0
            inner = getattr(optimizer, "optimizer", optimizer)
            me = layout.pipeline_rank
            for param in params:
                if owners.get(id(param), me) != me or layout.data_parallel_rank != 0:
                    param.grad = None
                    inner.state.pop(param, None)  # state of another process's parameter (a loaded checkpoint's)

    def _owners_of(self, params: list[Tensor], strategy: Any) -> dict[int, int]:
        """``id(parameter) -> pipeline rank`` stepping it: the highest rank that computed its gradient (the
        same program every step: decided once, with the first step that computed each)."""
        me = strategy.layout.pipeline_rank
        known = self._owners or {}
        flags = torch.tensor([float(me + 1) if p.grad is not None else 0.0 for p in params], dtype=torch.float64)
        collectives.all_reduce_tensor(flags, "max", "the SPipe parameter owners", strategy.groups.pipeline)
        owners = dict(known)
        for param, flag in zip(params, flags.tolist()):
            if flag > 0 and id(param) not in owners:
                owners[id(param)] = int(flag) - 1
        self._owners = owners
        return owners

    def global_norm(self, strategy: Any, grads: list[Tensor]) -> Tensor:
        """The gradient norm for clipping: helix's gradients are whole on every rank after the sum; spipe's
        are spread over their owners."""
        squares = [g.double().pow(2).sum() for g in grads]
        local = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=strategy.root_device)
        if self.kind == "helix" and not self.sharded:
            return local.sqrt()
        return collectives.global_norm(local, strategy.groups.pipeline)

    def refuse_plan(self) -> None:
        """Plans from callbacks (partitions, families, memory plans) do not apply to split placement."""
        raise ValueError(
            f"`schedule={self.kind!r}` runs a fixed split-placement program; plans proposed by callbacks (partition, "
            "schedule family, microbatches, memory plan) cannot apply to it. Remove the planning callbacks."
        )


def _loss_of(step_name: str) -> Callable[[Any], Tensor]:
    """Picks the loss from what ``step_name`` returns (the same rule and message as the executor's)."""
    return functools.partial(extract_loss, step_name=step_name)
