"""The ``lightning-pipe`` command and its example configs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "gpt" / "configs").glob("*.yaml"))
ROUND_TRIP = CONFIGS


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lightning_pipe", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _printed_config(config: Path, capsys, monkeypatch) -> str:
    """What ``lightning-pipe fit --config config --print_config`` prints, parsed in this process (the
    parser is the same as the command's; a subprocess would spend most of its time importing)."""
    from lightning_pipe.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-pipe"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_.value.code in (None, 0)
    return capsys.readouterr().out


@pytest.mark.parametrize("config", ROUND_TRIP, ids=[c.stem for c in ROUND_TRIP])
def test_print_config_round_trips(config, tmp_path, capsys, monkeypatch):
    first = _printed_config(config, capsys, monkeypatch)
    printed = tmp_path / "printed.yaml"
    printed.write_text(first)
    second = _printed_config(printed, capsys, monkeypatch)
    assert yaml.safe_load(second) == yaml.safe_load(first)
    assert yaml.safe_load(first)["trainer"]["strategy"]["class_path"] == "lightning_pipe.ElasticPipelineStrategy"


@pytest.mark.skipif(shutil.which("lightning-pipe") is None, reason="package not installed (pip install -e .)")
def test_installed_command_resolves_project_modules():
    result = subprocess.run(
        ["lightning-pipe", "fit", "--config", "examples/gpt/configs/cpu_2stage.yaml", "--print_config"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert yaml.safe_load(result.stdout)["model"]["class_path"] == "examples.gpt.model.GPT"


@pytest.mark.skipif(shutil.which("lightning-pipe") is None, reason="package not installed (pip install -e .)")
def test_installed_command_exits_0_after_training_and_shows_lightnings_epoch(tmp_path):
    """The console script returns an exit status (not the CLI object, which `sys.exit` prints and turns
    into status 1), and with only `max_steps` the bar says `Epoch 0`, not `Epoch 0/-2`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            shutil.which("lightning-pipe"), "fit", "--config", "examples/gpt/configs/cpu_2stage.yaml",
            "--trainer.max_steps=1", "--trainer.max_epochs=null", "--trainer.limit_val_batches=0",
            f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "LightningCLI object" not in output
    assert "Epoch 0 " in output and "Epoch 0/-2" not in output


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_trains_with_fast_dev_run(config, tmp_path, caplog, monkeypatch):
    """The command's own ``main`` in this process, with the ranks forked from it: a subprocess per config
    paid Lightning's import twice (the command, then the popen launcher re-running it for rank 1), about
    13 s of 15 on 2 cores. The popen launcher stays covered end to end by
    test_installed_command_exits_0_after_training_and_shows_lightnings_epoch, and ``python -m lightning_pipe``
    by test_unknown_schedule_is_rejected_before_training. The override needs the strategy as a
    ``class_path`` with ``init_args``, which test_print_config_round_trips requires of every config."""
    from lightning_pipe.cli import main

    monkeypatch.chdir(ROOT)  # as the subprocess ran: `class_path`s and relative paths resolve from the root
    monkeypatch.setattr(sys, "argv", ["lightning-pipe"])
    args = ["fit", "--config", str(config), "--trainer.fast_dev_run=true", f"--trainer.default_root_dir={tmp_path}"]
    with caplog.at_level("INFO"):  # a failure on any rank raises here (torch's process context re-raises it)
        assert main([*args, "--trainer.strategy.init_args.start_method=fork"]) == 0
    assert "Running in `fast_dev_run` mode" in caplog.text


def test_unknown_schedule_is_rejected_before_training(tmp_path):
    result = _cli(
        "fit", "--config", str(ROOT / "examples/gpt/configs/cpu_2stage.yaml"),
        "--trainer.strategy.init_args.schedule=onef1b", "--trainer.fast_dev_run=true",
    )
    assert result.returncode != 0
    assert "unknown schedule 'onef1b'" in result.stderr
