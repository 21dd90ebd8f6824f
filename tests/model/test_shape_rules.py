"""Shapes of blocks at new lengths from earlier probes: predicted only when every explanation of
the probes agrees; otherwise the block is probed (pure, no processes)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_pipe.model.shape_rules import ShapeRules, TensorSpec


def _probe(block: nn.Module, *args):
    with torch.device("meta"), torch.no_grad():
        output = block(*[a.to("meta") for a in args])
    leaves, spec = tree_flatten(output)
    return [TensorSpec(leaf.shape, leaf.dtype) for leaf in leaves], spec


class AttentionLike(nn.Module):
    """Returns the hidden states and a per-sample vector: (B, T, C) and (B, C)."""

    def forward(self, x, mask):
        return x * 2, x.mean(dim=1)


class Pool(nn.Module):
    """Halves the length: not a copy of any input size."""

    def forward(self, x):
        return x[:, ::2]


def _arguments(batch, length, width=8):
    return torch.zeros(batch, length, width), torch.ones(batch, 1, length, length)


def test_two_lengths_teach_a_transformer_block_its_shapes():
    rules, block = ShapeRules(), AttentionLike()
    assert rules.predict(0, (_arguments(2, 5), {})) is None  # nothing seen
    for length in (5, 9):
        rules.observe(0, (_arguments(2, length), {}), _probe(block, *_arguments(2, length)))
    for batch, length in ((2, 13), (2, 3)):
        predicted = rules.predict(0, (_arguments(batch, length), {}))
        assert predicted is not None
        assert [leaf.shape for leaf in predicted[0]] == [leaf.shape for leaf in _probe(block, *_arguments(batch, length))[0]]


def test_a_size_seen_only_constant_is_not_extrapolated():
    """Both probes had batch 2: is the output's first size the batch or the constant 2? Not settled."""
    rules, block = ShapeRules(), AttentionLike()
    for length in (5, 9):
        rules.observe(0, (_arguments(2, length), {}), _probe(block, *_arguments(2, length)))
    assert rules.predict(0, (_arguments(3, 7), {})) is None
    rules.observe(0, (_arguments(3, 7), {}), _probe(block, *_arguments(3, 7)))
    assert rules.predict(0, (_arguments(4, 11), {}))[0][0].shape == (4, 11, 8)


def test_a_size_no_input_size_explains_is_probed():
    rules, block = ShapeRules(), Pool()
    for length in (6, 10):
        x = torch.zeros(2, length, 4)
        rules.observe(0, ((x,), {}), _probe(block, x))
    assert rules.predict(0, ((torch.zeros(2, 14, 4),), {})) is None


def test_a_coincidence_is_caught_by_a_later_probe_and_a_new_structure_is_never_predicted():
    """Length 4 equals the width 4: the first probes cannot tell them apart, so width changes are
    not predicted until a probe separates them; another rank (or dtype) is a new structure."""
    rules, block = ShapeRules(), AttentionLike()
    rules.observe(0, (_arguments(2, 4, 4), {}), _probe(block, *_arguments(2, 4, 4)))
    rules.observe(0, (_arguments(2, 6, 4), {}), _probe(block, *_arguments(2, 6, 4)))
    assert rules.predict(0, (_arguments(2, 6, 8), {})) is None  # width 8: constant 4, or the width? unsettled
    assert rules.predict(0, ((torch.zeros(2, 6, 4, dtype=torch.float64), torch.ones(2, 1, 6, 6)), {})) is None
    rules.forget(0)
    assert rules.predict(0, (_arguments(2, 8, 4), {})) is None
