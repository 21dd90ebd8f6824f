"""``ElasticPipelineStrategy``: pipeline-parallel training of an unchanged LightningModule.

The strategy is Lightning glue: each hook below is a few lines that hand the work to ``model/``
(find blocks and units, run stages of the user's steps), ``runtime/`` (execute a program, move
tensors, collectives) and ``schedules/`` (the program). See docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipe.model import (
    StageRunner,
    StageSpan,
    analyze_units,
    find_blocks,
    move_real_tensors,
    owned_units,
    shard_module,
)
from lightning_pipe.model.attention import KeyValueStore
from lightning_pipe.model.batch_checks import describe_modules, find_sample_mixing_modules, find_time_major_modules
from lightning_pipe.model.log_calls import reduce_log_calls
from lightning_pipe.model.metrics import MetricStates, metrics_inert
from lightning_pipe.model.observation import check_observation, layout_from_observation
from lightning_pipe.model.sharding import record_placement, recorded_placement
from lightning_pipe.model.units import UnitLayout
from lightning_pipe.planning.boundaries import check_boundaries
from lightning_pipe.planning.chunking import PlannedChunks, chunk_pieces
from lightning_pipe.planning.microbatching import padded_microbatch_sizes
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.planning.proposals import PlanProposal
from lightning_pipe.runtime import (
    PipelineExecutor,
    PointToPoint,
    ProcessGroups,
    RankLayout,
    StepWork,
    collectives,
    create_process_groups,
)
from lightning_pipe.runtime.failures import naming_failures
from lightning_pipe.runtime.groups import default_group, destroy_default_group_at_exit
from lightning_pipe.runtime.loss_weights import (
    DeferredNormalization,
    LossWeights,
    check_loss_weights,
    decide,
    raw_weight,
    upfront_weights,
)
from lightning_pipe.runtime.merge_tuning import MergeTuning
from lightning_pipe.runtime.microbatch import (
    BatchDim,
    MicrobatchPlan,
    SplitBatch,
    batch_contents,
    batch_size_of,
    plan_microbatches,
    tensor_shapes,
)
from lightning_pipe.runtime.migration import MigrationReport, holders_of, migrate, plan_transfers
from lightning_pipe.runtime.outcome_channel import OutcomeChannel
from lightning_pipe.runtime.packing import (
    REFUSAL,
    Packer,
    PackingPlan,
    check_microbatch,
    packed_block_wrapper,
    packing_difference,
    planned_chunker,
    slicing_difference,
)
from lightning_pipe.runtime.padding_check import TrimVerdict, check_trimming
from lightning_pipe.runtime.regroup import LayoutExecutor
from lightning_pipe.runtime.sharded_checkpoint import create_checkpoint_group, is_sharded_checkpoint, remove_path
from lightning_pipe.runtime.side_runs import quiet_forward
from lightning_pipe.runtime.step_clock import StepClock
from lightning_pipe.schedules import (
    Program,
    Schedule,
    SplitBackward,
    forward_only,
    merge_split_backwards,
    merged_program,
    resolve_schedule,
    simulate,
    validate,
)
from lightning_pipe.schedules.action_rules import check_executable
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b
from lightning_pipe.strategies import _lightning_compat as compat
from lightning_pipe.strategies import checkpointing, distributed_checkpoint
from lightning_pipe.strategies.auto_plan import PlanMode, check_plan_mode, install_auto_planner
from lightning_pipe.strategies.context import PipelineContext, PipelineState
from lightning_pipe.strategies.costs import StrategyCosts
from lightning_pipe.strategies.distributed_checkpoint import ShardedCheckpoints
from lightning_pipe.strategies.memory import RecomputeSpec, StrategyMemory
from lightning_pipe.strategies.optimizer_checks import check_optimizers
from lightning_pipe.strategies.partitioning import check_budget_holds_stages, initial_partition
from lightning_pipe.strategies.plan_merging import PlanApplication, PlanGate, apply_proposals
from lightning_pipe.strategies.precision import install_global_norm_clipping
from lightning_pipe.strategies.regrouping import Regrouping
from lightning_pipe.strategies.split_step import SplitPlacement

log = logging.getLogger(__name__)

PartitionSpec = Union[Literal["uniform", "balanced", "auto"], list[int]]
ScheduleSpec = Union[str, dict[str, Any], Schedule]


_SPLIT_PLACED = (None, {})
"""The record of a module a split placement (helix, spipe) cut: nothing else can gather from it."""
_NEW_MODULE = (
    "Pass a new module for this call, or load a checkpoint of the trained one into a new module (`ckpt_path=...`)."
)


class ElasticPipelineStrategy(ParallelStrategy):
    """Train a LightningModule with pipeline parallelism (x data parallelism), without changing it.

    Args:
        pipeline_parallel_size: pipeline ranks per replica; the other factor of the process count is
            data parallel. None: all processes form one pipeline.
        num_microbatches: microbatches per batch; None: twice the number of pipeline ranks.
        schedule: a family name (``"1f1b"``, ``"gpipe"``, ...), a DSL spec (text or dict), or a
            :class:`~lightning_pipe.schedules.Schedule`. ``"helix"`` (HelixPipe) and ``"spipe"`` (SPipe,
            with ``start_method="fork"``) run one stage on several ranks (``strategies/split_step.py``;
            what they refuse: docs/schedules.md).
        blocks: dotted path of the repeated block stack (``"model.layers"``); None: auto-detect.
        partition: ``"uniform"`` (equal block counts), ``"balanced"`` (by parameter count), the
            number of blocks of each stage (``[3, 3, 2]``), or ``"auto"``: before the first step, the
            fastest partition for the training data's longest batch under the meta-device cost model
            (the static plan; ``strategies/costs.py`` says how the batch is found). Per-batch plans
            come from the ``ElasticRepartition`` callback.
        process_group_backend: ``"gloo"``, ``"nccl"``; None: the default for the device.
        start_method: ``"popen"`` (re-run the script per process, works with torchrun), or
            ``"spawn"``/``"fork"`` (start processes from the current one; notebooks, tests).
        timeout: how long a collective or transfer may wait before the process group gives up,
            so that a crashed rank does not leave the others hanging forever.
        memory_budget: bytes per device (or ``"40GiB"``) for parameters, gradients, optimizer state
            and saved activations; enforced on the accounted bytes (on CPU, where no allocator
            runs out). None: no budget. See docs/memory.md.
        recompute: ``"none"``, ``"full"``, ``"keep_attention"`` (recompute all but attention), an
            integer ``k`` (full recomputation of every ``k``-th block), a ``StageMemory`` or
            ``MemoryPlan``, or ``"auto"``: the fastest plan under ``memory_budget`` for the first batch
            (with ``packing``: for every batch, per (stage, chunk)).
        offload: True (saved activations of every block not recomputed go to host memory until
            backward), False, or a number of blocks per stage.
        mlp_chunk_size: run position-wise MLP submodules (named ``mlp``, ``ffn``, ``feed_forward``) in
            sequence chunks of this size (HelixPipe's chunked MLP); None: in one piece.
        optimizer_offload: keep each stage's optimizer state and master weights in host memory and
            step each stage on a worker thread as soon as its gradients are final (SPipe); see
            docs/memory.md for what it does not support. Required for ``precision="16-mixed"``: the
            stage steps unscale by the scaler's loss scale, and an overflow anywhere undoes every
            stage's step on every rank while the scale backs off as with Lightning's scaler.
        ranks_per_device: processes sharing each device (development mode, default 1). With one GPU,
            ``Trainer(accelerator="cuda", devices=1, strategy=ElasticPipelineStrategy(ranks_per_device=2))``
            runs a 2-rank pipeline on it: NCCL refuses two ranks on one GPU, so the ranks talk over gloo
            and activations travel through host memory. For checking the CUDA path and parity on a
            single GPU, not for speed.
        batch_dim: where the batch's tensors keep their samples: one dimension for all (``1`` for
            time-major ``(T, B, ...)`` tensors), a mapping from an item's key to its dimension
            (``{0: 1, 1: 0}`` for ``(T, B, d)`` inputs and ``(B,)`` targets; ``None`` gives an item
            whole to every microbatch), or a hook ``(path, tensor) -> int | None``. None: 0, and
            a module with ``batch_first=False`` layers is refused until the layout is stated.
        loss_weights: how microbatch losses combine into the batch's: ``"auto"`` (the loss's own
            normalisation, read from the step: counted targets for cross-entropy/NLL means with
            ``ignore_index``, samples otherwise), ``"samples"``, ``"sum"``, or a callable
            ``microbatch -> weight`` (the batch loss is ``sum_i w_i L_i / sum_i w_i``). With data
            parallelism each replica normalises over its own batch, as DDP does. See the user guide.
        allow_sample_mixing: run modules with batch normalization in training mode, which then
            normalizes over each microbatch's samples instead of the batch's (results differ from
            one device; a warning says so). False: refused.
        trim_padding: cut each training microbatch of a padded batch (an ``attention_mask`` or
            ``-100`` labels, as transformers' collators pad) to its own real tokens, on either side,
            so a microbatch of short sequences runs short. Checked, not assumed: the first batch of
            each padding layout runs one microbatch cut and uncut and compares every block output
            and the loss; a model whose result depends on the padding runs uncut, with one log line
            saying why. See the user guide.
        group_by_length: with ``trim_padding``, order a batch's samples by length before cutting it
            into microbatches, so each microbatch holds sequences of similar length, and size the
            microbatches so that the longest sequences do not run together in one heavy microbatch
            (``planning.microbatching.padded_microbatch_sizes``: the least padded positions summed
            plus the heaviest microbatch's once per extra stage). The batch's loss, sum of gradients
            and logged means do not depend on which samples run together.
        merge_split_backward: for zero-bubble families (``I`` and ``W``), run a pair's ``I`` and ``W`` as one
            full backward where the program runs the ``W`` right after its ``I`` (any sends between them then
            leave after it) and the simulator finds that splitting it does not make the step shorter
            (``schedules.backward_merging``): on CPU a split pair costs 14-24% more than one backward.
            Decided on uniform costs (every stage alike, the split at ideal halves). ``"measured"``:
            decided once more on what the first steps measured (each stage's own forward and backward
            times, the split's measured cost: ``runtime/merge_tuning.py``), kept where the simulator finds
            it shorter and holding no more memory (not under a memory budget, whose plans were made for
            the first decision); the program then depends on timings. Exact either way; False runs every
            split as the family writes it.
        save_distributed_checkpoint: True (default): a checkpoint is a directory in which every rank
            writes the state it owns through ``torch.distributed.checkpoint`` (as Lightning's
            ``ModelParallelStrategy`` and ``FSDPStrategy`` do), so memory and time scale with a rank's
            shard; it loads into any pipeline and data-parallel layout, and ``lightning-pipe-export``
            turns it into one file. False: one consolidated file gathered on global rank 0 (small
            models). Both load into this strategy whatever wrote them.
        async_save: write sharded checkpoints on a background thread (after a copy to host memory) so
            training continues while shards are written; the next save and the end of training wait
            for it. Only with ``save_distributed_checkpoint=True``.
        packing: pack each batch's sequences into microbatches without padding, attention restricted
            to each sequence and positions restarting per sequence (transformers-style dict batches;
            ``runtime/packing.py``). True: ``Packer()`` (``num_microbatches`` bins of near-equal
            tokens); a :class:`~lightning_pipe.runtime.packing.Packer` for a token budget. The first
            batch that packs two sequences is checked (first stage, packed against unpacked) and a
            model whose result packing would change is refused. Needs a token-averaged loss.
        elastic_depth: let plans change the number of stages and give stages data-parallel widths
            (``PipelinePlan.widths``, FlexPipe) between any two optimizer steps: all processes form one
            pipeline of layouts such as 4 x 1, 2 x 2, 1 x 4 or (2, 1, 1), every rank reads the global
            batch, and parameters, open gradients and optimizer state move between layouts
            (``strategies/regrouping.py``). Proposed by ``ElasticDepth`` or any ``PlanProposal`` with
            widths. 1F1B only; no memory plans, packing, optimizer offload or padding trimming.
        plan: ``"static"`` (default): the plan changes only when callbacks propose it; ``"auto"``:
            the strategy adds the joint planner (``AutoPlanner`` with its defaults) to the callbacks,
            choosing partition, family, microbatching and memory plan per batch under
            ``memory_budget``; refused with single-lever planners, a user's own ``AutoPlanner``, or the
            ``recompute``/``offload`` arguments (``strategies/auto_plan.py``; docs/joint-planning.md).
    """

    strategy_name = "elastic_pipe"

    def __init__(
        self,
        pipeline_parallel_size: int | None = None,
        num_microbatches: int | None = None,
        schedule: ScheduleSpec = "1f1b",
        blocks: str | None = None,
        partition: PartitionSpec = "balanced",
        process_group_backend: str | None = None,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        timeout: timedelta = default_pg_timeout,
        memory_budget: str | int | None = None,
        recompute: RecomputeSpec = None,
        offload: bool | int = False,
        mlp_chunk_size: int | None = None,
        optimizer_offload: bool = False,
        ranks_per_device: int = 1,
        batch_dim: BatchDim | None = None,
        loss_weights: LossWeights = "auto",
        allow_sample_mixing: bool = False,
        trim_padding: bool = True,
        group_by_length: bool = True,
        merge_split_backward: bool | Literal["measured"] = True,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        packing: bool | Packer = False,
        elastic_depth: bool = False,
        plan: PlanMode = "static",
    ) -> None:
        super().__init__()
        check_plan_mode(plan, recompute, offload)
        self._plan_mode = plan
        self.packer = _check_arguments(locals())
        self._packing_checked = False  # a microbatch packing two sequences was checked
        self._slicing_checked = False  # a sliced sequence was checked
        self._pipeline_parallel_size = pipeline_parallel_size
        self._num_microbatches = num_microbatches
        self.schedule: Schedule = resolve_schedule(schedule)
        self.split_placement = SplitPlacement.create(self.schedule, locals())  # helix / spipe (split_step.py)
        self.regrouping = _regrouping(elastic_depth, locals())
        self._blocks = blocks
        self._partition_spec = partition
        self._process_group_backend = process_group_backend
        self._start_method = start_method
        self._ranks_per_device = ranks_per_device
        self._timeout = timeout
        self._num_nodes = 1
        self.boundaries: tuple[int, ...] = ()
        # set up in `setup_environment` / `_shard` / `_install`; declared here so the object has one shape
        self.groups: ProcessGroups | None = None
        self._groups_made_for: tuple | None = None  # (default group, world size, layout) the groups were made for
        self._outcome_channel: OutcomeChannel | None = None  # the step's loss and logs to the pipeline
        self.unit_layout: UnitLayout | None = None
        self.runner: StageRunner | None = None
        self._sharded_module: nn.Module | None = None  # the module this strategy sharded last (its plan holds it)
        self.executor: PipelineExecutor | None = None
        self.program: Program | None = None
        self.eval_program: Program | None = None
        self.spans: dict[int, StageSpan] = {}
        self.metric_states: MetricStates | None = None
        self._observed: dict[str, Any] = {}
        self._shared: list[tuple[Tensor | None, tuple[int, ...]]] = []
        self._sample_mixing = False
        self.last_outcome = None  # StepOutcome of the latest step on this rank (for the monitor)
        self.step_clock = StepClock()  # the step's parts outside the program (for the monitor)
        self.plan_gate = PlanGate()  # opened once a training batch's plan is applied; a new one per batch
        self.last_migration: MigrationReport | None = None
        self.memory = StrategyMemory(  # see strategies/memory.py
            memory_budget, recompute, offload, mlp_chunk_size, optimizer_offload=optimizer_offload
        )
        self.costs = StrategyCosts()  # cost models for planners; see strategies/costs.py
        self._batch_dim = batch_dim
        self.loss_weights = loss_weights
        self._allow_sample_mixing = allow_sample_mixing
        self._trim_padding = trim_padding and not elastic_depth
        self._group_by_length = group_by_length
        if merge_split_backward not in (True, False, "measured"):
            raise ValueError(f"`merge_split_backward` must be True, False or 'measured', got {merge_split_backward!r}.")
        self._merge_split_backward = merge_split_backward if merge_split_backward == "measured" else bool(merge_split_backward)
        self._merge_tuning = MergeTuning()  # merges decided again on measured action times
        self.trim_verdicts: dict[tuple, TrimVerdict] = {}  # per batch layout: is cutting padding exact?
        self._shapes_vary = False  # see _lengths_vary
        self._expected_normalizer = 1.0  # see DeferredNormalization: the last step's counted targets
        self._last_shapes: list[list[tuple[int, ...]]] | None = None
        self._warned_sample_mixing = False
        # latest: (batch, its contents, (count, sizes, chunks), split); the batch is kept so that its contents' ids stay its own
        self._splits: list[tuple[Any, tuple, tuple, SplitBatch]] = []
        self._short_programs: dict[Any, Program] = {}
        self._programs: dict[tuple[Schedule, int, int], Program] = {}  # validated builds per (family, ranks, count)
        self._microbatch_sizes: tuple[int, ...] | None = None
        self._planned_chunks: PlannedChunks | None = None  # the plan's chunks (packing with slicing)
        self._warned_sizes: set[tuple] = set()  # (sizes, batch size) pairs already warned about
        self._proposals: list[PlanProposal] = []
        self.last_application: PlanApplication | None = None  # how the latest step's plan was merged and applied
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self.sharded_checkpoints = ShardedCheckpoints(asynchronous=async_save)

    # --- sizes and ranks -----------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) * self._ranks_per_device if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank // self._ranks_per_device]

    @property
    def is_distributed(self) -> bool:
        """Whether Lightning shards the training data with a ``DistributedSampler``: only with several
        data-parallel replicas (then exactly as under DDP).

        Lightning gives the training loader of every distributed strategy a *shuffling* sampler,
        whatever the loader's ``shuffle`` says (``_process_dataloader``). With one replica, every rank
        of the pipeline must read the user's loader as it is, so that the run sees the batches a
        one-device run sees: answering False here keeps Lightning's hands off the loader. (Lightning
        reads this attribute only for the sampler rule, ``self.log(sync_dist=...)``, which spans the
        data-parallel replicas here anyway, and the tuner's refusal of distributed runs.)
        """
        return self.layout.data_parallel_size > 1

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline ranks per replica."""
        return self._pipeline_parallel_size or self.world_size

    @property
    def num_microbatches(self) -> int:
        """Microbatches per batch."""
        return self._num_microbatches or 2 * self.pipeline_parallel_size

    def groups_by_length(self, batch: Any) -> bool:
        """Whether a plan without microbatch sizes runs ``batch`` length-grouped (its padding cut, exactly,
        and ``group_by_length``): what planners must price for such a plan."""
        padding = getattr(self.split_batch(batch).plan, "padding", None)
        return padding is not None and self._trim_padding and self._group_by_length

    @property
    def layout(self) -> RankLayout:
        """Where this process sits in the pipeline x data-parallel grid."""
        return RankLayout(self.world_size, self.pipeline_parallel_size, self.global_rank)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard the data over data-parallel replicas only: the ranks of one pipeline see one batch."""
        return {"num_replicas": self.layout.data_parallel_size, "rank": self.layout.data_parallel_rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore into the sharded module (each rank copies only what it owns)."""
        return True

    def set_world_ranks(self) -> None:
        """Record global rank and world size in the cluster environment."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # --- processes ------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.layout  # at `Trainer(...)`: pipeline_parallel_size must divide the process count
        if self._grad_scaler() is not None and not self.memory.optimizer_offload:
            raise ValueError(
                f"`{type(self).__name__}` supports `precision='16-mixed'` (float16 with a gradient scaler) only with "
                "`optimizer_offload=True`: backward runs inside the pipelined step, where Lightning's scaler does not "
                "scale the loss, and skipping a step on overflow must be agreed by every stage, which the per-stage "
                "host optimizers do. Use `optimizer_offload=True` or `precision='bf16-mixed'`."
            )
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = compat._SubprocessScriptLauncher(
                    self.cluster_environment, self.num_processes, self.num_nodes
                )
        else:
            self._launcher = compat.PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        self.layout  # validates pipeline_parallel_size against the process count before any process group
        super().setup_environment()
        self.set_world_ranks()
        compat._init_dist_connection(self.cluster_environment, self.process_group_backend, timeout=self._timeout)
        destroy_default_group_at_exit()
        made_for = (default_group(), self.world_size, self.layout)
        if self._groups_made_for != made_for:  # fit, validate and test in the same processes share one set
            self.groups = create_process_groups(self.layout, timeout=self._timeout)
            self._outcome_channel = None if self.groups.outcome is None else OutcomeChannel(self.groups.outcome)
            if self.regrouping is not None:
                self.regrouping.create_groups(self.world_size, self._timeout)
            self.sharded_checkpoints.group = create_checkpoint_group(self._timeout)
            self._groups_made_for = made_for
        self.sharded_checkpoints.global_rank = self.global_rank
        if self._plan_mode == "auto":
            install_auto_planner(self.lightning_module.trainer)

    @property
    def process_group_backend(self) -> str:
        """The torch.distributed backend: the argument, else gloo when ranks share a device, else the
        device's default (NCCL on CUDA, gloo on CPU)."""
        if self._process_group_backend is not None:
            return self._process_group_backend
        if self._ranks_per_device > 1:
            return "gloo"
        return compat._get_default_process_group_backend_for_device(self.root_device)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.validate_module(self.lightning_module, fitting=trainer.state.fn == TrainerFn.FITTING)
        self.model = self.precision_plugin.convert_module(self.model)
        self._shard(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            check_optimizers(self.optimizers, type(self).__name__)
            compat.set_skip_backward(trainer, True)
            compat.fix_unbounded_epoch_description(trainer)
        self.setup_precision_plugin()
        install_global_norm_clipping(self.precision_plugin, self._global_gradient_norm)
        if self.memory.optimizer_offload:  # 16-mixed: the stage optimizers scale, unscale and agree
            self.memory.grad_scaler = self._grad_scaler()

    def _grad_scaler(self) -> torch.amp.GradScaler | None:
        """The precision plugin's enabled gradient scaler (``precision="16-mixed"``), or None."""
        plugin = self.precision_plugin
        scaler = plugin.scaler if isinstance(plugin, MixedPrecision) else None
        return scaler if scaler is not None and scaler.is_enabled() else None

    def validate_module(self, module: Any, fitting: bool = True) -> None:
        """Raise the configuration errors that need only the module (no process group, no data).

        The spawn/fork launcher calls this in the main process before starting any process, and
        ``setup`` on every rank. The block stack is checked here only if the module does not build
        layers in ``configure_model`` (before setup they may not exist yet; ``setup`` checks then).

        Args:
            module: the user's LightningModule.
            fitting: ``trainer.fit`` (manual optimization only matters there).

        Raises:
            ValueError: manual optimization, no block stack, more stages than blocks, a
                ``partition`` that does not fit the blocks, a ``memory_budget`` below a stage's
                parameters and gradients, or time-major layers without ``batch_dim``.
        """
        if fitting and not module.automatic_optimization:
            raise ValueError(
                f"`{type(self).__name__}` does not support manual optimization (`automatic_optimization = False`) "
                f"in `{type(module).__name__}`: the pipeline runs backward inside the step. Use automatic optimization."
            )
        self._check_time_major(module)
        self._check_sample_mixing(module, self.num_microbatches if self._num_microbatches else 2)
        if self.split_placement is not None:
            return self.split_placement.validate_module(self, module)
        if is_overridden("configure_model", module):
            return
        stack = find_blocks(module, self._blocks)
        num_stages = self.pipeline_parallel_size * self.schedule.stages_per_rank
        layout = analyze_units(module, stack)
        boundaries = initial_partition(self._setup_partition_spec, module, layout, num_stages)
        if self.memory.budget is not None:
            check_budget_holds_stages(module, layout, boundaries, self.memory.budget)

    def _check_time_major(self, module: Any) -> None:
        """Refuse ``batch_first=False`` layers until ``batch_dim`` says how the batch is laid out."""
        if self._batch_dim is not None:
            return
        found = find_time_major_modules(module)
        if found:
            raise ValueError(
                f"`{type(module).__name__}` has time-major layers ({describe_modules(found)} with `batch_first=False`: "
                "they take (T, B, ...) tensors), so the batch's layout cannot be told from shapes. Tell "
                f"`{type(self).__name__}` where the samples are: `batch_dim=0` if the dataloader's tensors are batch-first "
                "(the model transposes them), `batch_dim=1` if all are (T, B, ...), or per item, e.g. "
                "`batch_dim={0: 1, 1: 0}` for (T, B, d) inputs and (B,) targets."
            )

    def _shard(self, trainer: Any) -> None:
        module = self.lightning_module
        if self.split_placement is not None:
            previous = recorded_placement(module)
            if previous is not None and previous != _SPLIT_PLACED:
                raise RuntimeError(
                    f"`{type(module).__name__}` was sharded by another pipeline in these processes (each rank holds "
                    f"only its stages), which schedule={self.schedule.name!r} cannot gather. {_NEW_MODULE}"
                )
            self.split_placement.setup(self)
            record_placement(module, _SPLIT_PLACED)
            return
        stack = find_blocks(module, self._blocks)
        self.unit_layout = analyze_units(module, stack)
        if self._sharded_module is module:
            # set up again in the same processes (validate or test after fit): each rank holds only what the
            # last plan gave it, so that plan stays; another partition would find owned tensors on meta
            plan = self.plan
            if plan.widths is not None:
                raise RuntimeError(
                    f"`trainer.{trainer.state.fn.value}` after a fit that changed the pipeline's depth "
                    "(`elastic_depth`), in the same processes and with the same module: its parameters are spread "
                    "over a layout this call cannot set up. Call it on a new Trainer (its pipeline gathers the "
                    "module), or save a checkpoint at the end of the fit and validate from it (`ckpt_path=...`)."
                )
            plan = PipelinePlan(plan.boundaries, plan.schedule, self.num_microbatches)
        else:
            num_stages = self.pipeline_parallel_size * self.schedule.stages_per_rank
            boundaries = initial_partition(self._setup_partition_spec, module, self.unit_layout, num_stages)
            plan = PipelinePlan(boundaries, self.schedule, self.num_microbatches)
        self._install(plan)
        owned = owned_units(self.boundaries, self.program.stages_of(self.layout.pipeline_rank))
        placement = self._placement()
        previous = recorded_placement(module)  # sharded before in these processes, by this strategy or another
        if previous is not None and previous != placement:
            self._gather_owned(module, previous, placement[1], owned)
        shard_module(module, self.unit_layout, owned, self.root_device)
        self._sharded_module = module
        record_placement(module, placement)
        self.runner = StageRunner(module, stack, device=self.root_device)
        self._observed = {}  # step name -> StepObservation (units by use; see _observe)
        self.executor = (PipelineExecutor if self.regrouping is None else LayoutExecutor)(
            self.runner,
            # autocast does not apply on the meta device: activations carry their real dtypes
            PointToPoint(
                self.groups.pipeline,
                send_dtypes=isinstance(self.precision_plugin, MixedPrecision),
                # gloo has no point-to-point for CUDA tensors: they travel through host memory
                host_staging=self.process_group_backend == "gloo" and self.root_device.type == "cuda",
                timeout=self._timeout,
            ),
            self.layout.pipeline_ranks(),
            self.layout.pipeline_rank,
            self.root_device,
        )
        context = self._context()
        self.memory.setup(context)
        self.costs.setup(context, self.memory)
        self._shared = self._shared_parameters()
        self._check_time_major(module)  # blocks built in `configure_model` exist now
        self._sample_mixing = bool(find_sample_mixing_modules(module))
        self.metric_states = MetricStates(module, self.groups.data_parallel)
        self._short_programs = {}

    def _placement(self) -> tuple[tuple[int, ...], dict[str, frozenset[int]]]:
        """Where the module's tensors are: the pipeline's global ranks, and per tensor name the pipeline
        ranks that hold it for real (what ``model.sharding.record_placement`` keeps on the module)."""
        return tuple(self.layout.pipeline_ranks()), holders_of(self.unit_layout, self._unit_owners())

    def _gather_owned(
        self, module: nn.Module, previous: tuple, holders: dict[str, frozenset[int]], owned: set[int]
    ) -> None:
        """Before sharding a module that these processes sharded otherwise (a new Trainer after a fit,
        under torchrun): bring each rank the tensors it now owns from the ranks that hold them, as a
        plan change does. Without it they would be allocated uninitialized wherever the previous
        placement left them on meta."""
        ranks, old_holders = previous
        if ranks is None:
            raise RuntimeError(
                f"`{type(module).__name__}` was cut by a split placement (schedule='helix' or 'spipe') in these "
                f"processes, which another schedule cannot gather. {_NEW_MODULE}"
            )
        if ranks != tuple(self.layout.pipeline_ranks()):
            raise RuntimeError(
                f"`{type(module).__name__}` was sharded in these processes by a pipeline over global ranks "
                f"{list(ranks)}, and this strategy's pipeline runs over {self.layout.pipeline_ranks()}: each rank "
                f"holds only its old stages, which this layout cannot gather. {_NEW_MODULE}"
            )
        transfers = plan_transfers(old_holders, holders)
        if transfers:
            migrate(
                module, transfers, self.unit_layout.needed_names(owned), self.layout.pipeline_rank,
                self.layout.pipeline_ranks(), self.groups.pipeline, [], self.root_device,
            )

    def _context(self) -> PipelineContext:
        """What the memory and cost helpers read of this strategy (strategies/context.py)."""
        return PipelineContext(
            layout=self.layout,
            groups=self.groups,
            runner=self.runner,
            device=self.root_device,
            module=self.lightning_module,
            world_size=self.world_size,
            global_rank=self.global_rank,
            current=self._pipeline_state,
            optimizers=lambda: self.optimizers,
            split_batch=self.split_batch,
            program_for_plan=self.program_for_plan,
            train_step_context=lambda: self.precision_plugin.train_step_context(),
            broadcast=self.broadcast,
            gather_from_pipeline=self.gather_from_pipeline,
        )

    def _pipeline_state(self) -> PipelineState:
        """The plan in force, for the helpers' context."""
        return PipelineState(
            self.schedule, self.program, tuple(self.boundaries), self.spans, self.unit_layout, self.num_microbatches,
            tuple(self._tied),
        )

    def _install(self, plan: PipelinePlan) -> None:
        """Make ``plan`` the current one: schedule, program, stage spans (no tensors move here)."""
        schedule = resolve_schedule(plan.schedule)
        num_blocks = self.unit_layout.num_blocks
        Regrouping.check_plan(plan, self.world_size, self.regrouping is not None)
        num_stages = len(plan.widths) if plan.widths else self.pipeline_parallel_size * schedule.stages_per_rank
        boundaries = check_boundaries(plan.boundaries, num_blocks, num_stages)
        program = self.program_for_plan(plan)
        if getattr(self, "program", None) is not program:
            self.eval_program: Program = forward_only(program)
        self.schedule, self.program, self.boundaries = schedule, program, boundaries
        self._num_microbatches = plan.num_microbatches
        self._microbatch_sizes = plan.microbatch_sizes
        self._planned_chunks = plan.chunks
        self.spans = {
            s: StageSpan(s, boundaries[s], boundaries[s + 1], num_blocks)
            for s in program.stages_of(self.layout.pipeline_rank)
        }
        self.memory.install(plan, program)
        log.info(
            "rank %d: pipeline rank %d of %d runs stages %s (blocks %s), schedule %s, %d microbatches",
            self.global_rank, self.layout.pipeline_rank, self.pipeline_parallel_size, list(self.spans),
            [(span.first_block, span.end_block) for span in self.spans.values()], schedule.name,
            plan.num_microbatches,
        )

    @property
    def _setup_partition_spec(self) -> PartitionSpec:
        """The rule for boundaries made without data: ``"auto"`` starts ``"balanced"``."""
        return "balanced" if self._partition_spec == "auto" else self._partition_spec

    @override
    def on_train_start(self) -> None:
        """``partition="auto"``: move to the best partition for the training data's longest batch."""
        if self._partition_spec != "auto":
            return
        boundaries = self.costs.plan_static_partition(self.lightning_module.trainer.train_dataloader)
        if boundaries != self.boundaries:
            self.apply_plan(dataclasses.replace(self.plan, boundaries=boundaries))

    def peek_next_batch(self) -> tuple[bool, Any]:
        """``(True, batch)`` for the training batch after the current one, as the dataloader yields it
        (not yet on the device; not consumed), or ``(False, None)`` (end of epoch). For planners that
        plan batch ``k + 1`` while batch ``k`` runs. Fetching it counts as the step's ``data`` time
        (the loop would load it after the step anyway), not as the planner's."""
        with self.step_clock.measure("data"):
            return compat.peek_next_training_batch(self.lightning_module.trainer)

    def default_boundaries(self, num_stages: int) -> tuple[int, ...]:
        """Boundaries for ``num_stages`` stages following the ``partition`` argument's rule.

        An explicit list only fits its own stage count; other counts, and ``"auto"``, fall back to
        ``"balanced"``.
        """
        spec = self._setup_partition_spec
        if isinstance(spec, (list, tuple)) and len(spec) != num_stages:
            spec = "balanced"
        return initial_partition(spec, self.lightning_module, self.unit_layout, num_stages)

    @property
    def plan(self) -> PipelinePlan:
        """The plan the next step runs with."""
        return PipelinePlan(
            self.boundaries, self.schedule, self.num_microbatches, memory=self.memory.plan,
            microbatch_sizes=self._microbatch_sizes, chunks=self._planned_chunks,
            widths=getattr(self.program, "widths", None),
        )

    def program_for_plan(self, plan: PipelinePlan) -> Program:
        """The validated training program of ``plan``'s family and microbatch count (built once per pair)."""
        if plan.widths is not None:
            return self.regrouping.program(plan.widths, plan.num_microbatches)
        schedule = resolve_schedule(plan.schedule)
        measured = self._measured_seconds(schedule, plan.boundaries, plan.num_microbatches)
        key = (schedule, self.pipeline_parallel_size, plan.num_microbatches, self._split_shares(), measured)
        program = self._programs.get(key)
        if program is None:
            program = self._build_program(schedule, plan.num_microbatches, measured)
            self._programs = {**dict(list(self._programs.items())[-15:]), key: program}
        return program

    def _split_shares(self) -> SplitBackward | None:
        """What ``I`` and ``W`` cost as shares of ``B``, once a planner measured it (None before)."""
        estimate = self.costs.estimate
        return None if estimate is None else estimate.cost_model.split_backward

    def _build_program(self, schedule: Schedule, num_microbatches: int, measured: Any = None) -> Program:
        """``schedule``'s validated program for ``num_microbatches``, its split backwards merged where
        splitting them buys nothing (``merge_split_backward``), priced with ``measured`` stage seconds
        when given (:meth:`_measured_merge`)."""
        if self._merge_split_backward:  # validated; a family without I comes back as built
            program = merged_program(schedule, self.pipeline_parallel_size, num_microbatches, self._split_shares())
            if measured is not None and self._tunes_merges():
                program = self._measured_merge(schedule, num_microbatches, measured, program)
        else:
            program = validate(schedule.build(self.pipeline_parallel_size, num_microbatches))
        check_executable(program)
        return program

    def _measured_merge(self, schedule: Schedule, num_microbatches: int, measured: Any, default: Program) -> Program:
        """The family's merges decided on the measured stage seconds, where the simulator finds that program
        shorter than ``default`` under them and no rank holding more microbatches' activations at once.

        The decision is this rank's own (ranks agree on the seconds, but a merge never changes a message, so
        ranks may even run different merges); only the memory test keeps it from costing more than the plan
        the memory planners saw.
        """
        raw = validate(schedule.build(self.pipeline_parallel_size, num_microbatches))
        costs = measured.costs(raw)
        if costs is None:
            return default
        tuned = merge_split_backwards(raw, costs)
        new, old = simulate(tuned, costs, record_events=False), simulate(default, costs, record_events=False)
        holds_more = any(a > b for a, b in zip(new.peak_memory, old.peak_memory))
        return tuned if new.makespan < old.makespan and not holds_more else default

    def _measured_seconds(self, schedule: Schedule, boundaries: Sequence[int], num_microbatches: int) -> Any:
        """The stage seconds the pipeline agreed on for this family and partition, or None."""
        tuning = self._merge_tuning
        if tuning.seconds is None or tuning.key != (schedule, tuple(boundaries), num_microbatches):
            return None
        return tuning.seconds

    def _tunes_merges(self) -> bool:
        """``merge_split_backward="measured"`` applies: not when a planner measured the split (its shares
        come first), nor under a memory budget (the memory planners' program stays)."""
        return self._merge_split_backward == "measured" and self._split_shares() is None and self.memory.budget is None

    def _tune_merges(self, program: Program, records: Sequence[Any]) -> None:
        """Time a training step of a program that splits its backward; once enough are timed, agree on
        the stage seconds in the pipeline group and install the plan again with merges decided on them
        (nothing moves: the placement is the same). Every rank of the pipeline runs the same steps and
        programs, so all reach the agreement at the same step."""
        if not (program.splits_backward and program is self.program and self._tunes_merges()):
            return
        tuning = self._merge_tuning
        tuning.record((self.schedule, tuple(self.boundaries), self.num_microbatches), records)
        if tuning.due:
            tuning.agree(self.program.num_stages, self.groups.pipeline if self.groups is not None else None)
            self._install(self.plan)

    @property
    def merges_split_backward(self) -> bool:
        """Whether zero-bubble pairs run as one ``B`` where splitting them buys nothing
        (``merge_split_backward``): planners price a family's merged program then."""
        return bool(self._merge_split_backward)

    def propose(self, proposal: PlanProposal) -> None:
        """Propose changes to the next step's plan (from a callback's ``on_train_batch_start``).

        Proposals of all callbacks are merged by the documented rule (``planning/proposals.py``) and
        the result is applied once, before the step. Call it on every rank with the same proposal.
        """
        if not isinstance(proposal, PlanProposal):
            raise TypeError(f"`{type(self).__name__}.propose` takes a PlanProposal, got {type(proposal).__name__}.")
        self._proposals.append(proposal)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch; a training batch starts the step's clock (before the callbacks plan it)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training:
            self.step_clock.reset()
            self.plan_gate = PlanGate()
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """After every callback's ``on_train_batch_start``: merge the proposals, apply one plan."""
        if not self.step_clock.fresh:  # a loop that hands the step an iterator moves no batch
            self.step_clock.reset()
        self.step_clock.fresh = False
        proposals, self._proposals = self._proposals, []
        try:
            with self.step_clock.measure("apply"):
                self.last_application = apply_proposals(self, proposals, batch_idx)
        finally:
            self.plan_gate.open()  # lookahead jobs of this batch start now

    def apply_plan(self, plan: PipelinePlan) -> MigrationReport:
        """Switch to ``plan`` before the next step, moving units between ranks where ownership changes.

        Call it on every rank with the same plan, between optimizer steps (for example from a
        callback's ``on_train_batch_start``). Parameters, gradients of an open accumulation window and
        optimizer state move with their units; results do not change.

        Returns:
            What this rank moved (no transfers when only the schedule's order or microbatches changed).
        """
        if self.split_placement is not None:
            self.split_placement.refuse_plan()
        old_holders = holders_of(self.unit_layout, self._unit_owners())
        self._install(plan)
        report = self._move(self.unit_layout, old_holders)
        self.last_migration = report
        return report

    def _unit_owners(self) -> list[set[int]]:
        return _unit_owners(self.boundaries, self.program, self.pipeline_parallel_size, self.unit_layout.num_units)

    def _move(self, layout: UnitLayout, old_holders: dict[str, frozenset[int]]) -> MigrationReport:
        """Give every rank the tensors ``layout`` and the installed program say it needs.

        A shared tensor's gradient may be partial on each holder (inside an accumulation window):
        when holders change, the copies are summed first and the total kept by one holder only, so
        the sum at the optimizer step stays the batch's gradient.
        """
        new_holders = holders_of(layout, self._unit_owners())
        transfers = plan_transfers(old_holders, new_holders)
        shared_moves = any(old_holders.get(name) != new_holders.get(name) for name, _ in layout.shared) or any(
            old_holders.get(name) != new_holders.get(name) for name, _ in self.unit_layout.shared
        )
        if shared_moves and self.pipeline_parallel_size > 1:
            self._sum_shared_gradients()
        keep = layout.needed_names(owned_units(self.boundaries, self.program.stages_of(self.layout.pipeline_rank)))
        keepers = self.regrouping and self.regrouping.gather_gradients(
            self.lightning_module, old_holders, new_holders, self.global_rank
        )
        report = migrate(
            self.lightning_module, transfers, keep, self.layout.pipeline_rank, self.layout.pipeline_ranks(),
            self.groups.pipeline, self.optimizers, self.root_device,
        )
        if keepers:
            self.regrouping.keep_gradients(self.lightning_module, new_holders, keepers, self.global_rank)
        self.unit_layout = layout
        record_placement(self.lightning_module, self._placement())
        self.runner.parameters_changed()
        self._shared = self._shared_parameters()
        if shared_moves:
            for param, holders in self._shared:
                if param is not None and param.grad is not None and holders[0] != self.layout.pipeline_rank:
                    param.grad.zero_()
        return report

    def _shared_parameters(self) -> list[tuple[Tensor | None, tuple[int, ...]]]:
        """Per shared parameter (one order on every rank): this rank's real copy or None, and its holders."""
        params = dict(self.lightning_module.named_parameters(remove_duplicate=False))
        holders = holders_of(self.unit_layout, self._unit_owners())
        shared = []
        for name, _ in self.unit_layout.shared_parameters():
            if name in params:
                param = params[name] if not params[name].is_meta else None
                shared.append((param, tuple(sorted(holders[name]))))
        return shared

    @property
    def _tied(self) -> list[Tensor]:
        """Real parameters of this rank that other pipeline ranks hold copies of."""
        return [p for p, holders in getattr(self, "_shared", []) if p is not None and len(holders) > 1]

    def _sum_shared_gradients(self) -> None:
        if self.pipeline_parallel_size > 1 and any(len(h) > 1 for _, h in self._shared):
            collectives.sum_shared_gradients(
                self._shared, self.layout.pipeline_rank, self.layout.pipeline_ranks(), self.groups.pipeline
            )

    def _observe(self, step_name: str, args: tuple) -> None:
        """First run of ``step_name``: see how the step uses blocks and parameters, refuse what stages
        cannot run exactly, and move to units by use (a collective: every rank observes)."""
        with metrics_inert(self.lightning_module):  # the observation must not update metric states
            observation = self.runner.observe(step_name, args)
        check_observation(observation, self.runner.stack)
        self._observed[step_name] = observation
        layout = layout_from_observation(self.lightning_module, self.runner.stack, list(self._observed.values()))
        digest = (layout.unit_names, layout.shared)
        if self.world_size > 1:
            digests = collectives.all_gather_objects(digest, None)
            if any(d != digest for d in digests):
                raise RuntimeError(
                    f"`{step_name}` uses the module's parameters differently on different ranks (seen on its first "
                    "microbatch): the step's structure must not depend on the data of one rank's batch."
                )
        if layout != self.unit_layout:
            log.info("rank %d: units by use in `%s` differ from declaration; moving tensors", self.global_rank, step_name)
            report = self._move(layout, holders_of(self.unit_layout, self._unit_owners()))
            self.last_migration = report
        if self.regrouping is not None:
            self.regrouping.check_module(bool(self.metric_states), self._shared)

    @override
    def model_to_device(self) -> None:
        """Nothing to move: sharding placed the owned units on the device."""

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        """``empty_init=True`` builds on the meta device: nothing is allocated until setup gives each
        rank its own units (uninitialized, to be filled from a checkpoint). Otherwise modules are
        built on the host with the user's own initialization, then each rank keeps only its units."""
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    # --- steps ----------------------------------------------------------------------------------

    def split_batch(self, batch: Any, plan: PipelinePlan | None = None, train: bool | None = None) -> SplitBatch:
        """The microbatch plan of ``batch`` and its microbatches, cut once.

        The step, the memory planner, the cost probes and the profilers all call this; the latest
        batches' splits are kept, so a batch a callback looked at is not cut again by the step.
        Training batches with padding are cut to each microbatch's real tokens (``trim_padding``),
        their samples grouped by length (``group_by_length``), unless the check of their layout
        found that the model's result depends on the padding.

        Args:
            batch: the batch.
            plan: whose microbatching to use (count and sizes); None: the running plan's. Sizes
                that do not sum to this batch's samples (a validation batch after a sized training
                batch) give way to an even split, with a warning when the training step runs it.
            train: whether it is a training batch (True: the step runs it); None (a planner's look):
                whether the trainer is training.

        Raises:
            ValueError: the batch cannot be cut unambiguously (``runtime/microbatch.py``).
        """
        count = self.num_microbatches if plan is None else plan.num_microbatches
        sizes = self._microbatch_sizes if plan is None else plan.microbatch_sizes
        chunks = self._planned_chunks if plan is None else plan.chunks
        contents = batch_contents(batch)
        for _, seen, key, split in self._splits:
            if seen == contents and key == (count, sizes, chunks):
                return split
        warn_sizes = train is True  # the step itself runs it (planners' looks pass None)
        if train is None:
            trainer = getattr(self.lightning_module, "_trainer", None)
            train = bool(trainer is not None and trainer.training)
        if self.packer is not None:
            chunker = None
            if chunks is not None and train:  # the plan's chunks (a planner's), for the batch they were made for
                chunker = planned_chunker(self.packer, chunks)
            elif self.packer.slicing and self.packer.chunk_cost is not None:  # Algorithm 1 (planning/chunking.py)
                chunker = functools.partial(chunk_pieces, time=self.packer.chunk_cost, max_tokens=self.packer.max_tokens)
            packed = self.packer.plan(batch, count, chunker)
            return self._keep_split(batch, contents, (count, sizes, chunks), SplitBatch(packed, packed.split(batch)))
        if chunks is not None and train:
            raise ValueError(
                "The plan gives the batch's microbatches as chunks (`PipelinePlan.chunks`), which need "
                "`ElasticPipelineStrategy(packing=Packer(max_tokens=..., slicing=True))`."
            )
        key, sizes = (count, sizes, chunks), self._sizes_of(batch, sizes, warn=warn_sizes)
        planned = self._plan_microbatches(batch, count, sizes, trim=train and self._trim_padding)
        if planned.padding is not None and not self.trim_verdicts.get(planned.padding.layout, TrimVerdict(True)).exact:
            planned = self._plan_microbatches(batch, count, sizes, trim=False)
        return self._keep_split(batch, contents, key, SplitBatch(planned, planned.split(batch)))

    def _sizes_of(self, batch: Any, sizes: tuple[int, ...] | None, warn: bool) -> tuple[int, ...] | None:
        """The plan's microbatch sizes if they are this batch's, else None (an even split, exact as any): with a
        warning (once per size pair) when the training step runs it (``warn``: its sizes were planned for another
        batch), silently for a validation batch after a sized training batch or a planner's look at a batch."""
        if sizes is None or sum(sizes) == (size := batch_size_of(batch, 0 if self._batch_dim is None else self._batch_dim)):
            return sizes
        if warn and (sizes, size) not in self._warned_sizes:
            self._warned_sizes.add((sizes, size))
            rank_zero_warn(
                f"lightning-pipe: the plan's microbatch sizes {list(sizes)} sum to {sum(sizes)} samples but this training "
                f"batch has {size}: it is split evenly instead (exact, not balanced). Sizes describe one batch: propose "
                "them in `on_train_batch_start` for the batch at hand."
            )
        return None

    def _plan_microbatches(self, batch: Any, count: int, sizes: tuple[int, ...] | None, trim: bool) -> MicrobatchPlan:
        """``count`` microbatches of ``sizes`` (even when None or not this batch's: a validation batch after a
        sized training batch), cut to their real tokens with ``trim``."""
        batch_dim = 0 if self._batch_dim is None else self._batch_dim
        if sizes is not None and sum(sizes) != batch_size_of(batch, batch_dim):
            sizes = None
        # sized by padded positions alone (not a cost model that a planner may set between two
        # ranks' looks at the batch): every rank of a pipeline must cut the batch the same way
        grouped_sizes = functools.partial(
            padded_microbatch_sizes, num_microbatches=count, num_stages=self.pipeline_parallel_size
        )
        return plan_microbatches(
            batch, count, batch_dim, microbatch_sizes=sizes, trim_padding=trim,
            group_by_length=trim and self._group_by_length, grouped_sizes=grouped_sizes,
        )

    def _keep_split(self, batch: Any, contents: tuple, key: tuple, split: SplitBatch) -> SplitBatch:
        # the batch is kept with its split: while it lives, no other object takes the ids in ``contents``
        self._splits = [(batch, contents, key, split)] + [entry for entry in self._splits if entry[1] != contents][:2]
        return split

    def _check_trimming(self, step_name: str, batch: Any, rest: tuple, split: SplitBatch) -> SplitBatch:
        """First batch of a padding layout: check that cutting it is exact (a collective of the
        pipeline); if not, run untrimmed from now on and say why once."""
        layout = split.plan.padding.layout
        verdict = check_trimming(
            split.plan, batch, rest, step_name, self.runner, self.executor,
            lambda count: self._program_for(count, train=False), self.spans,
            self.groups.pipeline if self.pipeline_parallel_size > 1 else None,
        )
        if verdict is None:  # nothing cut in this batch: check the layout on a batch that is
            return split
        self.trim_verdicts[layout] = verdict
        if verdict.exact:
            return split
        rank_zero_info(
            f"lightning-pipe: microbatches keep their padding (no trimming), because {verdict.reason} when cut to "
            "its real tokens. Give positions in the batch (`position_ids`), mask padding out of attention and "
            "label it -100; or pass `trim_padding=False` to silence this check."
        )
        key = (self.num_microbatches, self._microbatch_sizes)
        plan = self._plan_microbatches(batch, *key, trim=False)
        self._splits = []  # splits a planner made before the verdict (the next batch's) are cut: made again
        return self._keep_split(batch, batch_contents(batch), (*key, None), SplitBatch(plan, plan.split(batch)))

    def _program_for(self, num_microbatches: int, train: bool) -> Program:
        """The program for this step: the plan's, or one for a short batch's fewer microbatches."""
        if num_microbatches != self.num_microbatches and getattr(self.program, "widths", None):
            program = self.regrouping.program(self.program.widths, num_microbatches)
            return program if train else forward_only(program)
        if num_microbatches != self.num_microbatches:
            program = self._short_programs.get(num_microbatches)
            if program is None:
                try:
                    program = self._build_program(self.schedule, num_microbatches)
                except Exception as error:
                    raise ValueError(
                        f"A batch has {num_microbatches} samples, fewer than `num_microbatches={self.num_microbatches}`, "
                        f"and schedule {self.schedule.name!r} cannot run {num_microbatches} microbatches ({error}). "
                        "Use `drop_last=True` in the dataloader, or a batch size that is a multiple of the microbatches."
                    ) from error
                self._short_programs[num_microbatches] = program
            return program if train else forward_only(program)
        return self.program if train else self.eval_program

    def _check_packing(self, step_name: str, batch: Any, plan: PackingPlan, rest: tuple) -> None:
        """On the first batch that packs two sequences (and the first that slices one): run the first
        stage packed and unpacked, sliced and whole (on its rank), agree on the verdict in the pipeline
        group, and refuse a model packing or slicing would change."""
        mb = check_microbatch(plan) if not self._packing_checked else None
        sliced = plan.is_sliced and not self._slicing_checked
        if mb is None and not sliced:
            return
        first_rank = self.layout.pipeline_ranks()[self.program.rank_of(0)]
        verdict = None
        if self.global_rank == first_rank:
            span = self.spans[0]

            def run_stage(microbatch: Any, wrapper: Any) -> list[Tensor]:
                result = self.runner.run(step_name, (microbatch, *rest), span, wrap_block=wrapper)
                return [t for t in result.outputs if isinstance(t, Tensor)]

            try:
                with quiet_forward(self.lightning_module):
                    verdict = packing_difference(run_stage, batch, plan, mb) if mb is not None else None
                    if verdict is None and sliced:
                        verdict = slicing_difference(run_stage, batch, plan)
            except Exception as error:  # the user's step on a packed batch: report it as the refusal
                verdict = f"`{step_name}` failed on a packed microbatch ({type(error).__name__}: {error})"
        if self.pipeline_parallel_size > 1:
            verdict = collectives.broadcast_object(
                verdict, first_rank, self.groups.pipeline,
                operation=f"the broadcast of the packing check from rank {first_rank} (the first stage)",
            )
        if verdict is not None:
            raise ValueError(REFUSAL.format(what=verdict))
        self._packing_checked = self._packing_checked or mb is not None
        self._slicing_checked = self._slicing_checked or sliced

    def _sliced_program(self, plan: PackingPlan, train: bool) -> Program:
        """Sliced 1F1B for a plan that cuts sequences into slices (backward last slice first)."""
        if self.schedule.name != "1f1b":
            raise ValueError(
                f"`Packer(slicing=True)` cut sequences into slices, which run as sliced 1F1B (backward last slice "
                f"first); schedule {self.schedule.name!r} cannot run them. Use `schedule='1f1b'`, or a larger "
                "`max_tokens` so that no sequence is sliced."
            )
        key = ("sliced", plan.slices, plan.pipelines)
        program = self._short_programs.get(key)
        if program is None:
            program = sliced_1f1b(self.pipeline_parallel_size, plan.num_microbatches, plan.slices, plan.pipelines)
            validate(program)
            self._short_programs[key] = program
        return program if train else forward_only(program)

    def _slice_roots(self, plan: PackingPlan, store: KeyValueStore) -> Any:
        """The executor's ``extra_roots``: a slice's keys and values with what later slices left them."""

        def roots(stage: int, mb: int) -> tuple[list[Tensor], list[Tensor]]:
            sliced = plan.slice_of(mb)
            if sliced is None:
                return [], []
            span = self.spans[stage]
            return store.pop_roots(sliced[0], sliced[1], range(span.first_block, span.end_block))

        return roots

    def _check_sample_mixing(self, module: Any, num_microbatches: int, sizes: str = "") -> None:
        """Refuse, or warn once about, batch normalization in training mode with several microbatches.

        Called before processes start (``validate_module``) and at every training step (a layer may
        be switched to training mode later)."""
        training = [(name, m) for name, m in find_sample_mixing_modules(module) if m.training]
        if not training or num_microbatches == 1:
            return
        what = (
            f"{describe_modules(training)} normalize over the samples of each microbatch{sizes} instead of the "
            "batch's, and update their running statistics once per microbatch: training differs from one device"
        )
        if not self._allow_sample_mixing:
            raise ValueError(
                f"`{type(module).__name__}`: {what}. Use `num_microbatches=1` (exact), a per-sample normalization "
                f"(LayerNorm, GroupNorm), or `{type(self).__name__}(allow_sample_mixing=True)` to accept the difference."
            )
        if not self._warned_sample_mixing:
            self._warned_sample_mixing = True
            rank_zero_warn(f"{what} (`allow_sample_mixing=True`).")

    def _run(self, step_name: str, args: tuple, train: bool) -> Any:
        if self.split_placement is not None:
            return self.split_placement.run(self, step_name, args, train)
        run_started = time.perf_counter()
        batch, rest = args[0], args[1:]
        split = self.split_batch(batch, train=train)
        if step_name not in self._observed:
            self._observe(step_name, (split.microbatches[0], *rest))
        if getattr(split.plan, "padding", None) is not None and split.plan.padding.layout not in self.trim_verdicts:
            split = self._check_trimming(step_name, batch, rest, split)
        plan, microbatches = split.plan, split.microbatches
        if isinstance(plan, PackingPlan) and not (self._packing_checked and (self._slicing_checked or not plan.is_sliced)):
            self._check_packing(step_name, batch, plan, rest)
        store = None
        if isinstance(plan, PackingPlan) and plan.is_sliced:
            program, store = self._sliced_program(plan, train), KeyValueStore()
        else:
            program = self._program_for(plan.num_microbatches, train)
        steps = [(mb, *rest) for mb in microbatches]
        deferred = None
        if train:
            if self._sample_mixing:
                sizes = f" ({plan.sizes[0]} of {plan.batch_size} samples here)"
                self._check_sample_mixing(self.lightning_module, plan.num_microbatches, sizes)
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
            block_wrapper = self.memory.before_step(batch, rest)
            program = self.memory.program_with_plan(program)  # the memory plan as RECOMPUTE/OFFLOAD/RELOAD actions
            if isinstance(plan, PackingPlan):
                block_wrapper = packed_block_wrapper(plan, block_wrapper, store)
            # 16-mixed with optimizer offload: each microbatch's loss carries the scaler's loss scale
            scale = self.memory.step_loss_scale or 1.0
            weights = upfront_weights(self.loss_weights, microbatches, plan.sizes)
            if self.loss_weights == "auto" and not self.memory.optimizer_offload:
                # counted targets are known only after each forward: normalise the gradient after the step
                deferred = DeferredNormalization(self.runner.real_parameters(), expected=self._expected_normalizer)
                deferred.begin()
                sizes = plan.sizes
                work = StepWork(
                    step_name, steps, [scale / accumulate / deferred.expected] * len(steps), block_wrapper=block_wrapper,
                    count_losses=True, loss_weight=lambda mb, record: raw_weight(record, sizes[mb]),
                )
            else:
                work = StepWork(
                    step_name, steps, [w / accumulate * scale for w in weights], block_wrapper=block_wrapper,
                    count_losses=True,
                )
        else:
            weights = list(plan.weights)
            packed = packed_block_wrapper(plan, None, store) if isinstance(plan, PackingPlan) else None
            work = StepWork(step_name, steps, block_wrapper=packed, count_losses=True)
        if store is not None:
            work.extra_roots = self._slice_roots(plan, store)
        work.describe_shapes = self._lengths_vary(plan, microbatches)
        work.same_shapes = not work.describe_shapes  # lengths have not varied: every microbatch alike
        if self.metric_states and self._runs_last_stage():
            self.metric_states.begin()
        if self._outcome_channel is not None:  # the outcome's receive lands while this rank finishes the step
            self._outcome_channel.post(step_name, self._last_stage_rank())
        early = _EarlyOutcome()
        if train and self._outcome_channel is not None and self.regrouping is None and self._runs_last_stage():
            work.side_task = lambda done: self._send_outcome_early(
                step_name, done, plan, weights, train, deferred, early
            )
        with self.precision_plugin.forward_context() if not train else nullcontext(), self.memory.accounting(train):
            program_started = time.perf_counter()
            outcome = self.executor.run(program, self.spans, work)
            self.step_clock.add("prepare", program_started - run_started)
        if self.regrouping is not None:
            outcome = self.regrouping.merge_outcome(outcome, program, self.global_rank)
        self.last_outcome = outcome
        if train and self.regrouping is None:
            self._tune_merges(program, outcome.records)
        with self.step_clock.measure("share_outcome"):
            return self._share_outcome(step_name, outcome, plan, weights, train, deferred, early)

    def _lengths_vary(self, plan: MicrobatchPlan, microbatches: list[Any]) -> bool:
        """Whether activations travel with their shapes: from the first step whose microbatches are
        cut to their own lengths, or whose shapes differ from the step before (then for good: the
        data's lengths vary). Every pipeline rank sees the same batches, so all decide alike."""
        shapes = [tensor_shapes(mb) for mb in microbatches]
        if any(w is not None for w in getattr(plan, "windows", ())) or len({str(s) for s in shapes}) > 1 or (
            self._last_shapes is not None and shapes[0] != self._last_shapes[0]
        ):
            self._shapes_vary = True
        self._last_shapes = shapes
        return self._shapes_vary

    def _last_stage_rank(self) -> int:
        """Global rank of this replica's last stage."""
        return self.layout.pipeline_ranks()[self.program.rank_of(self.program.num_stages - 1)]

    def _runs_last_stage(self) -> bool:
        return self.global_rank == self._last_stage_rank()

    def _step_weights(self, outcome: Any, plan: Any, weights: list[float], deferred: Any) -> tuple[list[float], float]:
        """On the last stage: each microbatch's share of the loss, and the gradient's normalizer."""
        if self.loss_weights != "auto":
            return weights, 1.0
        mbs = sorted(outcome.loss_records)
        records = [outcome.loss_records[mb] for mb in mbs]
        raw = [outcome.loss_weights[mb] for mb in mbs] if deferred is not None else weights
        decided = decide(records, plan.sizes, raw, deferred=deferred is not None)
        if isinstance(plan, PackingPlan) and plan.targets is not None and decided.by_tokens:
            counted = sum(float(r.count_of(r.returned)) for r in records)
            if counted != plan.targets:
                raise ValueError(
                    f"`Packer(slicing=True)`: the step's loss counted {counted:g} targets in the sliced microbatches, but "
                    f"the batch has {plan.targets} (labels shifted inside the model): the model did not use the "
                    "microbatches' `shift_labels` (each token's target, across slice boundaries). Pass the batch on as "
                    "transformers takes it (`self.model(**batch)`), or use `shift_labels` in the loss, or turn slicing off."
                )
        if isinstance(plan, PackingPlan) and not decided.by_tokens:
            raise ValueError(
                "`packing` puts several sequences in one microbatch row, so the loss must be a mean over counted "
                f"tokens (cross-entropy or NLL with `ignore_index`); this step's loss is "
                f"{records[0].describe(records[0].returned) if records[0].returned is not None else 'not traced to one'}. "
                "Return the token mean, pass `loss_weights=` (a callable or 'sum'), or turn `packing` off."
            )
        return decided.weights, decided.normalizer

    def _outcome_payload(
        self, outcome: Any, plan: Any, weights: list[float], train: bool, deferred: DeferredNormalization | None
    ) -> tuple:
        """On the last stage, from its forwards: the step's loss, the reduced logs, the gradient's
        normalizer, metric updates, and an error every rank raises (a loss that cannot be weighted
        exactly), so that no rank takes an optimizer step on it."""
        metric_updates = self.metric_states.end(plan.num_microbatches) if self.metric_states else {}
        try:
            normalizer = 1.0
            if train:
                weights, normalizer = self._step_weights(outcome, plan, weights, deferred)
            mbs = sorted(outcome.logs)
            log_weights = [_log_weights(outcome, mb, weights[mb], plan.weights[mb]) for mb in mbs]
            calls = [[_marked(call, self.metric_states) for call in outcome.logs[mb]] for mb in mbs]
            logs = reduce_log_calls(calls, log_weights)
            loss = None
            if train:
                mbs = sorted(outcome.losses)
                loss = sum(weights[mb] * outcome.losses[mb].double() for mb in mbs if weights[mb] != 0)
            return (None if loss is None else loss.cpu(), logs, normalizer, metric_updates, None)
        except (ValueError, TypeError) as error:
            return (None, [], 1.0, {}, error)
        finally:
            self.metric_states.forget_outputs()

    def _send_outcome_early(
        self, step_name: str, outcome: Any, plan: Any, weights: list[float], train: bool,
        deferred: DeferredNormalization | None, early: _EarlyOutcome,
    ) -> None:
        """The last stage's side task (``runtime/side_task.py``): the step's outcome once the last
        stage's forwards are done, sent to the other ranks and replayed here at once when it fits its
        schema (``runtime/outcome_channel.py``); otherwise kept for :meth:`_share_outcome`."""
        with self.step_clock.measure("share_outcome"):
            try:
                early.payload = self._outcome_payload(outcome, plan, weights, train, deferred)
                if self._outcome_channel.send_early(step_name, self.global_rank, early.payload):
                    early.sent = True
                    self._replay_logs(early.payload[1])
            except Exception as error:  # raised after the program: the other ranks must not wait for its actions
                early.error = error

    def _share_outcome(
        self, step_name: str, outcome: Any, plan: Any, weights: list[float], train: bool,
        deferred: DeferredNormalization | None, early: _EarlyOutcome | None = None,
    ) -> tuple[Tensor | None, Any]:
        """Broadcast the loss, the reduced logs and the gradient's normalizer from the last stage
        (``runtime/outcome_channel.py``); normalise this step's gradient and replay the logs on every rank.

        An error found on the last stage (a loss that cannot be weighted exactly) travels with the
        payload, so every rank raises it, before any optimizer step. ``early``: what the last stage's
        side task already computed and sent (:meth:`_send_outcome_early`).
        """
        early = early or _EarlyOutcome()
        if early.error is not None:
            raise early.error
        last_rank = self._last_stage_rank()
        payload = early.payload
        if payload is None and self.global_rank == last_rank:
            payload = self._outcome_payload(outcome, plan, weights, train, deferred)
        if self._outcome_channel is not None:
            payload = self._outcome_channel.share(
                step_name, last_rank, payload,
                operation=f"the broadcast of the step's loss and logs from rank {last_rank} (the last stage)",
            )
        loss, logs, normalizer, metric_updates, error = payload
        if error is not None:
            raise error
        if deferred is not None:
            deferred.end(normalizer)
            # the next step's losses are divided by this one's counted targets already (every rank got them)
            self._expected_normalizer = normalizer if normalizer > 0 else 1.0
        if self.global_rank != last_rank and metric_updates:
            self.metric_states.apply(metric_updates, self.root_device)
        if not early.sent:
            self._replay_logs(logs)
        dtype = torch.get_default_dtype() if loss is None else next(
            (p.dtype for p in self.lightning_module.parameters() if p.is_floating_point()), torch.float32
        )
        return None if loss is None else loss.to(self.root_device, dtype), outcome

    def _replay_logs(self, logs: list) -> None:
        """The step's reduced ``self.log`` calls, made on this rank's module (every rank logs alike)."""
        with compat.logged_values_in_place():
            for call in logs:
                value = self.metric_states.resolve(call.value, self.root_device)
                value = value.to(self.root_device) if isinstance(value, Tensor) else value
                self.lightning_module.log(call.name, value, **call.kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        trainer = self.lightning_module.trainer
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if batch_idx % trainer.accumulate_grad_batches == 0:
            for optimizer in self.optimizers:
                self.lightning_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        with self.precision_plugin.train_step_context():
            loss, _ = self._run("training_step", tuple(args) + tuple(kwargs.values()), train=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            self._run("validation_step", tuple(args) + tuple(kwargs.values()), train=False)
        return None

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            self._run("test_step", tuple(args) + tuple(kwargs.values()), train=False)
        return None

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions of the whole batch, on the pipeline's first rank (None on the others)."""
        with self.precision_plugin.predict_step_context():
            _, outcome = self._run("predict_step", tuple(args) + tuple(kwargs.values()), train=False)
        outputs = [outcome.step_outputs[mb] for mb in sorted(outcome.step_outputs)]
        predictions = _concatenate(outputs) if outputs else None
        first_rank = self.layout.pipeline_ranks()[0]
        last_rank = self.layout.pipeline_ranks()[self.program.rank_of(self.program.num_stages - 1)]
        if first_rank != last_rank:
            predictions = collectives.broadcast_object(predictions, last_rank, self.groups.pipeline)
        return predictions if self.global_rank == first_rank else None

    def gather_from_pipeline(self, obj: Any) -> list[Any] | None:
        """Collect one object per pipeline rank on global rank 0 (a collective of the first replica's
        pipeline; other replicas return None at once). For monitors: per-rank timings and memory."""
        if self.layout.data_parallel_rank != 0:
            return None
        if self.pipeline_parallel_size == 1:
            return [obj]
        return collectives.gather_objects(obj, self.layout.pipeline_ranks()[0], self.groups.pipeline)

    @property
    def first_in_pipeline(self) -> bool:
        """Whether this process runs its pipeline's first rank (the one that decides for the pipeline)."""
        return self.global_rank == self.layout.pipeline_ranks()[0]

    def share_in_pipeline(self, obj: Any, what: str) -> Any:
        """The pipeline's first rank's ``obj`` on every rank of this pipeline (a collective of the
        pipeline). For planners: a search stopped by a time limit may end differently on another rank,
        so one rank searches and every stage runs what it found. ``what`` names it in timeout errors."""
        if self.pipeline_parallel_size == 1:
            return obj
        first = self.layout.pipeline_ranks()[0]
        return collectives.broadcast_object(obj, first, self.groups.pipeline, f"{what} from rank {first} (its pipeline's first)")

    # --- optimization ---------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Synchronize gradients (tied copies, data-parallel replicas) after the step, before clipping.

        With optimizer offload and a gradient scaler (16-mixed), the stage optimizers have already
        scaled, unscaled, stepped (or undone) and updated the scale inside the closure, and every
        device gradient is gone: the plain precision step runs instead of the scaler's (whose
        ``unscale_``/``step`` would find no gradients), so the hooks still run and the user's
        optimizer steps nothing.
        """

        calls = 0

        def closure_then_synchronize() -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:  # before it runs the pipelined step a second time
                name = type(getattr(optimizer, "optimizer", optimizer)).__name__
                raise RuntimeError(
                    f"`{name}.step` called its closure a second time in one step: `{type(self).__name__}` runs the "
                    "pipelined forward and backward once per optimizer step and does not support optimizers that "
                    "re-evaluate the loss. Use a first-order optimizer (SGD, Adam, ...)."
                )
            with self.step_clock.aside():  # the closure (the pipelined step) is not the optimizer's
                result = closure()
                with self.step_clock.measure("gradient_sync"):
                    self._synchronize_gradients(optimizer)
            return result

        with self.step_clock.measure("optimizer"):
            if self.memory.grad_scaler is not None:
                model = model or self.lightning_module
                return Precision.optimizer_step(self.precision_plugin, optimizer, model, closure_then_synchronize, **kwargs)
            return super().optimizer_step(optimizer, closure_then_synchronize, model, **kwargs)

    def _owned_parameters(self, optimizer: Optimizer) -> list[Tensor]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return [p for group in optimizer.param_groups for p in group["params"] if p.device.type != "meta"]

    def _synchronize_gradients(self, optimizer: Optimizer) -> None:
        if self.split_placement is not None:
            return self.split_placement.synchronize_gradients(self, optimizer)
        self._sum_shared_gradients()
        collectives.average_gradients(
            self._owned_parameters(optimizer), self.groups.data_parallel, self.layout.data_parallel_size,
            operation=f"the gradient average of stages {list(self.spans)} over data-parallel replicas",
        )
        if self.regrouping is not None:
            self.regrouping.sum_gradients(self._owned_parameters(optimizer), self.program, self.global_rank)

    def _global_gradient_norm(self, grads: list[Tensor]) -> Tensor:
        if self.split_placement is not None:
            return self.split_placement.global_norm(self, grads)
        counted_twice = {  # a shared parameter's gradient counts once, on its lowest holder
            id(p.grad) for p, holders in self._shared if p is not None and holders[0] != self.layout.pipeline_rank
        }
        squares = [g.double().pow(2).sum() for g in grads if id(g) not in counted_twice]
        local = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=self.root_device)
        if self.regrouping is not None:
            local = self.regrouping.norm_share(local, self.program, self.global_rank)
        return collectives.global_norm(local, self.groups.pipeline)

    # --- collectives Lightning asks for ---------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if collectives.is_initialized():
            collectives.barrier(operation=f"Lightning's barrier {name or ''}".rstrip())

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not collectives.is_initialized():
            return obj
        return collectives.broadcast_object(obj, src, None, f"Lightning's broadcast from rank {src}")

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Combine a decision of every process (Lightning's default goes through :meth:`reduce`, which
        here spans only data-parallel replicas: ModelCheckpoint would never see a unanimous vote)."""
        if not collectives.is_initialized():
            return decision
        votes = torch.tensor(int(decision), device=self.root_device)
        collectives.all_reduce_tensor(votes, "sum", "Lightning's vote of every process (reduce_boolean_decision)")
        return bool(votes == self.world_size) if all else bool(votes > 0)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce over data-parallel replicas: every rank of a pipeline holds the same replayed value."""
        if not isinstance(tensor, Tensor) or not collectives.is_initialized():
            return tensor
        group = group or self.groups.data_parallel
        with naming_failures("a reduction of logged values over data-parallel replicas", group):
            return compat.sync_ddp(tensor, group=group, reduce_op=reduce_op)

    # --- checkpoints (checkpointing.py: one file; distributed_checkpoint.py: sharded) -------------

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Copy the checkpoint's tensors into the units this rank holds (the rest stay on meta, silently)."""
        checkpointing.load_module_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """For a checkpoint: this rank's entries (sharded), or the full state dict on global rank 0."""
        if self._save_distributed_checkpoint:
            return distributed_checkpoint.local_module_state(self.lightning_module)
        return checkpointing.full_module_state(self)

    def gather_module_state_dict(self) -> dict[str, Any]:
        """The whole module's state dict (every stage's tensors, the module's own names) on global rank 0,
        empty elsewhere: a collective that holds the whole model on one host (for small models)."""
        return checkpointing.full_module_state(self)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """For a checkpoint: this rank's state keyed by parameter name (sharded), or the complete state
        (every stage's entries) on global rank 0 in torch's index format."""
        if self._save_distributed_checkpoint:
            return distributed_checkpoint.local_optimizer_state(self, optimizer)
        return checkpointing.full_optimizer_state(self, optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Load each optimizer's state, keeping only the entries of parameters this rank owns (into the
        host optimizers with ``optimizer_offload=True``); with elastic depth, then move to the
        checkpoint's layout."""
        checkpointing.load_owned_optimizer_states(self, checkpoint["optimizer_states"])
        saved = self.regrouping and self.regrouping.saved_plan(checkpoint.get("pipeline"), self.plan, self.world_size)
        if saved:  # elastic depth resumes on the layout in effect at save time
            self.apply_plan(saved)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a sharded checkpoint directory (every rank its own entries) or, with
        ``save_distributed_checkpoint=False``, one file from global rank 0; both record the plan."""
        path = Path(self.broadcast(str(filepath)))
        checkpoint["pipeline"] = distributed_checkpoint.checkpoint_record(self, self._save_distributed_checkpoint)
        if not self._save_distributed_checkpoint:
            if self.is_global_zero and is_sharded_checkpoint(path):
                remove_path(path)
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported with "
                "`save_distributed_checkpoint=True`: every rank writes its shard through torch.distributed.checkpoint, "
                "not through the `CheckpointIO` plugin."
            )
        self.sharded_checkpoints.save(checkpoint, path)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory is read through DCP into this run's layout (each rank reads what it owns
        now); a single file is read whole by every rank (each keeps its own entries)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if is_sharded_checkpoint(path):
            return self.sharded_checkpoints.load(self, path)
        return super().load_checkpoint(path, weights_only=weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint file or directory on global rank 0 (after an asynchronous save in flight
        is complete, so the checkpoint it replaces is never the only one lost)."""
        self.sharded_checkpoints.remove(Path(filepath))

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is written and in place (``async_save=True``)."""
        self.sharded_checkpoints.wait()

    @override
    def teardown(self) -> None:
        """Finish an asynchronous save, release the stage runner and move what this rank holds to the CPU
        (meta tensors stay meta)."""
        try:
            self.sharded_checkpoints.wait()
        finally:
            self._teardown_rest()

    def _teardown_rest(self) -> None:
        if getattr(self, "runner", None) is not None:
            self.runner.remove()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        compat.optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            move_real_tensors(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "elastic_pipe", cls, description="Pipeline parallelism for unchanged LightningModules (lightning-pipe)"
        )


def _check_arguments(arguments: dict[str, Any]) -> Packer | None:
    """Refuse combinations of :class:`ElasticPipelineStrategy` arguments that cannot run, before any
    process starts, saying what to change; returns the strategy's packer (None: no packing)."""
    loss_weights, packing, optimizer_offload = arguments["loss_weights"], arguments["packing"], arguments["optimizer_offload"]
    ranks_per_device, process_group_backend = arguments["ranks_per_device"], arguments["process_group_backend"]
    pipeline_parallel_size, num_microbatches = arguments["pipeline_parallel_size"], arguments["num_microbatches"]
    partition, async_save = arguments["partition"], arguments["async_save"]
    save_distributed_checkpoint = arguments["save_distributed_checkpoint"]
    check_loss_weights(loss_weights)
    packer: Packer | None = Packer() if packing is True else (packing or None)
    if packer is not None and not isinstance(packer, Packer):
        raise TypeError(f"`packing` must be a bool or a `Packer`, got {type(packing).__name__}.")
    if packer is not None and loss_weights == "samples":
        raise ValueError(
            "`packing` puts several sequences in one microbatch row, so `loss_weights='samples'` cannot weight "
            "them: use `loss_weights='auto'` (counted tokens) or turn `packing` off."
        )
    if packer is not None and optimizer_offload and loss_weights == "auto":
        target = "shift_labels" if packer.slicing else "labels"
        raise ValueError(
            "`packing` with `optimizer_offload=True`: the stage optimizers step during backward, before the packed "
            "microbatches' counted targets are known, so `loss_weights='auto'` cannot weight them. Pass "
            f"`loss_weights=lambda mb: (mb['{target}'] != -100).sum()` (the targets each packed row counts), "
            "or turn `optimizer_offload` off."
        )
    if ranks_per_device < 1:
        raise ValueError(f"`ranks_per_device` must be at least 1, got {ranks_per_device}.")
    if ranks_per_device > 1 and process_group_backend == "nccl":
        raise ValueError(
            f"`ranks_per_device={ranks_per_device}` shares one device between ranks, which NCCL refuses "
            "('Duplicate GPU detected'). Leave `process_group_backend` unset (gloo is used) or use one rank per device."
        )
    if pipeline_parallel_size is not None and pipeline_parallel_size < 1:
        raise ValueError(f"`pipeline_parallel_size` must be at least 1, got {pipeline_parallel_size}.")
    if num_microbatches is not None and num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be at least 1, got {num_microbatches}.")
    if isinstance(partition, str) and partition not in ("uniform", "balanced", "auto"):
        raise ValueError(f"`partition={partition!r}`: use 'uniform', 'balanced', 'auto' or a list of blocks per stage.")
    if async_save and not save_distributed_checkpoint:
        raise ValueError(
            "`async_save=True` writes sharded checkpoints on a background thread; it needs "
            "`save_distributed_checkpoint=True` (a consolidated file is gathered on rank 0 in the step)."
        )
    return packer


def _regrouping(enabled: bool, arguments: dict[str, Any]) -> Regrouping | None:
    """``elastic_depth=True``: check the other arguments and return the regrouping helper."""
    if not enabled:
        return None
    memory = {k: arguments[k] for k in ("memory_budget", "recompute", "offload", "mlp_chunk_size")}
    Regrouping.check_configuration(
        pipeline_parallel_size=arguments["pipeline_parallel_size"], schedule=arguments["self"].schedule,
        optimizer_offload=arguments["optimizer_offload"], packing=bool(arguments["packing"]),
        ranks_per_device=arguments["ranks_per_device"], memory_settings=memory,
    )
    return Regrouping()


@dataclasses.dataclass
class _EarlyOutcome:
    """What the last stage's side task did with the step's outcome: computed it, sent it early, or
    failed (raised at the step's end, as before the task existed)."""

    payload: tuple | None = None
    sent: bool = False
    error: Exception | None = None


def _marked(call: Any, metric_states: MetricStates) -> Any:
    """The call with a torchmetrics value replaced by its marker (see ``model/metrics.py``)."""
    value = metric_states.mark(call.value)
    return call if value is call.value else dataclasses.replace(call, value=value)


def _log_weights(outcome: Any, mb: int, loss_weight: float, sample_weight: float) -> list[float]:
    """Weights of microbatch ``mb``'s log calls for a "mean" reduction: the step's loss weight for
    the returned loss, counted targets for other traced loss means, samples for the rest."""
    record = outcome.loss_records.get(mb)
    result = []
    for call in outcome.logs[mb]:
        traced = record.logged.get(id(call.value)) if record is not None else None
        if traced is None:
            result.append(sample_weight)
        elif record.returned is not None and (traced.call, traced.kind) == (record.returned.call, record.returned.kind):
            result.append(loss_weight)
        elif traced.kind == "mean":
            result.append(float(record.count_of(traced)))
        else:
            result.append(sample_weight)
    return result


def _unit_owners(boundaries: tuple[int, ...], program: Program, pipeline_size: int, num_units: int) -> list[set[int]]:
    """Per unit, the pipeline ranks that hold it."""
    owners: list[set[int]] = [set() for _ in range(num_units)]
    for rank in range(pipeline_size):
        for unit in owned_units(boundaries, program.stages_of(rank)):
            owners[unit].add(rank)
    return owners


def _concatenate(outputs: list[Any]) -> Any:
    """Join per-microbatch outputs along the batch dimension (tensors, and containers of them)."""
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs) if first.dim() > 0 else torch.stack(outputs)
    if isinstance(first, dict):
        return {k: _concatenate([o[k] for o in outputs]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_concatenate(list(items)) for items in zip(*outputs))
    return outputs
