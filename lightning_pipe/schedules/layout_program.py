"""Heterogeneous 1F1B: programs for layouts whose stages have different data-parallel widths.

A layout of widths ``(w_0, ..., w_{S-1})`` on ``sum(w)`` devices puts stage ``s`` on devices
``offset_s .. offset_s + w_s - 1`` (``planning/layout.py``). Every microbatch passes every stage
once: replica ``m % w_s`` of stage ``s`` runs microbatch ``m``, so a stage of width 2 splits the
microbatches it receives between its replicas. Each device runs 1F1B over its own microbatches,
with the activation of microbatch ``m`` going to replica ``m % w_{s+1}`` of the next stage
(:meth:`LayoutProgram.rank_for`). With all widths 1 it is plain 1F1B; with one stage it is data
parallelism (every replica runs its microbatches forward then backward).

Warm-up: a device of stage ``s`` starts with ``S - 1 - s`` forwards of its own (1F1B's count),
and the program is checked to run (:func:`runs_to_completion`: every receive is eventually
satisfied, sends never block). Where a layout's warm-up would stall, every device warms up one more
microbatch until it runs; GPipe's order (all forwards first) always does.

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Action, ActionType, B, F, Program


@dataclass(frozen=True)
class LayoutProgram(Program):
    """A :class:`Program` with one action list per *device* of a layout of widths.

    ``actions[d]`` is device ``d``'s list; ``rank_of(stage)`` is the stage's first device (the one
    that gathers a width-``w`` last stage's losses); :meth:`rank_for` names the device of a
    microbatch, so the executor's peers depend on the microbatch.

    Attributes:
        widths: replicas of every stage.
    """

    widths: tuple[int, ...] = ()

    def devices_of(self, stage: int) -> tuple[int, ...]:
        """Devices running ``stage``, in replica order."""
        start = sum(self.widths[:stage])
        return tuple(range(start, start + self.widths[stage]))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The one stage device ``rank`` runs (empty for a device outside the layout)."""
        start = 0
        for stage, width in enumerate(self.widths):
            if rank < start + width:
                return (stage,)
            start += width
        return ()

    def rank_for(self, stage: int, microbatch: int) -> int:
        """Device of ``stage`` that runs ``microbatch`` (round robin over its replicas)."""
        return self.devices_of(stage)[microbatch % self.widths[stage]]


def layout_1f1b(widths: tuple[int, ...], num_microbatches: int) -> LayoutProgram:
    """Build the heterogeneous 1F1B program of a layout (see the module docstring).

    Args:
        widths: replicas of every stage, each >= 1.
        num_microbatches: microbatches per step (a replica without one has an empty list).

    Raises:
        ValueError: for an empty layout, a width below 1 or a count below 1.
    """
    widths = tuple(int(w) for w in widths)
    if not widths or min(widths) < 1:
        raise ValueError(f"layout widths must be a non-empty list of integers >= 1, got {list(widths)}.")
    if num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be >= 1, got {num_microbatches}.")
    num_stages = len(widths)
    for extra in range(num_microbatches + 1):
        orders = [
            _device_order(stage, list(range(replica, num_microbatches, width)), num_stages - 1 - stage + extra)
            for stage, width in enumerate(widths)
            for replica in range(width)
        ]
        if runs_to_completion(widths, orders):
            break
    else:  # pragma: no cover - GPipe's order (extra = num_microbatches) always runs
        raise AssertionError(f"no runnable order for widths {widths}")
    actions = tuple(tuple(_with_communication(order, num_stages)) for order in orders)
    first = tuple(sum(widths[:s]) for s in range(num_stages))
    name = f"layout_1f1b({','.join(map(str, widths))})"
    return LayoutProgram(name, num_stages, num_microbatches, first, actions, widths=widths)


def _device_order(stage: int, mine: list[int], warmup: int) -> list[Action]:
    warmup = min(warmup, len(mine))
    order = [F(stage, m) for m in mine[:warmup]]
    for k in range(len(mine) - warmup):
        order += [F(stage, mine[warmup + k]), B(stage, mine[k])]
    return order + [B(stage, m) for m in mine[len(mine) - warmup :]]


def _with_communication(order: list[Action], num_stages: int) -> list[Action]:
    result = []
    for action in order:
        stage, mb = action.stage, action.microbatch
        if action.type is ActionType.FORWARD:
            if stage > 0:
                result.append(Action(stage, ActionType.RECV_F, mb))
            result.append(action)
            if stage < num_stages - 1:
                result.append(Action(stage, ActionType.SEND_F, mb))
        else:
            if stage < num_stages - 1:
                result.append(Action(stage, ActionType.RECV_B, mb))
            result.append(action)
            if stage > 0:
                result.append(Action(stage, ActionType.SEND_B, mb))
    return result


def runs_to_completion(widths: tuple[int, ...], orders: list[list[Action]]) -> bool:
    """Whether per-device compute orders finish when receives block and sends do not.

    ``F(s, m)`` waits for ``F(s - 1, m)`` (on whichever device ran it), ``B(s, m)`` for
    ``B(s + 1, m)``; a device runs its list in order. False when every unfinished device waits.
    """
    num_stages = len(widths)
    done: set[tuple[str, int, int]] = set()
    position = [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for device, order in enumerate(orders):
            while position[device] < len(order):
                action = order[position[device]]
                stage, mb = action.stage, action.microbatch
                if action.type is ActionType.FORWARD:
                    ready = stage == 0 or ("F", stage - 1, mb) in done
                    key = ("F", stage, mb)
                else:
                    ready = stage == num_stages - 1 or ("B", stage + 1, mb) in done
                    key = ("B", stage, mb)
                if not ready:
                    break
                done.add(key)
                position[device] += 1
                progress = True
    return all(p == len(o) for p, o in zip(position, orders))
