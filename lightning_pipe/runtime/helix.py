"""Runs a HelixPipe program (``schedules.helix``) on one rank: sub-block units, split placement.

The program's stages follow a microbatch through the model (``families/helix.py``): stage 0 is the
embedding and pre-attention of block 0, stage ``2l + 1`` the attention of block ``l``, stage ``2l``
post-attention of block ``l - 1`` with pre-attention of block ``l``, stage ``2L`` post-attention of the
last block with the head and the loss. Blocks are :class:`~lightning_pipe.model.SubBlockUnits`. What a
stage sends is its units' outputs: attention inputs and the carried values (the residual stream and
sizes) forward, their gradients back; an attention stage passes the carried values through, so the
residual travels with its microbatch (the paper's 2bsh per hop). Sizes travel as 0-d int64 tensors.

Actions: ``F`` runs a stage; under recomputation without attention (a ``RECOMPUTE`` of the stage in
the program) a unit's ``F`` runs without autograd, keeping its inputs and the RNG state, and its
``RECOMPUTE`` runs it again with autograd just before its ``B``; attention stages keep their
activations. ``B`` back-propagates the received output gradients (the scaled loss on the last
stage) and keeps the input gradients for ``SEND_B``. Receives happen where their tensors are used
(``RECV_*`` are no-ops, as in ``executor.py``); messages carry shapes and dtypes (``describe``), so
any microbatch length works. Local hops (both stages on this rank) hand tensors over in memory.

Scope: this runs the program for a model given as three parts (``HelixParts``: embedding, units,
head with loss); the strategy does not build those parts from a LightningModule yet, so
``schedule="helix"`` is not available through ``ElasticPipelineStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.sub_blocks import SubBlockUnits
from lightning_pipe.runtime.p2p import ACTIVATION, GRADIENT, PointToPoint
from lightning_pipe.schedules.ir import ActionType, Program

__all__ = ["HelixExecutor", "HelixParts"]


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


@dataclass
class _Slot:
    inputs: list[Any]
    outputs: list[Any] | None = None
    rng: Tensor | None = None
    input_grads: list[Tensor] = field(default_factory=list)


def _is_float(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


class HelixExecutor:
    """Runs this rank's actions of a helix program.

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
        self.parts = parts
        self.p2p = p2p
        self.pipeline_ranks = pipeline_ranks
        self.pipeline_rank = pipeline_rank
        self.device = device
        first = parts.blocks[0]
        self._attention_inputs = first.num_attention_inputs
        self._carried = first.carried_tensors

    def run(self, program: Program, microbatches: Sequence[Any], loss_scales: Sequence[float]) -> dict[int, Tensor]:
        """Run one step; returns the losses of the microbatches whose last stage ran here."""
        if program.num_stages != 2 * len(self.parts.blocks) + 1:
            raise ValueError(
                f"program {program.name!r} has {program.num_stages} stages; a helix program for "
                f"{len(self.parts.blocks)} blocks has {2 * len(self.parts.blocks) + 1}"
            )
        self._program, self._microbatches, self._scales = program, microbatches, loss_scales
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._local: dict[tuple[int, int], list[Any]] = {}
        self._local_grads: dict[tuple[int, int], list[Tensor]] = {}
        recomputed = {(a.stage, a.microbatch) for a in program.actions[self.pipeline_rank] if a.type is ActionType.RECOMPUTE}
        losses: dict[int, Tensor] = {}
        for action in program.actions[self.pipeline_rank]:
            kind, stage, mb = action.type, action.stage, action.microbatch
            if kind is ActionType.FORWARD:
                self._forward(stage, mb, (stage, mb) in recomputed, losses)
            elif kind is ActionType.RECOMPUTE:
                self._recompute(stage, mb)
            elif kind is ActionType.BACKWARD:
                self._backward(stage, mb)
            elif kind is ActionType.SEND_F:
                wire = [self._to_wire(v) for v in self._slots[(stage, mb)].outputs]  # type: ignore[union-attr]
                self.p2p.send(wire, self._global(program.forward_rank(stage + 1, mb)), ACTIVATION, stage, mb, describe=True)
            elif kind is ActionType.SEND_B:
                grads = self._slots[(stage, mb)].input_grads
                self.p2p.send(grads, self._global(program.backward_rank(stage - 1, mb)), GRADIENT, stage, mb)
            elif kind in (ActionType.RECV_F, ActionType.RECV_B):
                continue  # received where consumed
            else:
                raise RuntimeError(f"the helix executor has no runtime for {action} ({kind.name})")
        self.p2p.wait_sends()
        self._slots, self._local, self._local_grads = {}, {}, {}
        return losses

    # --- stages -----------------------------------------------------------------------------------

    def _compute(self, stage: int, mb: int, inputs: list[Any]) -> list[Any]:
        blocks, last = self.parts.blocks, self._program.num_stages - 1
        layer, attention = divmod(stage, 2)
        if attention:
            out = blocks[layer].run_attention(*inputs[: self._attention_inputs])
            return [out, *inputs[self._attention_inputs :]]
        if stage == 0:
            hidden = self.parts.embed(self._microbatches[mb])
        else:
            hidden = blocks[layer - 1].run_post(inputs[0], *inputs[1:])
        if stage == last:
            return [self.parts.head_loss(hidden, self._microbatches[mb])]
        kwargs = self.parts.block_kwargs(self._microbatches[mb]) if self.parts.block_kwargs is not None else {}
        attention_inputs, carried = blocks[layer].run_pre(hidden, **kwargs)
        return [*attention_inputs, *carried]

    def _forward(self, stage: int, mb: int, recompute: bool, losses: dict[int, Tensor]) -> None:
        inputs = self._inputs(stage, mb)
        slot = _Slot(inputs)
        if recompute:
            slot.rng = torch.get_rng_state()
            with torch.no_grad():
                outputs = self._compute(stage, mb, inputs)
        else:
            outputs = self._compute(stage, mb, inputs)
        slot.outputs = outputs
        self._slots[(stage, mb)] = slot
        if stage == self._program.num_stages - 1:
            losses[mb] = outputs[0].detach()
        elif self._program.forward_rank(stage + 1, mb) == self.pipeline_rank:
            self._local[(stage + 1, mb)] = outputs

    def _recompute(self, stage: int, mb: int) -> None:
        slot = self._slots[(stage, mb)]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(slot.rng)
            slot.outputs = self._compute(stage, mb, slot.inputs)

    def _backward(self, stage: int, mb: int) -> None:
        slot = self._slots.pop((stage, mb))
        assert slot.outputs is not None
        if stage == self._program.num_stages - 1:
            roots, grads = [slot.outputs[0] * self._scales[mb]], [None]
        else:
            floats = [v for v in slot.outputs if _is_float(v)]
            received = self._local_grads.pop((stage, mb), None)
            if received is None:
                src = self._global(self._program.backward_rank(stage + 1, mb))
                received = self.p2p.receive([(t.shape, t.dtype) for t in floats], src, GRADIENT, stage + 1, mb, self.device)
            pairs = [(t, g) for t, g in zip(floats, received, strict=True) if t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if roots:
            torch.autograd.backward(roots, grads)
        slot.input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in slot.inputs if _is_float(t)]
        self._slots[(stage, mb)] = _Slot([], None, None, slot.input_grads)  # only the gradients stay, for SEND_B
        if stage > 0 and self._program.backward_rank(stage - 1, mb) == self.pipeline_rank:
            self._local_grads[(stage - 1, mb)] = slot.input_grads

    # --- values -----------------------------------------------------------------------------------

    def _inputs(self, stage: int, mb: int) -> list[Any]:
        if stage == 0:
            return []
        values = self._local.pop((stage, mb), None)
        if values is None:
            count = self._attention_inputs + len(self._carried) if stage % 2 else 1 + len(self._carried)
            src = self._global(self._program.forward_rank(stage - 1, mb))
            shapes = [(torch.Size([]), torch.float64)] * count  # the header carries the real ones
            values = self.p2p.receive(shapes, src, ACTIVATION, stage - 1, mb, self.device, describe=True)
        tensor_flags = self._tensor_flags(stage)
        leaves: list[Any] = []
        for value, is_tensor in zip(values, tensor_flags, strict=True):
            if not is_tensor:
                leaves.append(int(value) if isinstance(value, Tensor) else value)
            elif _is_float(value):
                leaves.append(value.detach().requires_grad_(True))
            else:
                leaves.append(value.detach())
        return leaves

    def _tensor_flags(self, stage: int) -> list[bool]:
        """Which of a stage's inputs are tensors: attention inputs (or the attention output) are."""
        head = self._attention_inputs if stage % 2 else 1
        return [True] * head + list(self._carried)

    def _to_wire(self, value: Any) -> Tensor:
        if isinstance(value, Tensor):
            return value.detach()
        return torch.tensor(int(value), dtype=torch.int64, device=self.device)

    def _global(self, pipeline_rank: int) -> int:
        return self.pipeline_ranks[pipeline_rank]
