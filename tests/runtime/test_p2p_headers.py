"""The header that describes an activation message: one size whatever it describes (so its receive can
be posted before the receiver knows what follows), read back exactly, and a different number of tensors
than the receiver expects refused with the boundary named."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.runtime.p2p import _header, _header_size, _read_header

PEER = (1, 0, 2, 3)  # (rank, kind, stage, microbatch)


def test_describing_headers_have_one_size_and_read_back_their_tensors():
    one = [torch.zeros(4, 7, 16)]
    several = [torch.zeros(2, 3, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.int64), torch.zeros(())]
    for tensors in (one, several):
        header = _header(tensors, describe=True)
        assert header.numel() == _header_size(0, True) == _header_size(len(tensors), True)
        expected = [(t.shape, t.dtype) for t in tensors]
        predicted = [(torch.Size([1] * t.dim()), torch.float32) for t in tensors]  # a wrong prediction is overridden
        assert _read_header(header.tolist(), predicted, True, PEER) == expected


def test_a_header_for_another_number_of_tensors_is_refused():
    header = _header([torch.zeros(2, 2), torch.zeros(2)], describe=True)
    with pytest.raises(RuntimeError, match=r"Stage 2 \(rank 1\) sent 2 tensors for microbatch 3, but the next stage expects 1"):
        _read_header(header.tolist(), [(torch.Size([2, 2]), torch.float32)], True, PEER)


def test_dtype_headers_keep_one_code_per_tensor():
    tensors = [torch.zeros(3, dtype=torch.float16), torch.zeros(1)]
    header = _header(tensors, describe=False)
    assert header.numel() == _header_size(2, False) == 2
    shapes = [(torch.Size([3]), torch.float32), (torch.Size([1]), torch.float32)]
    assert _read_header(header.tolist(), shapes, False, PEER) == [(torch.Size([3]), torch.float16), shapes[1]]
