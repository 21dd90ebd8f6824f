"""Split a batch into microbatches along its first dimension."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten


def batch_size_of(batch: Any) -> int:
    """Size of the first dimension of the batch's first tensor.

    Raises:
        ValueError: the batch holds no tensor.
    """
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError(
        f"Cannot split a batch of type {type(batch).__name__} into microbatches: it holds no tensor with a batch "
        "dimension. Return tensors (or lists/tuples/dicts of them) from the dataloader."
    )


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor (and list of per-sample items) of size ``B`` in its first dimension.

    Microbatch sizes differ by at most one when ``B`` is not divisible. Other leaves are shared by
    all microbatches.

    Raises:
        ValueError: the batch has fewer samples than ``num_microbatches``.
    """
    size = batch_size_of(batch)
    if size < num_microbatches:
        raise ValueError(
            f"The batch has {size} samples, fewer than `num_microbatches={num_microbatches}`: lower "
            "`num_microbatches` or raise the batch size."
        )
    leaves, spec = tree_flatten(batch)
    pieces = []
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == size:
            pieces.append(torch.tensor_split(leaf, num_microbatches))
        else:
            pieces.append([leaf] * num_microbatches)
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(num_microbatches)]
