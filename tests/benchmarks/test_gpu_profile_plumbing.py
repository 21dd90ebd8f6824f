"""The GPU benchmarks' outputs plug into the simulated benchmarks (checked without a GPU)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from lightning_pipe.planning import gpt_1_3b

ROOT = Path(__file__).resolve().parents[2]


def test_simulated_repartition_prices_a_measured_profile_beside_the_flop_model(tmp_path, capsys, monkeypatch):
    # a profile in profile_blocks.py's format, standing in for a GPU's measurements: 3x faster blocks
    measured = gpt_1_3b(device_flops=3 * 312e12)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"device": "stand-in GPU", "sizes": {"gpt_1_3b": {"cost_model": measured.to_dict()}}}))
    # `python benchmarks/simulated_repartition.py --quick --profile ...` run in this process (as `__main__`,
    # with that `sys.argv`): a subprocess spent most of its time importing Lightning through lightning_pipe
    script = "benchmarks/simulated_repartition.py"
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [script, "--quick", "--profile", str(profile)])
    capsys.readouterr()
    runpy.run_path(script, run_name="__main__")
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "flan" in line and "1.3b" in line]
    assert len(rows) == 2 and "FLOP" in rows[0] and "measured" in rows[1]
    throughputs = [float(r.split("│")[6].replace(",", "")) for r in rows]  # elastic tokens/s column
    assert throughputs[1] > 2 * throughputs[0]  # priced by the faster measured blocks, not the FLOP model
    assert "mean speedup of elastic (measured costs)" in out and "measured on stand-in GPU" in out
