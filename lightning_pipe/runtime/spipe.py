"""SPipe's stages on the split-placement executor: ranges of whole blocks, parameters in shared memory.

``schedules.spipe`` cuts the model into ``D`` finer stages of ``L / D`` consecutive blocks each (the
embedding before the first, the head and loss after the last); a stage's forward runs on one rank
and its backward, which recomputes it from the checkpoint sent ahead, usually on another
(``runtime/split_executor.py`` runs the actions). The backward rank of a stage *owns* its parameters:
gradients accumulate there and its optimizer updates them. Every rank reads every parameter for its
forwards, so parameters live in host shared memory (``share_parameters`` before the ranks fork: torch
shared-memory storage, mapped by every process of one machine) and an update by the owner is seen by
all after the step's barrier.

SPipe's asynchronous per-stage host optimizer is ``runtime/optimizer_offload.StageOptimizers`` as it
is: give it, for every stage whose backward runs on the rank, the stage's parameters
(:meth:`SPipeStages.stage_modules`); each stage steps on a thread as soon as its gradients are final,
while the backward goes on, and ``finish`` copies the results into the shared parameters
(tests/runtime/test_spipe.py). Not exercised here: its loss-scale rollback under split placement.
Not here: transfers of parameters to a device (everything is host memory), multi-node access.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.schedules.ir import Program

__all__ = ["SPipeStages", "StepSPipeStages", "check_shared_parameters", "owned_parameters", "share_parameters"]


class SPipeStages:
    """The ``D`` finer stages of an SPipe program over a stack of whole blocks.

    Args:
        embed: microbatch -> hidden states entering block 0.
        blocks: the block stack; ``len(blocks)`` must be a multiple of ``num_stages``.
        head_loss: (last block's output, microbatch) -> the microbatch's loss.
        num_stages: the program's stages ``D = ranks x stages_per_rank x backward_split``.
        block_kwargs: microbatch -> keyword arguments of every block call; None: none.
    """

    def __init__(
        self,
        embed: Callable[[Any], Tensor],
        blocks: Sequence[nn.Module],
        head_loss: Callable[[Tensor, Any], Tensor],
        num_stages: int,
        block_kwargs: Callable[[Any], dict[str, Any]] | None = None,
    ) -> None:
        if len(blocks) % num_stages:
            raise ValueError(
                f"SPipe cuts the model into {num_stages} finer stages of equal block counts; {len(blocks)} blocks do "
                "not divide: change backward_split, stages_per_rank or the number of ranks"
            )
        self.embed, self.blocks, self.head_loss, self.block_kwargs = embed, list(blocks), head_loss, block_kwargs
        self.num_stages = num_stages
        self.per_stage = len(blocks) // num_stages

    def compute(self, stage: int, microbatch: Any, inputs: list[Any]) -> list[Any]:
        """The stage's blocks on its input (the embedding first, the head and loss last)."""
        hidden = self.embed(microbatch) if stage == 0 else inputs[0]
        kwargs = self.block_kwargs(microbatch) if self.block_kwargs is not None else {}
        for block in self.blocks[stage * self.per_stage : (stage + 1) * self.per_stage]:
            hidden = block(hidden, **kwargs)
        if stage == self.num_stages - 1:
            return [self.head_loss(hidden, microbatch)]
        return [hidden]

    def input_tensors(self, stage: int) -> list[bool]:
        """One tensor (the hidden states) into every stage but the first."""
        return [] if stage == 0 else [True]

    def stage_modules(self, stage: int, embedding: Sequence[nn.Module], head: Sequence[nn.Module]) -> list[nn.Module]:
        """The modules whose parameters ``stage`` uses (``embedding`` on the first, ``head`` on the last)."""
        modules: list[nn.Module] = list(self.blocks[stage * self.per_stage : (stage + 1) * self.per_stage])
        if stage == 0:
            modules = list(embedding) + modules
        if stage == self.num_stages - 1:
            modules += list(head)
        return modules


def share_parameters(module: nn.Module) -> nn.Module:
    """Move ``module``'s parameters and buffers to host shared memory (before the ranks fork)."""
    return module.share_memory()


def owned_parameters(
    program: Program, stages: SPipeStages, rank: int, embedding: Sequence[nn.Module], head: Sequence[nn.Module]
) -> list[Tensor]:
    """Parameters whose optimizer runs on ``rank``: those of the stages whose backward runs there."""
    seen: set[int] = set()
    owned = []
    for stage in range(program.num_stages):
        if program.backward_rank(stage, 0) != rank:
            continue
        for module in stages.stage_modules(stage, embedding, head):
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    owned.append(param)
    return owned


class StepSPipeStages:
    """SPipe's stages running the user's own step: stage ``s`` is blocks ``[s k, (s + 1) k)`` of the
    stack (``k = L / D``) as a stage of the :class:`~lightning_pipe.model.StageRunner`, the first with
    what runs before block 0, the last with the rest of the step and its loss.

    Args:
        runner: the module's stage runner.
        num_stages: the program's stages ``D``; must divide the block count.
        num_outputs: tensors a block's output flattens to (what one stage sends the next).
        step_name: the step function (``"training_step"``).
        loss: picks the loss from what the step returns; default: the value, or its ``"loss"``.
    """

    def __init__(
        self,
        runner: StageRunner,
        num_stages: int,
        num_outputs: int = 1,
        step_name: str = "training_step",
        loss: Callable[[Any], Tensor] | None = None,
    ) -> None:
        num_blocks = len(runner.stack.blocks)
        if num_blocks % num_stages:
            raise ValueError(f"SPipe: {num_stages} stages of equal block counts do not divide {num_blocks} blocks")
        self.runner, self.num_stages, self.step_name = runner, num_stages, step_name
        self.num_blocks, self.per_stage, self.num_outputs = num_blocks, num_blocks // num_stages, num_outputs
        self.loss = loss or (lambda output: output["loss"] if isinstance(output, dict) else output)
        self.recorder: Any = None  # a runtime.split_step.LastStageRecorder: the last stage's outcome

    def compute(self, stage: int, microbatch: Any, inputs: list[Any]) -> list[Any]:
        """The stage's part of the step for ``microbatch`` (the step's arguments) on ``inputs``."""
        span = StageSpan(stage, stage * self.per_stage, (stage + 1) * self.per_stage, self.num_blocks)

        def run(observers: tuple = ()) -> Any:
            return self.runner.run(
                self.step_name, tuple(microbatch), span, receive=(lambda metas: inputs) if stage else None,
                observers=observers,
            )

        if span.is_last:
            if self.recorder is not None:
                return self.recorder.run(microbatch, run)
            return [self.loss(run().step_output)]
        return list(run().outputs)

    def input_tensors(self, stage: int) -> list[bool]:
        """The previous stage's output tensors (none into the first)."""
        return [] if stage == 0 else [True] * self.num_outputs


def check_shared_parameters(module: nn.Module, group: dist.ProcessGroup | None, rank: int) -> None:
    """Check that the ranks of ``group`` map the same storage for ``module``'s first parameter (a
    collective): rank 0 writes a different value into it, the others must see it, rank 0 puts the old
    value back. Processes that were not forked after ``share_parameters`` each hold their own copy,
    where SPipe's owners' updates would never reach the others.

    Raises:
        RuntimeError: on every rank, when a rank does not see rank 0's write.
    """
    param = next((p for p in module.parameters() if p.numel()), None)
    if param is None or dist.get_world_size(group) == 1:
        return
    flat = param.data.view(-1)
    original = flat[:1].clone()
    dist.barrier(group=group)
    if rank == 0:
        flat[:1] = torch.where(original == 0, torch.ones_like(original), original * 2)
    dist.barrier(group=group)
    seen = torch.tensor([float(rank == 0 or bool((flat[:1] != original).all()))])
    dist.barrier(group=group)
    if rank == 0:
        flat[:1] = original
    dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=group)
    dist.barrier(group=group)
    if seen.item() < 1:
        raise RuntimeError(
            "SPipe: the ranks do not share the module's parameters in memory (a write by rank 0 is not seen by the "
            "others): parameters must go to shared memory (`module.share_memory()`) before the ranks fork "
            "(`start_method='fork'`), on one machine."
        )
