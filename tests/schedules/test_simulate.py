"""The simulator against closed forms of the literature, memory and in-flight accounting, timing."""

from __future__ import annotations

import time

import pytest

from lightning_pipe.schedules import ActionCosts, Schedule, ScheduleError, simulate
from lightning_pipe.schedules.ir import ActionType
from lightning_pipe.schedules.lowering import build_program, forward_only
from lightning_pipe.schedules.ir import Action, B, F

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 4, 8, 16)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble(name, p, m):
    result = simulate(Schedule(name).build(p, m), ActionCosts.uniform(p, m, forward=1.0, backward=2.0))
    assert result.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert result.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= p] + [(3, 5), (4, 6)])
def test_interleaved_bubble_with_per_chunk_costs(v, p, m):
    costs = ActionCosts.uniform(p * v, m, forward=1.0 / v, backward=2.0 / v)
    result = simulate(Schedule("interleaved_1f1b", v).build(p, m), costs)
    assert result.bubble_ratio == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= p])
def test_zb_h1_bubble_is_a_third_of_1f1b(p, m):
    costs = ActionCosts.uniform(p, m, forward=1.0, backward=2.0)  # I = W = B / 2 = F
    zb, base = simulate(Schedule("zb_h1").build(p, m), costs), simulate(Schedule("1f1b").build(p, m), costs)
    assert sum(zb.idle) == pytest.approx(sum(base.idle) / 3)
    assert zb.makespan == pytest.approx(3 * m + (p - 1))
    assert max(zb.max_in_flight) <= max(base.max_in_flight) == p  # 1F1B's memory


@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 7), (4, 8), (8, 16)])
def test_zbv_only_pays_the_fill(p, m):
    costs = ActionCosts.uniform(2 * p, m, forward=1.0, backward=2.0)  # per chunk F = I = W = 1
    result = simulate(Schedule("zbv", 2).build(p, m), costs)
    assert result.makespan == pytest.approx(6 * m + (p - 1))  # no bubble after the first forward reaches the last rank
    assert max(result.max_in_flight) <= 2 * p  # chunks: 1F1B's p microbatches of two half-size chunks


@pytest.mark.parametrize(("p", "m"), GRID)
def test_in_flight_1f1b_is_p_minus_rank_and_gpipe_is_m(p, m):
    costs = ActionCosts.uniform(p, m)
    assert simulate(Schedule("1f1b").build(p, m), costs).max_in_flight == tuple(min(p - r, m) for r in range(p))
    assert simulate(Schedule("gpipe").build(p, m), costs).max_in_flight == (m,) * p


def test_peak_memory_is_static_plus_saved_activations():
    p, m = 4, 8
    costs = ActionCosts.uniform(p, m, saved_bytes=10.0, static_bytes=100.0)
    result = simulate(Schedule("1f1b").build(p, m), costs)
    assert result.peak_memory == (140.0, 130.0, 120.0, 110.0)
    interleaved = simulate(
        Schedule("interleaved_1f1b", 2).build(p, m), ActionCosts.uniform(2 * p, m, saved_bytes=5.0, static_bytes=50.0)
    )
    # rank 0 runs Megatron's 2(p-1) + (v-1)p = 10 warm-up forwards and one more before its first
    # backward: 11 (stage, microbatch) pairs of 5 bytes, from 8 distinct microbatches
    assert interleaved.peak_memory[0] == 100.0 + 5.0 * 11
    assert interleaved.max_in_flight[0] == 8


def test_zero_bubble_keeps_activations_until_w():
    costs = ActionCosts.uniform(2, 3, saved_bytes=1.0)
    result = simulate(Schedule("zb_h1").build(2, 3), costs)
    # rank 1: 1F0 1I0 1F1 1I1 1W0 ...: two microbatches alive before 1W0
    assert result.max_in_flight == (2, 2) and result.peak_memory == (2.0, 2.0)


def test_forward_only_holds_no_activations():
    costs = ActionCosts.uniform(2, 4, saved_bytes=1.0, static_bytes=3.0)
    result = simulate(forward_only(Schedule("gpipe").build(2, 4)), costs)
    assert result.peak_memory == (3.0, 3.0) and result.max_in_flight == (0, 0)
    assert result.makespan == pytest.approx(5.0)


