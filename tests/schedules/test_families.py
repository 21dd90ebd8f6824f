"""Family generators and the registry: golden per-rank tables, a validate+simulate grid, the API."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import (
    ActionCosts,
    Program,
    Schedule,
    available_schedules,
    forward_only,
    register_schedule,
    resolve_schedule,
    simulate,
    validate,
)
from lightning_pipe.schedules.families import gpipe, one_f_one_b
from lightning_pipe.schedules.registry import get_family
from lightning_pipe.schedules.text import format_table

BUILTIN = ("1f1b", "gpipe", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv")

# Golden compute orders, derived by hand from each family's rules (see the module docstrings), not
# copied from the generators' output.
GOLDEN = {
    ("gpipe", 2, 3, 1): [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
    ],
    # warm-up p-1-r, then F/B pairs, then the remaining backwards
    ("1f1b", 3, 4, 1): [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ],
    # p=2, v=2, m=4: groups of 2; warm-up 2(p-1-r) + (v-1)*2 = 4 on rank 0, 2 on rank 1
    ("interleaved_1f1b", 2, 4, 2): [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ],
    ("looped_bfs", 2, 2, 2): [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1",
    ],
    # 1F1B with I; rank r emits W (oldest first) from its (r+1)-th backward on
    ("zb_h1", 2, 3, 1): [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2",
    ],
    # V shape: rank 0 holds stages 0 and 3, rank 1 holds 1 and 2
    ("zbv", 2, 3, 2): [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    ],
}


def compute_rows(program: Program) -> list[str]:
    return [line.split(": ", 1)[1] for line in format_table(program, compute_only=True).splitlines()]


@pytest.mark.parametrize("key", sorted(GOLDEN), ids=lambda k: f"{k[0]}-p{k[1]}-m{k[2]}")
def test_golden_compute_order(key):
    name, num_ranks, num_microbatches, stages_per_rank = key
    program = validate(Schedule(name, stages_per_rank).build(num_ranks, num_microbatches))
    assert compute_rows(program) == GOLDEN[key]


def test_golden_with_communication_1f1b():
    program = one_f_one_b(2, 3)
    assert format_table(program).splitlines() == [
        "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2",
        "rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2",
    ]


def test_turn_of_the_v_needs_no_communication():
    program = Schedule("zbv", 2).build(2, 3)
    assert program.stage_to_rank == (0, 1, 1, 0)
    tokens = {str(a) for a in program.actions[1]}
    assert "1SEND_F0" not in tokens and "2RECV_F0" not in tokens  # stages 1 -> 2 both on rank 1
    assert "2SEND_F0" in tokens and "3RECV_F0" in {str(a) for a in program.actions[0]}


def _grid():
    for name in BUILTIN:
        family = get_family(name)
        spr = (1, 2, 3) if family.accepts_stages_per_rank and name != "zbv" else (family.stages_per_rank,)
        for v in spr:
            for p in (1, 2, 3, 4, 5):
                for m in (1, 2, 3, 4, 5, 7, 8, 12):
                    yield name, v, p, m
            yield name, v, 8, 16


@pytest.mark.parametrize("name", BUILTIN)
def test_every_family_validates_and_simulates_over_a_grid(name):
    for family, v, p, m in _grid():
        if family != name:
            continue
        program = Schedule(name, v).build(p, m)
        validate(program)
        result = simulate(program, ActionCosts.uniform(p * v, m))
        assert all(b == pytest.approx(3 * m * v) for b in result.busy)  # F=1, B=2 (or I+W) per stage
        assert result.makespan >= 3 * m * v
        assert 0 <= result.bubble_ratio < 1
        fwd = validate(forward_only(program))
        assert all(a.type.value in ("F", "SEND_F", "RECV_F") for rank in fwd.actions for a in rank)


def test_registry_lists_builtin_families():
    assert set(BUILTIN) <= set(available_schedules())


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown schedule 'zb_h3'; valid names: .*1f1b.*gpipe.*zbv"):
        resolve_schedule("zb_h3")


@pytest.mark.parametrize(
    ("spec", "name", "stages_per_rank"),
    [
        ("1f1b", "1f1b", 1),
        ("GPipe", "gpipe", 1),
        ("interleaved_1f1b", "interleaved_1f1b", 2),
        ({"name": "interleaved_1f1b", "stages_per_rank": 4}, "interleaved_1f1b", 4),
        ("zbv", "zbv", 2),
        ("looped_bfs", "looped_bfs", 2),
    ],
)
def test_resolve_family_names(spec, name, stages_per_rank):
    schedule = resolve_schedule(spec)
    assert (schedule.name, schedule.stages_per_rank) == (name, stages_per_rank)
    assert schedule.build(2, 4).num_stages == 2 * stages_per_rank
    assert resolve_schedule(schedule) is schedule


def test_schedule_is_frozen_and_hashable():
    a = Schedule("interleaved_1f1b", 2, {"microbatch_group_size": 4})
    b = Schedule("interleaved_1f1b", 2, {"microbatch_group_size": 4})
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.name = "gpipe"  # type: ignore[misc]
    with pytest.raises(TypeError):
        a.options["x"] = 1  # type: ignore[index]


def test_fixed_stage_count_families_reject_other_counts():
    with pytest.raises(ValueError, match="always uses stages_per_rank=1"):
        resolve_schedule({"name": "1f1b", "stages_per_rank": 2})
    with pytest.raises(ValueError, match="zbv needs exactly 2 stages per rank"):
        Schedule("zbv", 3).build(2, 4)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        gpipe(2, bad)


def test_interleaved_group_size_errors_name_the_argument():
    with pytest.raises(ValueError, match="microbatch_group_size=3 must be >= num_ranks=4"):
        Schedule("interleaved_1f1b", 2, {"microbatch_group_size": 3}).build(4, 12)


def test_interleaved_golden_with_a_fixed_group_size_and_uneven_groups():
    # g=4 on p=2, m=8: warm-up 2(p-1-r) + (v-1)g = 6 on rank 0, 4 on rank 1, at most 2g in flight
    fixed = Schedule("interleaved_1f1b", 2, {"microbatch_group_size": 4}).build(2, 8)
    assert compute_rows(fixed) == [
        "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2B0 2F3 2B1 0F4 2B2 0F5 2B3 0F6 0B0 0F7 0B1 2F4 0B2 2F5 0B3 2F6 2B4 "
        "2F7 2B5 2B6 2B7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1F3 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 1F4 1B0 1F5 1B1 1F6 1B2 1F7 1B3 3F4 3B4 3F5 3B5 "
        "3F6 3B6 3F7 3B7 1B4 1B5 1B6 1B7",
    ]
    # p=2, m=5: balanced groups (3, 2)
    uneven = Schedule("interleaved_1f1b", 2).build(2, 5)
    assert compute_rows(uneven) == [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4",
        "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4",
    ]


def test_interleaved_handles_microbatches_not_multiple_of_ranks():
    for p, m in ((4, 6), (4, 9), (3, 2), (5, 13)):
        validate(Schedule("interleaved_1f1b", 2).build(p, m))


def test_register_custom_family():
    def reversed_gpipe(num_ranks: int, num_microbatches: int) -> Program:
        program = gpipe(num_ranks, num_microbatches)
        return Program("reversed_gpipe", program.num_stages, num_microbatches, program.stage_to_rank, program.actions)

    register_schedule("reversed_gpipe", reversed_gpipe)
    assert "reversed_gpipe" in available_schedules()
    assert resolve_schedule("reversed_gpipe").build(2, 2).name == "reversed_gpipe"
    with pytest.raises(ValueError, match="already registered"):
        register_schedule("reversed_gpipe", gpipe)
    with pytest.raises(ValueError, match="lower case"):
        register_schedule("Bad", gpipe)


def test_forward_only_keeps_forward_order():
    program = Schedule("interleaved_1f1b", 2).build(2, 4)
    fwd = forward_only(program)
    for full, only in zip(program.actions, fwd.actions):
        assert list(only) == [a for a in full if a.type.value in ("F", "SEND_F", "RECV_F")]
    assert fwd.name == "interleaved_1f1b/forward_only"
