"""Markers and helpers of the GPU suite (tests/gpu): skipped with a reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: run `bash benchmarks/gpu/run_all.sh` on a machine with one (docs/gpu.md)",
)


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
    import os

    print(f"[gpu] {name}: {value}")
    path = os.environ.get("LIGHTNING_PIPE_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "value": value}) + "\n")
