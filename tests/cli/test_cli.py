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
# the round trip is the parser's, the same for every config: the newest ones train only (suite time)
ROUND_TRIP = [c for c in CONFIGS if c.stem not in ("cpu_helix",)]


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lightning_pipe", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("config", ROUND_TRIP, ids=[c.stem for c in ROUND_TRIP])
def test_print_config_round_trips(config, tmp_path):
    first = _cli("fit", "--config", str(config), "--print_config")
    assert first.returncode == 0, first.stderr[-2000:]
    printed = tmp_path / "printed.yaml"
    printed.write_text(first.stdout)
    second = _cli("fit", "--config", str(printed), "--print_config")
    assert second.returncode == 0, second.stderr[-2000:]
    assert yaml.safe_load(second.stdout) == yaml.safe_load(first.stdout)
    assert yaml.safe_load(first.stdout)["trainer"]["strategy"]["class_path"] == "lightning_pipe.ElasticPipelineStrategy"


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
def test_every_config_trains_with_fast_dev_run(config, tmp_path):
    result = _cli(
        "fit", "--config", str(config), "--trainer.fast_dev_run=true", f"--trainer.default_root_dir={tmp_path}",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Running in `fast_dev_run` mode" in result.stderr + result.stdout


def test_unknown_schedule_is_rejected_before_training(tmp_path):
    result = _cli(
        "fit", "--config", str(ROOT / "examples/gpt/configs/cpu_2stage.yaml"),
        "--trainer.strategy.init_args.schedule=onef1b", "--trainer.fast_dev_run=true",
    )
    assert result.returncode != 0
    assert "unknown schedule 'onef1b'" in result.stderr
