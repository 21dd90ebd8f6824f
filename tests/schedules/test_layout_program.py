"""Heterogeneous 1F1B for layouts of widths: every microbatch passes every stage once, on its replica."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import ActionType, B, F, forward_only
from lightning_pipe.schedules.families.one_f_one_b import one_f_one_b
from lightning_pipe.schedules.layout_program import LayoutProgram, layout_1f1b, runs_to_completion


def _compositions(n: int):
    if n == 0:
        yield ()
        return
    for first in range(1, n + 1):
        for rest in _compositions(n - first):
            yield (first, *rest)


@pytest.mark.parametrize("devices", [4, 6])
def test_every_layout_runs_each_microbatch_once_per_stage(devices):
    for widths in _compositions(devices):
        for count in (1, 3, 4, 8):
            program = layout_1f1b(widths, count)
            assert isinstance(program, LayoutProgram) and program.num_ranks == devices
            compute = [[a for a in rank if a.type.is_compute] for rank in program.actions]
            assert runs_to_completion(widths, compute)
            for stage in range(len(widths)):
                for mb in range(count):
                    device = program.rank_for(stage, mb)
                    assert program.stages_of(device) == (stage,)
                    ran = [d for d, actions in enumerate(compute) for a in actions if (a.stage, a.microbatch) == (stage, mb)]
                    assert ran == [device, device]  # its F and its B, on the replica m % w
            sends = {(a.type, a.stage, a.microbatch, d) for d, rank in enumerate(program.actions) for a in rank
                     if a.type in (ActionType.SEND_F, ActionType.SEND_B)}
            receives = {(a.type, a.stage, a.microbatch, d) for d, rank in enumerate(program.actions) for a in rank
                        if a.type in (ActionType.RECV_F, ActionType.RECV_B)}
            assert {(t, s, m, program.rank_for(s + 1, m)) for t, s, m, _ in sends if t is ActionType.SEND_F} == {
                (ActionType.SEND_F, s - 1, m, d) for t, s, m, d in receives if t is ActionType.RECV_F
            }
            assert len(sends) == len(receives) == 2 * (len(widths) - 1) * count


def test_widths_one_is_1f1b_and_one_stage_is_data_parallel():
    plain = one_f_one_b(4, 8)
    layout = layout_1f1b((1, 1, 1, 1), 8)
    assert [[a for a in r if a.type.is_compute] for r in layout.actions] == [
        [a for a in r if a.type.is_compute] for r in plain.actions
    ]
    data_parallel = layout_1f1b((3,), 4)
    assert data_parallel.actions == ((F(0, 0), B(0, 0), F(0, 3), B(0, 3)), (F(0, 1), B(0, 1)), (F(0, 2), B(0, 2)))
    assert forward_only(layout_1f1b((2, 2), 4)).widths == (2, 2)  # evaluation keeps the routing


def test_runs_to_completion_finds_a_stall():
    stalls = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 1), B(1, 1), F(1, 0), B(1, 0)]]
    assert not runs_to_completion((1, 1), stalls)
    with pytest.raises(ValueError, match="widths"):
        layout_1f1b((2, 0), 4)


def test_the_simulator_runs_layout_programs():
    """``simulate`` runs a layout's program device by device (messages find their replica by stage and
    microbatch): the monitor's simulated bubble is available under elastic depth."""
    from lightning_pipe.schedules import ActionCosts, simulate

    count = 8
    costs = lambda stages: ActionCosts.uniform(stages, count, forward=1.0, backward=2.0, latency=0.1)
    deep = simulate(layout_1f1b((1, 1, 1, 1), count), costs(4))
    assert deep.makespan == pytest.approx(simulate(one_f_one_b(4, count), costs(4)).makespan)
    flat = simulate(layout_1f1b((4,), count), costs(1))
    assert flat.makespan == pytest.approx(2 * 3.0) and flat.bubble_ratio == pytest.approx(0.0)
    for widths in _compositions(4):
        result = simulate(layout_1f1b(widths, count), costs(len(widths)))
        program = layout_1f1b(widths, count)
        for rank in range(4):  # every device computes exactly its replica's share of its stage
            (stage,) = program.stages_of(rank)
            share = sum(1 for mb in range(count) if program.rank_for(stage, mb) == rank)
            assert result.busy[rank] == pytest.approx(3.0 * share)
        assert result.makespan >= max(result.busy) and 0.0 <= result.bubble_ratio < 1.0
        # no faster than the busiest replica's work, no slower than running it all on one device
        assert result.makespan <= 3.0 * count * len(widths) + 0.1 * 2 * count * len(widths)
