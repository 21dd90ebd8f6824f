"""Finding blocks and units, and sharding, on plain modules (no processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.model import (
    StageRunner,
    StageSpan,
    analyze_units,
    find_blocks,
    owned_units,
    real_parameter_bytes,
    shard_module,
)
from lightning_pipe.model.loss_counting import LossCounter
from tests.helpers.models import MaskedModel, TinyGPT


def test_finds_the_largest_stack_and_assigns_pre_and_post():
    model = TinyGPT(layers=3)
    stack = find_blocks(model)
    assert stack.path == "blocks" and stack.num_blocks == 3
    layout = analyze_units(model, stack)
    assert layout.unit_names[0] == ("wte.weight", "wpe.weight")
    assert layout.unit_names[-1] == ("ln_f.weight", "ln_f.bias", "head.weight")
    assert all(name.startswith("blocks.1.") for name in layout.unit_names[2])
    assert layout.tied == ()


def test_tied_embeddings_belong_to_pre_and_post():
    layout = analyze_units(model := TinyGPT(tie=True), find_blocks(model))
    assert layout.tied == (("wte.weight", "head.weight"),)
    assert "wte.weight" in layout.unit_names[0] and "wte.weight" in layout.unit_names[-1]
    assert layout.shared == (("wte.weight", (0, 5)),) and layout.aliases("head.weight") == ("wte.weight", "head.weight")


def test_named_blocks_and_clear_errors():
    model = MaskedModel()
    assert find_blocks(model, "layers").num_blocks == 4
    with pytest.raises(ValueError, match="names no submodule"):
        find_blocks(model, "model.missing")
    with pytest.raises(ValueError, match="must be a non-empty"):
        find_blocks(model, "embed")
    with pytest.raises(ValueError, match="blocks='dotted.path.to.layers'"):
        find_blocks(nn.Linear(2, 2))


def test_sharding_keeps_only_owned_units_real():
    model = TinyGPT(layers=4)
    layout = analyze_units(model, find_blocks(model))
    total = real_parameter_bytes(model)
    shard_module(model, layout, owned_units((0, 2, 4), [1]), torch.device("cpu"))  # last of 2 stages
    real = {n for n, p in model.named_parameters() if not p.is_meta}
    assert real == {n for unit in (3, 4, 5) for n in layout.unit_names[unit]}
    assert real_parameter_bytes(model) < total / 2


def test_single_stage_run_equals_the_plain_step():
    model = TinyGPT(layers=2).double()
    model.log = lambda *a, **k: None
    batch = torch.randint(0, 32, (2, 7))
    runner = StageRunner(model, find_blocks(model))
    result = runner.run("training_step", (batch, 0), StageSpan(0, 0, 2, 2))
    runner.remove()
    torch.testing.assert_close(result.step_output, model.training_step(batch, 0))
    assert "forward" not in model.blocks[0].__dict__  # wrappers removed


def test_first_stage_cuts_the_step_after_its_last_block():
    model = TinyGPT(layers=4)
    batch = torch.randint(0, 32, (2, 5))
    runner = StageRunner(model, find_blocks(model))
    result = runner.run("training_step", (batch, 0), StageSpan(0, 0, 2, 4))
    assert result.step_output is None and len(result.outputs) == 1
    assert result.outputs[0].shape == (2, 4, 16) and result.outputs[0].requires_grad


def test_observers_see_the_steps_operations_outside_the_stage_blocks_only():
    """The loss counter rides on the placeholder mode: it traces the last stage's loss to its
    cross-entropy call, and sees neither the operations inside the blocks the stage runs nor the
    meta-device runs the placeholder mode makes for the blocks before the stage."""
    model = TinyGPT(layers=4).double()
    batch = torch.randint(0, 32, (2, 7))
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    layout = analyze_units(model, stack)
    shard_module(model, layout, owned_units((0, 2, 4), (1,)), torch.device("cpu"))
    runner.parameters_changed()
    seen = []

    class Recorder:
        def observe(self, func, args, kwargs, result):
            seen.append(getattr(func, "__name__", repr(func)))

    counter = LossCounter()
    received = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    result = runner.run(
        "training_step", (batch, 0), StageSpan(1, 2, 4, 4), receive=lambda metas: [received],
        observers=(counter, Recorder()),
    )
    record = counter.record(result.step_output, [call.value for call in result.logs])
    assert record.returned is not None and record.describe(record.returned) == "`F.cross_entropy(reduction='mean')`"
    assert record.count_of(record.returned).item() == 12
    assert seen.count("cross_entropy") == 1 and "embedding" in seen  # the step's own calls, before and after
    assert "scaled_dot_product_attention" not in seen and "gelu" not in seen  # inside the stage's blocks: none
    assert len(seen) < 40


def test_real_parameters_are_kept_until_the_parameters_change():
    model = TinyGPT(layers=4)
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    everything = runner.real_parameters()
    assert [id(p) for p in everything] == [id(p) for p in model.parameters()]
    everything.clear()  # a copy: the runner's own list stays
    layout = analyze_units(model, stack)
    shard_module(model, layout, owned_units((0, 2, 4), (1,)), torch.device("cpu"))
    assert len(runner.real_parameters()) == len(list(model.parameters()))  # not told yet: the list it had
    runner.parameters_changed()
    held = runner.real_parameters()
    assert held and [id(p) for p in held] == [id(p) for p in model.parameters() if not p.is_meta]
    assert len(held) < len(list(model.parameters()))
