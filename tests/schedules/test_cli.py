"""Command line (``python -m lightning_pipe.schedules.cli``) and the no-torch promise of the package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lightning_pipe.schedules.cli import main

REPO = Path(__file__).resolve().parents[2]


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


def test_module_entry_point_without_torch_or_lightning():
    """Runs ``python -m lightning_pipe.schedules.cli`` semantics in a fresh interpreter, with the parent
    package stubbed so its Lightning import does not run, and checks nothing imported torch."""
    code = f"""
import runpy, sys, types
parent = types.ModuleType("lightning_pipe")
parent.__path__ = [{str(REPO / "lightning_pipe")!r}]
sys.modules["lightning_pipe"] = parent
sys.argv = ["lightning-pipe-schedule", "show", "1f1b", "--ranks", "2", "--microbatches", "2"]
try:
    runpy.run_module("lightning_pipe.schedules.cli", run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
import lightning_pipe.schedules, lightning_pipe.schedules.auto, lightning_pipe.schedules.gallery
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "pytorch_lightning"))
assert not bad, bad
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "rank 1 |" in done.stdout and done.stdout.strip().endswith("ok")
