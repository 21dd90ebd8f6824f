"""Callbacks used by tests to force plan changes."""

from __future__ import annotations

import json
import random

import lightning as L

from lightning_pipe.planning.boundaries import random_partition
from lightning_pipe.planning.plan import PipelinePlan
from lightning_pipe.schedules import resolve_schedule


class RandomPlans(L.Callback):
    """Before every batch, switch to a random partition (and schedule from ``schedules``).

    Every rank draws the same plan: the generator is seeded by the batch index.
    """

    def __init__(self, schedules: list[str], seed: int = 0) -> None:
        self.schedules = schedules
        self.seed = seed
        self.moved_bytes = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        strategy = trainer.strategy
        rng = random.Random(self.seed * 1000 + batch_idx)
        schedule = resolve_schedule(rng.choice(self.schedules))
        num_stages = strategy.pipeline_parallel_size * schedule.stages_per_rank
        boundaries = random_partition(strategy.unit_layout.num_blocks, num_stages, rng.randrange(2**31))
        report = strategy.apply_plan(PipelinePlan(boundaries, schedule, strategy.num_microbatches))
        self.moved_bytes += report.bytes_sent
        pl_module.log("moved_bytes", float(self.moved_bytes), reduce_fx="sum")


class RecordPlans(L.Callback):
    """Global rank 0 appends the plan each step ran with to ``path`` (one JSON line per step)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            strategy = trainer.strategy
            with open(self.path, "a") as f:
                f.write(json.dumps({"schedule": strategy.schedule.name, "boundaries": list(strategy.boundaries)}) + "\n")


def read_plans(path) -> list[dict]:
    """The plans :class:`RecordPlans` wrote."""
    with open(path) as f:
        return [json.loads(line) for line in f]


class SaveFullState(L.Callback):
    """At the end of training, global rank 0 saves the gathered full state dict to ``path``.

    For modules the main process cannot receive weights into (blocks built in ``configure_model``).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.gather_module_state_dict()  # a collective
        if trainer.global_rank == 0:
            import torch

            torch.save(state, self.path)


class BalancedMicrobatches(L.Callback):
    """Propose microbatch sizes balancing each batch's counted labels (``labels != -100``) per microbatch.

    Records the sizes of every batch in ``sizes`` (the same on every rank).
    """

    def __init__(self, num_microbatches: int) -> None:
        self.num_microbatches = num_microbatches
        self.sizes: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_pipe.planning.microbatching import balance_microbatch_sizes
        from lightning_pipe.planning.proposals import PlanProposal

        counted = (batch["labels"] != -100).sum(1).tolist()
        sizes = balance_microbatch_sizes(counted, self.num_microbatches)
        self.sizes.append(sizes)
        trainer.strategy.propose(PlanProposal("BalancedMicrobatches", microbatch_sizes=sizes))


class RandomJointPlans(L.Callback):
    """Before every batch, propose a random joint plan: family, partition, microbatch count and uneven
    sizes, and a random memory plan per (stage, microbatch). Every rank draws the same (seeded by the
    batch index). ``plans`` keeps what was proposed (``PipelinePlan.describe()``)."""

    def __init__(self, schedules: list[str], seed: int = 0) -> None:
        self.schedules = schedules
        self.seed = seed
        self.plans: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_pipe.planning.memory_model import MemoryPlan, StageMemory
        from lightning_pipe.planning.plan import PipelinePlan
        from lightning_pipe.planning.proposals import PlanProposal
        from lightning_pipe.runtime.microbatch import batch_size_of

        strategy = trainer.strategy
        rng = random.Random(self.seed * 1000 + batch_idx)
        schedule = resolve_schedule(rng.choice(self.schedules))
        ranks = strategy.pipeline_parallel_size
        num_stages = ranks * schedule.stages_per_rank
        boundaries = random_partition(strategy.unit_layout.num_blocks, num_stages, rng.randrange(2**31))
        samples = batch_size_of(batch)
        count = rng.choice([n for n in range(1, samples + 1) if _builds(schedule, ranks, n)])
        cuts = sorted(rng.sample(range(1, samples), count - 1))
        sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, samples]))
        split = schedule.name.startswith("zb")
        choices = {}
        for stage in range(num_stages):
            for mb in range(count):
                choices[(stage, mb)] = StageMemory(
                    full=rng.randint(0, 1), keep_attention=0 if split else rng.randint(0, 1), offload=rng.randint(0, 1),
                )
        memory = MemoryPlan(microbatches=choices)
        proposal = PlanProposal(
            "RandomJointPlans", boundaries=boundaries, schedule=schedule, microbatch_sizes=sizes, memory=memory
        )
        self.plans.append(PipelinePlan(boundaries, schedule, count, memory, sizes).describe())
        strategy.propose(proposal)


def _builds(schedule, ranks: int, count: int) -> bool:
    """Whether ``schedule`` has a program for ``count`` microbatches (some families need multiples)."""
    try:
        schedule.build(ranks, count)
    except ValueError:
        return False
    return True


class RandomLayouts(L.Callback):
    """Before every batch, propose a random layout of stages and widths (elastic depth): the widths
    drawn from ``layouts`` (never the running one twice in a row) and random boundaries. Every rank
    draws the same (seeded by the batch index). ``widths`` keeps what was proposed."""

    def __init__(self, layouts: list[tuple[int, ...]], seed: int = 0) -> None:
        self.layouts = layouts
        self.seed = seed
        self.widths: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_pipe.planning.proposals import PlanProposal

        strategy = trainer.strategy
        rng = random.Random(self.seed * 1000 + batch_idx)
        running = strategy.plan.widths or (1,) * strategy.plan.num_stages
        widths = rng.choice([w for w in self.layouts if w != running])
        boundaries = random_partition(strategy.unit_layout.num_blocks, len(widths), rng.randrange(2**31))
        self.widths.append(widths)
        strategy.propose(PlanProposal("RandomLayouts", boundaries=boundaries, widths=widths))


class RecordSplit(L.Callback):
    """Every rank writes the split-backward shares its planners priced ``I`` and ``W`` with
    (``[input, weight, first stage's input, first stage's weight]``, or null) to ``directory``."""

    def __init__(self, directory) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        estimate = trainer.strategy.costs.estimate
        split = None if estimate is None else estimate.cost_model.split_backward
        shares = None if split is None else [split.input_share, split.weight_share, *split.shares(0)]
        (self.directory / f"split{trainer.global_rank}.json").write_text(json.dumps(shares))


def read_splits(directory, num_ranks: int) -> list:
    """What :class:`RecordSplit` wrote, per rank."""
    return [json.loads((directory / f"split{rank}.json").read_text()) for rank in range(num_ranks)]
