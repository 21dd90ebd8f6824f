"""Runs a HelixPipe program (``schedules.helix``) on one rank: sub-block units, split placement.

The program's stages follow a microbatch through the model (``families/helix.py``): stage 0 is the
embedding and pre-attention of block 0, stage ``2l + 1`` the attention of block ``l``, stage ``2l``
post-attention of block ``l - 1`` with pre-attention of block ``l``, stage ``2L`` post-attention of the
last block with the head and the loss. Blocks are :class:`~lightning_pipe.model.SubBlockUnits`. What a
stage sends is its units' outputs: attention inputs and the carried values (the residual stream and
sizes) forward, their gradients back; an attention stage passes the carried values through, so the
residual travels with its microbatch (the paper's 2bsh per hop). Sizes travel as 0-d int64 tensors.

The actions run in ``runtime/split_executor.py``: under recomputation without attention (a
``RECOMPUTE`` of each unit stage in the program) a unit's ``F`` runs without autograd, keeping its
inputs and the RNG state, and its ``RECOMPUTE`` runs it again just before its ``B``; attention
stages keep their activations. Messages carry shapes and dtypes, so any microbatch length works.

Two ways to say what the non-block code is: :class:`HelixParts` (embedding, head and loss as
functions) or :class:`StepHelixStages`, which runs the user's own unchanged step function through a
:class:`~lightning_pipe.model.StageRunner` (the strategy's mechanism: non-block code for real, other
blocks as placeholders), cutting it at the block whose pre-attention the stage runs. The strategy runs
``schedule="helix"`` with the latter (``strategies/split_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model._torch_compat import tree_flatten
from lightning_pipe.model.blocks import BlockStack
from lightning_pipe.model.stage_runner import StageRunner, StageSpan
from lightning_pipe.model.sub_blocks import SubBlockUnits, split_block_at_attention
from lightning_pipe.runtime.p2p import PointToPoint
from lightning_pipe.runtime.split_executor import SplitPlacementExecutor

__all__ = [
    "HelixExecutor", "HelixParts", "HelixStages", "StepHelixStages", "capture_block_call", "helix_holdings", "split_stack",
]


@dataclass
class HelixParts:
    """The model as HelixPipe runs it.

    Attributes:
        embed: microbatch -> hidden states entering block 0.
        blocks: the blocks cut at their attention, in order.
        head_loss: (last block's output, microbatch) -> the microbatch's loss.
        block_kwargs: microbatch -> the keyword arguments every block call gets besides the hidden
            states (rotary tables, masks), computed where a block's pre-attention runs; None: none.
    """

    embed: Callable[[Any], Tensor]
    blocks: Sequence[SubBlockUnits]
    head_loss: Callable[[Tensor, Any], Tensor]
    block_kwargs: Callable[[Any], dict[str, Any]] | None = None


class HelixStages:
    """The stages of a helix program for :class:`HelixParts` (see the module docstring)."""

    def __init__(self, parts: HelixParts) -> None:
        self.parts = parts
        self.num_stages = 2 * len(parts.blocks) + 1
        first = parts.blocks[0]
        self._attention_inputs = first.num_attention_inputs
        self._carried = list(first.carried_tensors)

    def compute(self, stage: int, microbatch: Any, inputs: list[Any]) -> list[Any]:
        """Stage ``stage`` on ``inputs``: attention, or post-attention of one block and pre-attention of
        the next (the embedding first, the head and loss last)."""
        blocks, last = self.parts.blocks, self.num_stages - 1
        layer, attention = divmod(stage, 2)
        if attention:
            out = blocks[layer].run_attention(*inputs[: self._attention_inputs])
            return [out, *inputs[self._attention_inputs :]]
        if stage == 0:
            hidden = self.parts.embed(microbatch)
        else:
            hidden = blocks[layer - 1].run_post(inputs[0], *inputs[1:])
        if stage == last:
            return [self.parts.head_loss(hidden, microbatch)]
        kwargs = self.parts.block_kwargs(microbatch) if self.parts.block_kwargs is not None else {}
        attention_inputs, carried = blocks[layer].run_pre(hidden, **kwargs)
        return [*attention_inputs, *carried]

    def input_tensors(self, stage: int) -> list[bool]:
        """Attention inputs (or the attention output) are tensors; carried values may be sizes."""
        if stage == 0:
            return []
        return [True] * (self._attention_inputs if stage % 2 else 1) + self._carried


class HelixExecutor(SplitPlacementExecutor):
    """:class:`~lightning_pipe.runtime.split_executor.SplitPlacementExecutor` for :class:`HelixParts`.

    Args:
        parts: the model's embedding, blocks and head.
        p2p: transfer layer of the pipeline group.
        pipeline_ranks: global rank of every pipeline rank.
        pipeline_rank: this rank's index.
        device: where received tensors go.
    """

    def __init__(
        self, parts: HelixParts, p2p: PointToPoint, pipeline_ranks: list[int], pipeline_rank: int, device: torch.device
    ) -> None:
        super().__init__(HelixStages(parts), p2p, pipeline_ranks, pipeline_rank, device)


class _PreAttentionDone(BaseException):
    """Stops the user's step once the stage's pre-attention ran."""


class _Captured(BaseException):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args_, self.kwargs = args, kwargs


def capture_block_call(root: torch.nn.Module, block: torch.nn.Module, step_name: str, step_args: tuple) -> tuple[tuple, dict]:
    """The arguments ``block`` is called with when ``root.<step_name>(*step_args)`` runs (the step is
    stopped there, without autograd): example arguments to capture the block with."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Captured(args, kwargs)

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    log = getattr(root, "log", None)
    try:
        root.log = lambda *a, **k: None  # type: ignore[method-assign]
        with torch.no_grad():
            getattr(root, step_name)(*step_args)
    except _Captured as captured:
        return captured.args_, captured.kwargs
    finally:
        handle.remove()
        if log is not None:
            root.log = log  # type: ignore[method-assign]
        else:
            root.__dict__.pop("log", None)
    raise RuntimeError(f"`{step_name}` returned without calling the block stack")


def split_stack(root: torch.nn.Module, stack: BlockStack, step_name: str, step_args: tuple) -> list[SubBlockUnits]:
    """Every block of ``stack`` cut at its attention: one capture of block 0 with the arguments the
    step gives it, rebound to the others (same class and parameter shapes)."""
    args, kwargs = capture_block_call(root, stack.blocks[0], step_name, step_args)
    first = split_block_at_attention(stack.blocks[0], args, kwargs)
    return [first] + [first.rebind(block) for block in stack.blocks[1:]]


class StepHelixStages(HelixStages):
    """Helix stages that run the user's own step function for everything outside the blocks.

    Stage 0 runs the step up to block 0 and that block's pre-attention; unit stage ``2l`` runs the step
    as a stage of block ``l`` whose input (block ``l - 1``'s output) is post-attention of block ``l - 1``
    on the received values; the last stage runs the step after the last block from post-attention of
    it, returning the step's loss. The runner must not be running anything else.

    Args:
        runner: the module's stage runner (its blocks wrapped).
        blocks: the blocks cut at their attention (:func:`split_stack`).
        step_name: the step function (``"training_step"``).
        loss: picks the loss from what the step returns; default: the value, or its ``"loss"``.
    """

    def __init__(
        self,
        runner: StageRunner,
        blocks: Sequence[SubBlockUnits],
        step_name: str = "training_step",
        loss: Callable[[Any], Tensor] | None = None,
    ) -> None:
        super().__init__(HelixParts(embed=_unused, blocks=blocks, head_loss=_unused))
        self.runner, self.step_name = runner, step_name
        self.loss = loss or (lambda output: output["loss"] if isinstance(output, dict) else output)
        self.logs: dict[int, list] = {}
        self.recorder: Any = None  # a runtime.split_step.LastStageRecorder: the last stage's outcome (the strategy's)

    def compute(self, stage: int, microbatch: Any, inputs: list[Any]) -> list[Any]:
        """One stage for ``microbatch``: the step's arguments, ``(batch, batch_idx)``."""
        layer, attention = divmod(stage, 2)
        if attention:
            return super().compute(stage, microbatch, inputs)
        blocks, num_blocks = self.parts.blocks, len(self.parts.blocks)
        captured: list[Any] = []

        def receive(metas: list[Tensor]) -> list[Tensor]:
            hidden = blocks[layer - 1].run_post(inputs[0], *inputs[1:])
            return [t for t in tree_flatten(hidden)[0] if isinstance(t, Tensor)]

        def pre_attention(index: int, original: Callable, args: tuple, kwargs: dict) -> Any:
            attention_inputs, carried = blocks[index].run_pre(*args, **kwargs)
            captured.extend([*attention_inputs, *carried])
            raise _PreAttentionDone  # the rest of the block and of the step run on other stages

        first = min(layer, num_blocks)
        span = StageSpan(stage, first, min(layer + 1, num_blocks), num_blocks)

        def run(observers: tuple = ()) -> Any:
            return self.runner.run(
                self.step_name, tuple(microbatch), span, receive=receive if stage else None, wrap_block=pre_attention,
                observers=observers,
            )

        if stage == self.num_stages - 1 and self.recorder is not None:
            return self.recorder.run(microbatch, run)
        try:
            result = run()
        except _PreAttentionDone:
            return captured
        self.logs[id(microbatch)] = result.logs
        return [self.loss(result.step_output)]


def _unused(*args: Any) -> Any:
    raise AssertionError("StepHelixStages runs the user's step for the embedding and the head")


def helix_holdings(
    root: torch.nn.Module, stack: BlockStack, units: Sequence[SubBlockUnits], pre_names: Sequence[str],
    post_names: Sequence[str], num_ranks: int,
) -> list[set[str]] | None:
    """Per pipeline rank, the parameter names (aliases included) its helix stages use, or None when a
    parameter would be needed on two ranks or on none (then the module stays whole on every rank).

    Unit stage ``2l`` runs on rank ``l mod p``: pre-attention of block ``l`` (and ``pre_names``, the
    embedding side, for ``l = 0``), post-attention of block ``l - 1`` (and ``post_names``, the head
    side, for ``l = L``). Attention stages use no parameters.
    """
    named = dict(root.named_parameters(remove_duplicate=False))
    ids: list[set[int]] = [set() for _ in range(num_ranks)]
    num_blocks = len(units)

    def add(rank: int, names: Any) -> None:
        ids[rank].update(id(named[n]) for n in names if n in named)

    for layer in range(num_blocks + 1):
        rank = layer % num_ranks
        if layer == 0:
            add(rank, pre_names)
        if layer == num_blocks:
            add(rank, post_names)
        if layer < num_blocks:
            add(rank, (f"{stack.block_path(layer)}.{n}" for n in units[layer].tensor_names("pre")))
        if layer >= 1:
            add(rank, (f"{stack.block_path(layer - 1)}.{n}" for n in units[layer - 1].tensor_names("post")))
    every = {id(t) for t in named.values()}
    if set().union(*ids) != every or sum(len(i) for i in ids) != len(every):
        return None
    return [{n for n, t in named.items() if id(t) in mine} for mine in ids]
