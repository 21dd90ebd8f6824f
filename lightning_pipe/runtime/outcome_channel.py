"""The step's outcome from the last stage to the rest of the pipeline, as a few numbers when it can be.

After every step the last stage sends its pipeline the loss, the reduced ``self.log`` calls, the
gradient's normalizer, metric updates and any error to raise (``ElasticPipelineStrategy._share_outcome``).
Pickled, that is two broadcasts (the size, then the bytes), each a round trip the other ranks wait for
at the very end of their step: about 3 ms a step on gloo, as much as the rest of the framework's
overhead on the last stage. But most steps log the same names with the same options as the step before.

So once every rank has seen a step's pickled outcome, it remembers its *schema*: whether it has a loss,
and per log call its name, options and value dtype, for outcomes made only of those (0-dim floating CPU
tensors or Python floats, no metric updates, no error). The next step of the same kind (step function
and last stage) then travels as one float64 vector ``[1, loss, normalizer, values...]``, which the other
ranks post the receive of at the *start* of their step, asynchronously, on a gloo group of its own: it
lands while they finish their backward. The last stage may send it before its own step ends
(:meth:`OutcomeChannel.send_early`, where its rank waits for others: ``runtime/side_task.py``). An
outcome that does not fit its schema sends ``[0, ...]`` followed by the pickled payload on the same
group, and its schema replaces the old one. Every value
converts to float64 and back exactly (float16, bfloat16, float32, float64), so replay is bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.model.stage_runner import LogCall
from lightning_pipe.runtime import collectives
from lightning_pipe.runtime.failures import naming_failures

__all__ = ["OutcomeChannel"]

Payload = tuple  # (loss or None, [LogCall], normalizer, metric updates, error or None)


@dataclass(frozen=True)
class _Schema:
    """What an outcome of one step kind holds apart from its numbers."""

    has_loss: bool
    calls: tuple[tuple[str, dict, torch.dtype | None], ...]  # name, log options, value dtype (None: a float)

    @property
    def length(self) -> int:
        return 3 + len(self.calls)  # flag, loss, normalizer, values

    @staticmethod
    def of(payload: Payload) -> _Schema | None:
        """The schema of ``payload``, or None if it holds more than numbers."""
        loss, logs, normalizer, metric_updates, error = payload
        if error is not None or metric_updates or not isinstance(normalizer, float):
            return None
        calls = []
        for call in logs:
            kind = _kind(call.value)
            if kind is False or not _plain(call.kwargs):
                return None
            calls.append((call.name, dict(call.kwargs), kind))
        return _Schema(loss is not None, tuple(calls))

    def encode(self, payload: Payload) -> Tensor | None:
        """``[1, loss, normalizer, values...]`` if ``payload`` fits this schema, else None."""
        loss, logs, normalizer, metric_updates, error = payload
        if error is not None or metric_updates or not isinstance(normalizer, float):
            return None
        if (loss is not None) != self.has_loss or len(logs) != len(self.calls):
            return None
        values = [1.0, float(loss) if loss is not None else 0.0, normalizer]
        for call, (name, kwargs, kind) in zip(logs, self.calls):
            if call.name != name or _kind(call.value) != kind or not _plain(call.kwargs) or call.kwargs != kwargs:
                return None
            values.append(float(call.value))
        return torch.tensor(values, dtype=torch.float64)

    def decode(self, vector: Tensor) -> Payload:
        values = vector.tolist()
        loss = torch.tensor(values[1], dtype=torch.float64) if self.has_loss else None
        logs = [
            LogCall(name, value if kind is None else torch.tensor(value, dtype=torch.float64).to(kind), dict(kwargs))
            for (name, kwargs, kind), value in zip(self.calls, values[3:])
        ]
        return loss, logs, values[2], {}, None


def _plain(options: dict) -> bool:
    """Whether log options hold plain values only (they are compared with ``==``)."""
    return all(isinstance(v, (str, int, float, bool, type(None))) for v in options.values())


def _kind(value: Any) -> torch.dtype | None | bool:
    """The dtype of a 0-dim floating CPU tensor, None for a Python float, False for anything else."""
    if isinstance(value, Tensor):
        plain = type(value) is Tensor and value.device.type == "cpu" and value.dim() == 0
        return value.dtype if plain and value.is_floating_point() and not value.requires_grad else False
    return None if type(value) is float else False


class OutcomeChannel:
    """Sends a step's outcome from its last stage to the other ranks of one pipeline (module docstring).

    Args:
        group: a gloo group of the pipeline's ranks used for nothing else (posted receives must not
            interleave with other collectives).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._schemas: dict[tuple, _Schema | None] = {}
        self._posted: dict[tuple, tuple[Any, Tensor]] = {}
        self._early: dict[tuple, tuple[Any, Tensor]] = {}  # sent by send_early, completed by share
        self.pickled = 0  # outcomes sent pickled (first steps, and steps whose schema changed)

    def post(self, kind: str, root: int) -> None:
        """On a rank other than ``root`` (global rank of the last stage), at the start of a step of
        ``kind``: start receiving its outcome if its schema is known."""
        key = (kind, root)
        schema = self._schemas.get(key)
        if schema is None or key in self._posted or dist.get_rank() == root:
            return  # a receive left posted (a step that raised before its outcome) takes the next one
        vector = torch.empty(schema.length, dtype=torch.float64)
        self._posted[key] = (dist.broadcast(vector, src=root, group=self.group, async_op=True), vector)

    def send_early(self, kind: str, root: int, payload: Payload) -> bool:
        """On ``root``, while its step still runs: send ``payload`` now if it fits its kind's schema (the
        other ranks posted its receive at the start of their step); :meth:`share` completes the send.
        False (nothing sent) for a payload that does not fit: :meth:`share` sends it at the end."""
        key = (kind, root)
        schema = self._schemas.get(key)
        vector = None if schema is None or key in self._early else schema.encode(payload)
        if vector is None:
            return False
        self._early[key] = (dist.broadcast(vector, src=root, group=self.group, async_op=True), vector)
        return True

    def share(self, kind: str, root: int, payload: Payload | None, operation: str) -> Payload:
        """``root``'s ``payload`` on every rank of the pipeline (``payload`` is read on ``root`` only)."""
        key = (kind, root)
        schema = self._schemas.get(key)
        early = self._early.pop(key, None)
        if early is not None:  # sent by send_early: the other ranks take it as a vector
            with naming_failures(operation, self.group):
                early[0].wait()
            return payload
        if schema is not None:
            if dist.get_rank() == root:
                vector = schema.encode(payload)
                sent = vector if vector is not None else torch.zeros(schema.length, dtype=torch.float64)
                with naming_failures(operation, self.group):
                    dist.broadcast(sent, src=root, group=self.group)
                if vector is not None:
                    return payload
            else:
                work, vector = self._posted.pop(key, None) or (None, torch.empty(schema.length, dtype=torch.float64))
                with naming_failures(operation, self.group):
                    if work is None:
                        dist.broadcast(vector, src=root, group=self.group)
                    else:
                        work.wait()
                if vector[0].item() == 1.0:
                    return schema.decode(vector)
        self.pickled += 1
        payload = collectives.broadcast_object(payload, root, self.group, operation=operation)
        self._schemas[key] = _Schema.of(payload)
        return payload
