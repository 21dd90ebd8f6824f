"""Runs a program with split placement (``Program.pair_ranks``) on one rank: HelixPipe, SPipe.

A stage's forward and backward may run on different ranks, and one stage may run on different ranks
for different microbatches. What a stage computes comes from a :class:`SplitStages` object
(``runtime/helix.py``: blocks cut at their attention; ``runtime/spipe.py``: ranges of whole blocks);
this module only moves values and runs autograd, action by action:

* ``F``: the stage on its inputs (received, handed over locally, or the microbatch itself on stage
  0). When the pair is recomputed (a ``RECOMPUTE`` in the program, on this rank or on the rank of its
  backward) it runs without autograd and keeps its inputs and the RNG state (the checkpoint).
* ``SEND_F``/``SEND_B``: outputs forward (with their shapes and dtypes), input gradients back.
* ``SEND_C``: the checkpoint (inputs, then the RNG state as a byte tensor) to the rank of the pair's
  backward; ``RECOMPUTE`` receives it there (or takes the kept one) and runs the stage again with
  autograd under the forward's RNG state, so dropout draws the same numbers.
* ``B``: back-propagates the received output gradients (the scaled loss on the last stage) and keeps
  the input gradients for ``SEND_B``.
* ``RECV_*``: nothing; tensors are received where they are used, as in ``executor.py``.

Non-tensor values (sizes) travel as 0-d int64 tensors. Parameters are the module's own: where a
stage's backward runs, its parameters' ``.grad`` accumulates (SPipe's ranks share parameters in host
shared memory, ``runtime/spipe.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_pipe.runtime.executor import outside_autocast
from lightning_pipe.runtime.p2p import ACTIVATION, GRADIENT, PointToPoint
from lightning_pipe.schedules.ir import ActionType, Program

__all__ = ["SplitPlacementExecutor", "SplitStages"]

# A checkpoint of stage s is tagged as an activation of stage CHECKPOINT_TAG_OFFSET + s (tags hold
# stages below 256), so it never matches the stage's forward output of the same microbatch.
CHECKPOINT_TAG_OFFSET = 128


def _checkpoint_stage(stage: int) -> int:
    return CHECKPOINT_TAG_OFFSET + stage


class SplitStages(Protocol):
    """What the stages of a split-placement program compute."""

    num_stages: int

    def compute(self, stage: int, microbatch: Any, inputs: list[Any]) -> list[Any]:
        """The stage's outputs (the loss alone on the last stage) from its inputs."""

    def input_tensors(self, stage: int) -> list[bool]:
        """Per input of ``stage``: whether it is a tensor (False: a size or other int)."""


@dataclass
class _Slot:
    inputs: list[Any]
    outputs: list[Any] | None = None
    rng: Tensor | None = None
    input_grads: list[Tensor] = field(default_factory=list)


