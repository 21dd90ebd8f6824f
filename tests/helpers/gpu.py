"""Markers and helpers of the GPU suite (tests/gpu): skipped with a reason where CUDA is absent."""

from __future__ import annotations

import os

import pytest
import torch

# The suite's device. `LIGHTNING_PIPE_GPU_SUITE_DEVICE=cpu` dry-runs its code on a CPU (to check the
# tests themselves before a GPU is at hand); the figures it records then name the CPU.
DEVICE = os.environ.get("LIGHTNING_PIPE_GPU_SUITE_DEVICE", "cuda")

requires_cuda = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run `bash benchmarks/gpu/run_all.sh` on a machine with one (docs/gpu.md)",
)


def device_name() -> str:
    """The suite's device in words (recorded beside every figure)."""
    return torch.cuda.get_device_name() if DEVICE == "cuda" else f"{DEVICE} (dry run)"


def max_parameter_difference(actual: torch.nn.Module, expected: torch.nn.Module) -> float:
    """Largest absolute difference between same-named parameters, compared on the host."""
    got, want = dict(actual.named_parameters()), dict(expected.named_parameters())
    assert got.keys() == want.keys()
    worst = 0.0
    for name, value in want.items():
        assert got[name].device.type != "meta", f"{name} was not gathered back"
        worst = max(worst, (got[name].detach().cpu().double() - value.detach().cpu().double()).abs().max().item())
    return worst


def record(name: str, value: object) -> None:
    """Print a measured figure and, under ``benchmarks/gpu/run_all.sh``, append it to its results file
    (``LIGHTNING_PIPE_GPU_RESULTS``), so the figures behind the GPU suite's assertions are kept."""
    import json

    print(f"[gpu] {name}: {value} ({device_name()})")
    path = os.environ.get("LIGHTNING_PIPE_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "value": value, "device": device_name()}) + "\n")
