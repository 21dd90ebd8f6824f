"""`examples/hf_llama/train.py` runs as documented: 2 processes, a config-built Llama, a loss and tokens/s."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.timeout(240)
def test_hf_llama_example_trains_on_two_processes():
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "examples/hf_llama/train.py", "--max-steps", "6", "--max-len", "48", "--layers", "2"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world_size=2 steps=6" in done.stdout
    assert "tokens/s" in done.stdout and "final train_loss:" in done.stdout
