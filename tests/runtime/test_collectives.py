"""The object collectives' compact pickling: tensors come back bit for bit, and faster than torch's."""

from __future__ import annotations

import pickle

import pytest
import torch

from lightning_pipe.runtime.collectives import _dumps


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(1.5, dtype=torch.float64),
        torch.randn(3, 4),
        torch.randn(4, 4)[:, 1],  # a strided view
        torch.tensor([1, -2], dtype=torch.int64),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor([True, False]),
        torch.empty(0, 3),
        torch.tensor([float("nan"), float("inf")]),
    ],
    ids=["f64-scalar", "f32", "view", "i64", "bf16", "bool", "empty", "nan-inf"],
)
def test_tensors_round_trip_bit_for_bit(tensor):
    back = pickle.loads(_dumps({"logs": [("loss", tensor)]}))["logs"][0][1]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.reshape(-1).contiguous().view(torch.uint8))


def test_tensors_that_need_more_keep_torchs_reduction():
    leaf = torch.randn(3, requires_grad=True)
    back = pickle.loads(_dumps(leaf))
    assert back.requires_grad and torch.equal(back.detach(), leaf.detach())
    parameter = torch.nn.Parameter(torch.randn(2))
    assert isinstance(pickle.loads(_dumps(parameter)), torch.nn.Parameter)
