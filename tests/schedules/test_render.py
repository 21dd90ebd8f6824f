"""Pictures: ASCII timeline, PNG Gantt chart and Chrome trace, from results or raw timed events."""

from __future__ import annotations

import json

import pytest

from lightning_pipe.schedules import (
    Action,
    ActionCosts,
    ActionType,
    Schedule,
    TimedAction,
    render_ascii,
    render_png,
    simulate,
    to_chrome_trace,
    write_chrome_trace,
)


@pytest.fixture
def result_1f1b():
    return simulate(Schedule("1f1b").build(2, 3), ActionCosts.uniform(2, 3))


def test_ascii_timeline_of_1f1b(result_1f1b):
    # F = 1 unit = 3 characters, B = 2 units. By hand: rank 1 runs F0 [1,2] B0 [2,4] F1 [4,5]
    # B1 [5,7] F2 [7,8] B2 [8,10]; rank 0 runs F0 F1 [0,2], waits for B0 [4,6], F2 [6,7],
    # B1 [7,9], waits, B2 [10,12].
    assert render_ascii(result_1f1b).splitlines()[1:3] == [
        "rank 0 |F0 F1 ......B0--- F2 B1--- ...B2--- ",
        "rank 1 |...F0 B0--- F1 B1--- F2 B2--- ......",
    ]


def test_ascii_marks_later_chunks_in_lower_case():
    result = simulate(Schedule("interleaved_1f1b", 2).build(2, 2), ActionCosts.uniform(4, 2))
    first_rank = render_ascii(result).splitlines()[1]
    assert "F0" in first_rank and "f0" in first_rank and "b0" in first_rank


def test_ascii_compresses_long_steps():
    result = simulate(Schedule("gpipe").build(4, 64), ActionCosts.uniform(4, 64))
    lines = render_ascii(result, max_width=80).splitlines()
    assert all(len(line) <= len("rank 3 |") + 81 for line in lines[1:5])
    assert lines[1].startswith("rank 0 |FFFF")


def test_ascii_from_raw_events():
    events = [
        TimedAction(0, Action(0, ActionType.FORWARD, 0), 0.0, 1.0),
        TimedAction(1, Action(1, ActionType.FORWARD, 0), 1.5, 2.5),
    ]
    lines = render_ascii(events).splitlines()
    assert lines[1] == "rank 0 |F0 ....."  # 2.5 units of 3 characters, rounded to 8
    assert lines[2] == "rank 1 |....F0- "  # starts at 4.5 characters, rounded half to even


def test_png_is_written(tmp_path, result_1f1b):
    path = render_png(result_1f1b, tmp_path / "sub" / "step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000


def test_png_from_raw_events_of_a_zero_bubble_step(tmp_path):
    result = simulate(Schedule("zbv").build(2, 4), ActionCosts.uniform(4, 4))
    path = render_png(list(result.events), tmp_path / "zbv.png", title="recorded step")
    assert path.exists()


def test_chrome_trace(tmp_path, result_1f1b):
    trace = to_chrome_trace(result_1f1b)
    names = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [n["args"]["name"] for n in names] == ["rank 0", "rank 1"]
    b0 = next(e for e in trace["traceEvents"] if e.get("name") == "1B0")
    assert (b0["tid"], b0["ts"], b0["dur"]) == (1, 2e6, 2e6)  # seconds -> microseconds
    path = write_chrome_trace(result_1f1b, tmp_path / "trace.json")
    assert json.loads(path.read_text()) == trace
