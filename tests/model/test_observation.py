"""Observing the first step: block order, units by use, values that cannot cross stages (no processes)."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.model import StageRunner, StageSpan, check_observation, find_blocks, layout_from_observation
from tests.helpers.models import (
    AuxLossGPT,
    DirectHeadDecoder,
    GatedGPT,
    HookedAuxGPT,
    LoopedStack,
    MaskedModel,
    TinyGPT,
)


def _observe(model, batch):
    model.log = lambda *a, **k: None
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    return stack, runner, runner.observe("training_step", (batch, 0))


def test_units_follow_use_not_declaration():
    model = GatedGPT(layers=4, gate_at=1)  # head and temperature declared first, gate after the stack
    stack, _, observation = _observe(model, torch.randint(0, 32, (2, 7)))
    check_observation(observation, stack)
    layout = layout_from_observation(model, stack, [observation])
    assert set(layout.unit_names[-1]) == {"head.weight", "temperature", "ln_f.weight", "ln_f.bias"}
    assert set(layout.unit_names[0]) == {"wte.weight", "wpe.weight"}
    assert "gate" in layout.unit_names[3]  # feeds block 2 (unit 3), wherever it is declared
    assert layout.shared == ()


@pytest.mark.parametrize(("make", "name"), [(DirectHeadDecoder, "embed.weight"), (lambda: TinyGPT(tie=True), "wte.weight")])
def test_weights_used_by_pre_and_post_are_shared(make, name):
    model = make()
    stack, _, observation = _observe(model, torch.randint(0, 32, (2, 7)))
    layout = layout_from_observation(model, stack, [observation])
    assert layout.shared == ((name, (0, stack.num_blocks + 1)),)


def test_side_inputs_from_the_batch_need_no_parameters():
    model = MaskedModel(layers=4)
    generator = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 32, (2, 5), generator=generator),
        "labels": torch.randint(0, 32, (2, 5), generator=generator),
        "scale": torch.rand(2, dtype=torch.float32),
    }
    stack, _, observation = _observe(model, batch)
    check_observation(observation, stack)
    assert [{s for s in sources if s[0] == "param"} for sources in observation.block_sources[1:]] == [set()] * 3


def test_a_stack_called_twice_is_refused():
    model = LoopedStack(layers=3)
    stack, _, observation = _observe(model, torch.randint(0, 32, (2, 7)))
    assert observation.block_calls == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match=r"order \[0, 1, 2, 0, 1, 2\]: block 0 is called again after block 2.*ALBERT"):
        check_observation(observation, stack)


def test_blocks_out_of_order_are_refused():
    model = TinyGPT(layers=3)
    model.forward = lambda idx: model.head(model.blocks[0](model.blocks[2](model.blocks[1](model.wte(idx)))))
    stack, _, observation = _observe(model, torch.randint(0, 32, (2, 7)))
    with pytest.raises(ValueError, match=r"first block called is block 1, not block 0 \(out of order\)"):
        check_observation(observation, stack)


def test_a_loss_summed_across_blocks_is_refused():
    model = AuxLossGPT(layers=4)
    stack, _, observation = _observe(model, torch.randint(0, 32, (2, 7)))
    with pytest.raises(ValueError, match=r"the value the step returns is computed from the output of block `blocks.0`.*"
                       r"auxiliary"):
        check_observation(observation, stack)


def test_a_value_collected_by_a_hook_inside_blocks_is_refused():
    model = HookedAuxGPT(layers=3)
    stack, _, observation = _observe(model, torch.randint(0, 32, (2, 7)))
    with pytest.raises(ValueError, match=r"a tensor produced inside block `blocks.0` that is not among its outputs"):
        check_observation(observation, stack)


def test_a_later_stage_computes_masks_for_real_and_refuses_placeholders_in_the_loss():
    """Stage 1 of 2 runs the code before its blocks on placeholders; the loss from them is refused."""
    model = AuxLossGPT(layers=4).double()
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    batch = torch.randint(0, 32, (2, 7))

    def receive(metas):
        return [torch.zeros(m.shape, dtype=m.dtype, requires_grad=m.is_floating_point()) for m in metas]

    # block 1's auxiliary loss arrives with its output; block 0's was never sent
    with pytest.raises(RuntimeError, match=r"stage 1: the value the step returns is computed from the output of block "
                       r"`blocks.0`, which this rank does not hold or run"):
        runner.run("training_step", (batch, 0), StageSpan(1, 2, 4, 4), receive=receive)


class _ReadsEmbeddings(TinyGPT):
    def forward(self, idx):
        x = self.wte(idx)
        if x.abs().max() > 100:  # a decision on a value a later stage cannot compute
            x = x / 2
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def test_reading_a_value_a_stage_cannot_compute_is_refused():
    model = _ReadsEmbeddings(layers=4)
    model.log = lambda *a, **k: None
    stack = find_blocks(model)
    from lightning_pipe.model import analyze_units, owned_units, shard_module

    shard_module(model, analyze_units(model, stack), owned_units((0, 2, 4), [1]), torch.device("cpu"))
    runner = StageRunner(model, stack)
    receive = lambda metas: [torch.zeros(m.shape, dtype=m.dtype) for m in metas]  # noqa: E731
    with pytest.raises(RuntimeError, match=r"reads the value of a tensor \(`__bool__`\) computed from parameter `wte.weight`"):
        runner.run("training_step", (torch.randint(0, 32, (2, 7)), 0), StageSpan(1, 2, 4, 4), receive=receive)


def test_value_free_uses_of_a_placeholder_stay_real():
    """Shapes, dtypes and devices of placeholders may shape real tensors; their values may not."""
    from lightning_pipe.model import PlaceholderMode

    weight = torch.nn.Parameter(torch.empty(8, 4, device="meta"))
    mode = PlaceholderMode(torch.device("cpu"), {id(weight): "embed.weight"})
    ids, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[1.0, 1.0, 0.0]])
    with mode:
        embeds = torch.nn.functional.embedding(ids, weight)  # needs the missing weight
        positions = torch.arange(3, device=weight.device)  # "the embeddings' device" is this rank's
        expanded = mask.unsqueeze(-1).expand_as(embeds)
        zeros = torch.zeros_like(embeds)
        scaled = embeds * 2
    assert embeds.device.type == "cpu" and embeds.shape == (1, 3, 4)
    assert mode.sources_of(embeds) == mode.sources_of(scaled) == frozenset({("param", "embed.weight")})
    assert positions.device.type == "cpu" and mode.sources_of(positions) is None
    assert mode.sources_of(expanded) is None and mode.sources_of(zeros) is None
    assert torch.equal(expanded[0, :, 0], mask[0])
