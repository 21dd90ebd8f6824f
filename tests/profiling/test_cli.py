"""``lightning-pipe-profile`` (``python -m lightning_pipe.profiling``): a LightningCLI config in, a JSON profile out."""

from __future__ import annotations

import json

from lightning_pipe.profiling.cli import main

CONFIG = """
trainer:
  accelerator: cpu
  strategy:
    class_path: lightning_pipe.ElasticPipelineStrategy
    init_args:
      num_microbatches: 2
model:
  class_path: examples.gpt.model.GPT
  init_args: {vocab_size: 64, block_size: 32, n_layer: 2, n_head: 2, n_embd: 16}
data:
  class_path: examples.gpt.data.TokenDataModule
  init_args: {num_batches: 2, batch_size: 4, min_len: 16, max_len: 32, vocab_size: 64, seed: 1}
"""


def test_profile_command_writes_a_profile_of_every_unit(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    output = tmp_path / "profile.json"
    code = main(
        ["--config", str(config), "--output", str(output), "--repeats", "1", "--lengths", "8", "16", "24", "--sequences", "1", "2",
         "--plan-ranks", "2", "--families", "1f1b", "helix", "interleaved_1f1b"]
    )
    assert code == 0
    profile = json.loads(output.read_text())
    assert sorted(profile["fit_errors"]) == ["block.0", "block.1", "post", "pre"]
    out = capsys.readouterr().out
    assert f"profile written to {output}" in out
    # the families ranked for the first batch, split placement among them, fastest first
    ranking = out[out.index("Simulated step"):]
    rows = {line.split("│")[1].strip(): line for line in ranking.splitlines() if line.count("│") == 5}
    assert {"1f1b", "helix"} <= set(rows) and "does not run" in rows["interleaved_1f1b"]  # 4 stages on 2 blocks
    steps = {name: float(rows[name].split("│")[3]) for name in ("1f1b", "helix")}
    fastest = min(steps, key=steps.get)
    assert f"Start the run with `schedule='{fastest}'`" in ranking