def test_memory_actions_offload_and_recompute():
    p, m = 1, 2
    costs = ActionCosts.uniform(p, m, saved_bytes=4.0)
    plain = build_program("x", m, (0,), [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)]])
    assert simulate(plain, costs).peak_memory == (8.0,)
    offload = build_program(
        "x",
        m,
        (0,),
        [[F(0, 0), Action(0, ActionType.OFFLOAD, 0), F(0, 1), B(0, 1), Action(0, ActionType.RELOAD, 0), B(0, 0)]],
    )
    assert simulate(offload, costs).peak_memory == (4.0,)
    recompute = build_program("x", m, (0,), [[F(0, 0), F(0, 1), B(0, 1), Action(0, ActionType.RECOMPUTE, 0), B(0, 0)]])
    result = simulate(recompute, costs)
    assert result.peak_memory == (4.0,)
    assert result.busy == (2 * 1.0 + 2 * 2.0 + 1.0,)  # the recompute costs a forward


def test_transfer_time_delays_receives():
    p, m = 2, 1
    costs = ActionCosts.uniform(p, m, activation_bytes=100.0, latency=0.5, bandwidth=200.0)
    result = simulate(Schedule("1f1b").build(p, m), costs)
    # F0 (1) + transfer (1.0) + F1 (1) + B1 (2) + transfer (1.0) + B0 (2)
    assert result.makespan == pytest.approx(8.0)
    recv = next(e for e in result.events if str(e.action) == "1RECV_F0")
    assert (recv.start, recv.end) == (0.0, pytest.approx(2.0))


def test_critical_path_of_1f1b_runs_through_every_rank():
    result = simulate(Schedule("1f1b").build(3, 4), ActionCosts.uniform(3, 4))
    path = [str(a) for a in result.critical_path if a.type.is_compute]
    assert path[0] == "0F0" and path[-1] == "0B3"
    assert {"1F0", "2F0"} <= set(path)
    assert sum(a.type is ActionType.FORWARD for a in result.critical_path) + 2 * sum(
        a.type is ActionType.BACKWARD for a in result.critical_path
    ) == pytest.approx(result.makespan)


def test_events_are_consistent():
    p, m = 4, 8
    result = simulate(Schedule("interleaved_1f1b", 2).build(p, m), ActionCosts.uniform(2 * p, m))
    for rank in range(p):
        mine = [e for e in result.events if e.rank == rank]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))
    assert max(e.end for e in result.events) == result.makespan
    assert all(i == pytest.approx(result.makespan - b) for i, b in zip(result.idle, result.busy))


def test_costs_must_cover_the_program():
    with pytest.raises(ValueError, match="build costs for num_stages=8, num_microbatches=4"):
        simulate(Schedule("interleaved_1f1b", 2).build(4, 4), ActionCosts.uniform(4, 4))


def test_unmatched_receive_is_a_deadlock():
    program = build_program("x", 1, (0, 1), [[F(0, 0)], [F(1, 0), B(1, 0)]])  # rank 0 never sends
    program = program.__class__(
        program.name,
        2,
        1,
        (0, 1),
        (tuple(a for a in program.actions[0] if a.type is ActionType.FORWARD), program.actions[1]),
    )
    with pytest.raises(ScheduleError, match="simulation cannot finish: rank 1 waits on 1RECV_F0"):
        simulate(program, ActionCosts.uniform(2, 1))


def test_simulation_speed_p8_m64(capsys):
    """Prints the time of one simulation (target < 50 ms); asserts nothing about time (CI load varies)."""
    program = Schedule("1f1b").build(8, 64)
    costs = ActionCosts.uniform(8, 64)
    wall, cpu = time.perf_counter(), time.process_time()
    result = simulate(program, costs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    with capsys.disabled():
        print(
            f"\n[benchmark] simulate 1f1b p=8 m=64 ({sum(map(len, program.actions))} actions): "
            f"{cpu * 1e3:.1f} ms CPU, {wall * 1e3:.1f} ms wall"
        )
    assert result.makespan == pytest.approx(3 * (64 + 7))