def _is_float(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


class SplitPlacementExecutor:
    """Runs this rank's actions of a split-placement program.

    Args:
        stages: what every stage computes.
        p2p: transfer layer of the pipeline group.
        pipeline_ranks: global rank of every pipeline rank.
        pipeline_rank: this rank's index.
        device: where received tensors go.
    """

    def __init__(
        self, stages: SplitStages, p2p: PointToPoint, pipeline_ranks: list[int], pipeline_rank: int, device: torch.device
    ) -> None:
        self.stages = stages
        self.p2p = p2p
        self.pipeline_ranks = pipeline_ranks
        self.pipeline_rank = pipeline_rank
        self.device = device

    def run(self, program: Program, microbatches: Sequence[Any], loss_scales: Sequence[float]) -> dict[int, Tensor]:
        """Run one step; returns the losses of the microbatches whose last forward ran here."""
        if program.num_stages != self.stages.num_stages:
            raise ValueError(f"program {program.name!r} has {program.num_stages} stages, the model {self.stages.num_stages}")
        if program.num_stages > CHECKPOINT_TAG_OFFSET:
            raise ValueError(f"split placement runs at most {CHECKPOINT_TAG_OFFSET} stages, got {program.num_stages}")
        self._program, self._microbatches, self._scales = program, microbatches, loss_scales
        self._slots: dict[tuple[int, int], _Slot] = {}
        self._local: dict[tuple[int, int], list[Any]] = {}
        self._local_grads: dict[tuple[int, int], list[Tensor]] = {}
        recomputed = {(a.stage, a.microbatch) for r in program.actions for a in r if a.type is ActionType.RECOMPUTE}
        shipped = [a for r in program.actions for a in r if a.type is ActionType.SEND_C]
        missing = next((a for a in shipped if (a.stage, a.microbatch) not in recomputed), None)
        if missing is not None:
            raise ValueError(
                f"program {program.name!r} ships the checkpoint {missing} but has no RECOMPUTE of that pair: a backward "
                "on another rank than its forward rebuilds the activations with an explicit RECOMPUTE action "
                "(build spipe with recompute_in_backward=False)"
            )
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
            elif kind is ActionType.SEND_C:
                slot = self._slots.pop((stage, mb))  # the forward rank keeps nothing once it is shipped
                wire = [self._to_wire(v) for v in slot.inputs] + [slot.rng]
                dst = self._global(program.backward_rank(stage, mb))
                self.p2p.send(wire, dst, ACTIVATION, _checkpoint_stage(stage), mb, describe=True)
            elif kind is ActionType.SEND_B:
                grads = self._slots.pop((stage, mb)).input_grads
                if stage > 0:
                    self.p2p.send(grads, self._global(program.backward_rank(stage - 1, mb)), GRADIENT, stage, mb)
            elif kind in (ActionType.RECV_F, ActionType.RECV_B, ActionType.RECV_C):
                continue  # received where consumed
            else:
                raise RuntimeError(f"the split-placement executor has no runtime for {action} ({kind.name})")
        self.p2p.wait_sends()
        self._slots, self._local, self._local_grads = {}, {}, {}
        return losses

    # --- actions ----------------------------------------------------------------------------------

    def _forward(self, stage: int, mb: int, recompute: bool, losses: dict[int, Tensor]) -> None:
        inputs = self._inputs(stage, mb)
        slot = _Slot(inputs)
        if recompute:
            slot.rng = torch.get_rng_state()
            with torch.no_grad():
                outputs = self.stages.compute(stage, self._microbatches[mb], inputs)
        else:
            outputs = self.stages.compute(stage, self._microbatches[mb], inputs)
        slot.outputs = outputs
        self._slots[(stage, mb)] = slot
        if stage == self._program.num_stages - 1:
            losses[mb] = outputs[0].detach()
        elif self._program.forward_rank(stage + 1, mb) == self.pipeline_rank:
            self._local[(stage + 1, mb)] = outputs

    def _recompute(self, stage: int, mb: int) -> None:
        slot = self._slots.get((stage, mb))
        if slot is None:  # the forward ran on another rank: its checkpoint arrives now
            slot = self._receive_checkpoint(stage, mb)
            self._slots[(stage, mb)] = slot
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(slot.rng)
            slot.outputs = self.stages.compute(stage, self._microbatches[mb], slot.inputs)

    def _receive_checkpoint(self, stage: int, mb: int) -> _Slot:
        src = self._global(self._program.forward_rank(stage, mb))
        count = 0 if stage == 0 else len(self.stages.input_tensors(stage))
        shapes = [(torch.Size([]), torch.float64)] * (count + 1)  # inputs, then the RNG state
        values = self.p2p.receive(shapes, src, ACTIVATION, _checkpoint_stage(stage), mb, self.device, describe=True)
        inputs = self._leaves(stage, values[:-1]) if stage > 0 else []
        return _Slot(inputs, rng=values[-1].cpu())

    def _backward(self, stage: int, mb: int) -> None:
        slot = self._slots[(stage, mb)]
        assert slot.outputs is not None, f"B of stage {stage} microbatch {mb} before its forward or recompute"
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
            with outside_autocast(self.device):
                torch.autograd.backward(roots, grads)
        input_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in slot.inputs if _is_float(t)]
        self._slots[(stage, mb)] = _Slot([], input_grads=input_grads)  # only the gradients stay, for SEND_B
        if stage > 0 and self._program.backward_rank(stage - 1, mb) == self.pipeline_rank:
            self._local_grads[(stage - 1, mb)] = input_grads

    # --- values -----------------------------------------------------------------------------------

    def _inputs(self, stage: int, mb: int) -> list[Any]:
        if stage == 0:
            return []
        values = self._local.pop((stage, mb), None)
        if values is None:
            flags = self.stages.input_tensors(stage)
            src = self._global(self._program.forward_rank(stage - 1, mb))
            shapes = [(torch.Size([]), torch.float64)] * len(flags)  # the header carries the real ones
            values = self.p2p.receive(shapes, src, ACTIVATION, stage - 1, mb, self.device, describe=True)
        return self._leaves(stage, values)

    def _leaves(self, stage: int, values: Sequence[Any]) -> list[Any]:
        leaves: list[Any] = []
        for value, is_tensor in zip(values, self.stages.input_tensors(stage), strict=True):
            if not is_tensor:
                leaves.append(int(value) if isinstance(value, Tensor) else value)
            elif _is_float(value):
                leaves.append(value.detach().requires_grad_(True))
            else:
                leaves.append(value.detach())
        return leaves

    def _to_wire(self, value: Any) -> Tensor:
        if isinstance(value, Tensor):
            return value.detach()
        return torch.tensor(int(value), dtype=torch.int64, device=self.device)

    def _global(self, pipeline_rank: int) -> int:
        return self.pipeline_ranks[pipeline_rank]
