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

Scope: this runs the program for a model given as three parts (``HelixParts``: embedding, units,
head with loss); the strategy does not build those parts from a LightningModule yet, so
``schedule="helix"`` is not available through ``ElasticPipelineStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.sub_blocks import SubBlockUnits
from lightning_pipe.runtime.p2p import PointToPoint
from lightning_pipe.runtime.split_executor import SplitPlacementExecutor

__all__ = ["HelixExecutor", "HelixParts", "HelixStages"]


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
