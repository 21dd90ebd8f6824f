"""Command line (``python -m lightning_pipe.schedules.cli``); its no-torch promise is in tests/test_layers.py."""

from __future__ import annotations

import json

from lightning_pipe.schedules import resolve_schedule, simulate, split_program
from lightning_pipe.schedules.cli import main
from lightning_pipe.schedules.split_schedules import split_share_costs


def test_show_prints_timeline_bubble_and_in_flight(capsys, tmp_path):
    png, trace = tmp_path / "zbv.png", tmp_path / "zbv.json"
    assert main(["show", "zbv", "--stages", "8", "--microbatches", "8", "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "zbv: 4 ranks x 2 stage(s) per rank = 8 stages, 8 microbatches"
    assert "rank 3 |" in out
    assert "bubble ratio 5.9%" in out
    assert "peak in-flight microbatches per rank: [8, 7, 6, 5]" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and json.loads(trace.read_text())["traceEvents"]


def test_show_a_dsl_spec_with_actions(capsys):
    assert (
        main(["show", "placement=circular stages_per_rank=2 max_in_flight=2", "--ranks", "2", "-m", "4", "--actions"])
        == 0
    )
    out = capsys.readouterr().out
    assert "rank 0: 0F0" in out and "peak in-flight microbatches per rank: [2, 2]" in out


def test_errors_exit_2(capsys):
    assert main(["show", "zb_h3", "--ranks", "2", "-m", "2"]) == 2
    assert "unknown schedule 'zb_h3'; valid names:" in capsys.readouterr().err
    assert main(["show", "zbv", "--stages", "5", "-m", "2"]) == 2
    assert "--stages 5 is not a multiple of the 2 stages per rank" in capsys.readouterr().err


def test_list_and_auto(capsys):
    assert main(["list"]) == 0
    assert "families: 1f1b, gpipe, interleaved_1f1b, looped_bfs, zb_h1, zbv" in capsys.readouterr().out
    assert main(["auto", "--ranks", "2", "-m", "4", "--memory-limit", "2", "--top", "3"]) == 0
    assert "makespan" in capsys.readouterr().out


def test_split_placement_is_drawn_and_priced_given_the_blocks(capsys):
    assert main(["show", "helix", "--ranks", "4", "--blocks", "8", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("helix") and "4 ranks, 17 stages placed per microbatch, 8 microbatches" in out
    program = split_program(resolve_schedule("helix"), 4, 8, 8)
    bubble = simulate(program, split_share_costs(program, 4)).bubble_ratio
    assert f"bubble ratio {bubble:.1%}" in out  # the gallery's picture: uniform share costs
    assert main(["show", "helix", "--stages", "17", "-m", "8"]) == 2
    assert "pass --ranks and --blocks" in capsys.readouterr().err
    assert main(["auto", "--ranks", "4", "-m", "8", "--blocks", "16", "--attention-share", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "helix" in out and "spipe:v=2" in out
