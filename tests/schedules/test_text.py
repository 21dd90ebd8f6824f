"""Text forms: action tokens, CSV and per-rank tables, and interop with torch.distributed.pipelining."""

from __future__ import annotations

import csv
import io

import pytest

from lightning_pipe.schedules import Action, ActionType, Schedule, validate
from lightning_pipe.schedules.lowering import build_program, compute_only
from lightning_pipe.schedules.text import format_action, format_csv, format_table, parse_action, parse_csv, parse_table

FAMILIES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("zb_h1", 1), ("zbv", 2)]
SIZES = [(2, 4), (3, 5), (4, 8)]


@pytest.mark.parametrize(
    ("token", "action"),
    [
        ("0F3", Action(0, ActionType.FORWARD, 3)),
        ("1B2", Action(1, ActionType.BACKWARD, 2)),
        ("2W0", Action(2, ActionType.BACKWARD_WEIGHT, 0)),
        ("2I0", Action(2, ActionType.BACKWARD_INPUT, 0)),
        ("0SEND_F1", Action(0, ActionType.SEND_F, 1)),
        ("1RECV_B0", Action(1, ActionType.RECV_B, 0)),
        ("12RECV_F105", Action(12, ActionType.RECV_F, 105)),
        ("4RECOMPUTE7", Action(4, ActionType.RECOMPUTE, 7)),
    ],
)
def test_tokens_round_trip(token, action):
    assert parse_action(token) == action
    assert format_action(action) == token
    assert parse_action(f"  {token} ") == action


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("F3", "expected '{stage}{type}{microbatch}'"),
        ("0X3", "unknown type 'X'"),
        ("0F", "F needs a microbatch index"),
        ("0UNSHARD", "torch's UNSHARD has no lightning-pipe equivalent"),
        ("3STEP", "STEP is not an action; per-stage optimizer steps run during backward"),
        ("", "invalid action ''"),
    ],
)
def test_bad_tokens(token, message):
    with pytest.raises(ValueError, match=message):
        parse_action(token)


@pytest.mark.parametrize(("name", "v"), FAMILIES)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_csv_and_table_round_trip(name, v, p, m):
    program = Schedule(name, v).build(p, m)
    for text, parse in ((format_csv(program), parse_csv), (format_table(program), parse_table)):
        again = parse(text)
        assert (again.actions, again.stage_to_rank, again.num_microbatches) == (
            program.actions,
            program.stage_to_rank,
            m,
        )
    # compute-only CSV, lowered again, gives the same program
    plain = parse_csv(format_csv(program, compute_only=True), stage_to_rank=program.stage_to_rank)
    assert plain.actions == compute_only(program)
    assert build_program(name, m, program.stage_to_rank, plain.actions).actions == program.actions


def test_csv_layout_is_one_row_per_rank():
    program = Schedule("1f1b").build(2, 2)
    assert format_csv(program, compute_only=True) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def test_parse_infers_placement_and_rejects_conflicts():
    assert parse_table("rank 0: 0F0 0B0\nrank 1: 1F0 1B0").stage_to_rank == (0, 1)
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        parse_table("0F0\n0B0")
    with pytest.raises(ValueError, match=r"stages \[1\] appear on no rank"):
        parse_table("0F0 2F0")


def test_empty_cells_are_skipped():
    program = parse_csv("0F0,,0B0\n1F0,1B0,\n")
    assert [len(r) for r in program.actions] == [2, 2]


# -- torch.distributed.pipelining interop (this test module may import torch; the package may not) --


def _torch_schedules():
    return pytest.importorskip("torch.distributed.pipelining.schedules")


@pytest.mark.parametrize(("name", "v"), FAMILIES)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_torch_parses_validates_and_simulates_our_csv(name, v, p, m):
    ts = _torch_schedules()
    program = Schedule(name, v).build(p, m)
    rows = list(csv.reader(io.StringIO(format_csv(program))))
    actions = {rank: [ts._Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)}
    assert all(str(a) == cell for rank, row in enumerate(rows) for a, cell in zip(actions[rank], row))
    compute = {r: [a for a in acts if a.computation_type in (ts.F, ts.B, ts.I, ts.W)] for r, acts in actions.items()}
    mapping = ts._validate_schedule(compute, p, program.num_stages, m)
    assert mapping == dict(enumerate(program.stage_to_rank))
    ts._simulate_comms_compute(actions, lambda s: program.stage_to_rank[s], program.num_stages)  # raises if stuck


@pytest.mark.parametrize(("name", "v"), FAMILIES)
def test_torch_lowering_of_our_compute_order_passes_our_validator(name, v):
    ts = _torch_schedules()
    program = Schedule(name, v).build(3, 5)
    compute = {
        r: [ts._Action.from_str(cell) for cell in row]
        for r, row in enumerate(csv.reader(io.StringIO(format_csv(program, compute_only=True))))
    }
    lowered = ts._add_send_recv(compute, lambda s: program.stage_to_rank[s], program.num_stages)
    text = "\n".join(",".join(str(a) for a in lowered[r]) for r in sorted(lowered))
    validate(parse_csv(text, stage_to_rank=program.stage_to_rank, num_microbatches=5))
