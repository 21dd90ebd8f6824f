"""The meta-device cost probe: counts per unit that match real runs, and no side effects."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from examples.gpt.model import GPT
from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks
from lightning_pipe.profiling.cost_probe import count_units, fit_cost_model
from lightning_pipe.runtime.memory import MemoryRuntime
from lightning_pipe.profiling.memory_profile import measure_stages, sequence_lengths
from lightning_pipe.profiling.unit_timing import fit_timings, measured_template, time_units
from lightning_pipe.profiling.unit_tracker import resize_microbatch
from tests.helpers.models import MaskedModel, TinyGPT


def _ids(vocab: int, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def _masked_batch(batch: int, length: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 32, (batch, length), generator=generator),
        "labels": torch.randint(0, 32, (batch, length), generator=generator),
        "scale": torch.rand(batch, generator=generator),
    }


def _measured_saved_bytes(model, microbatch) -> dict[int, int]:
    """What the memory accounting of a real (CPU) run counts per unit: an independent measurement."""
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    try:
        span = StageSpan(0, 0, stack.num_blocks, stack.num_blocks)
        records = measure_stages(
            runner,
            MemoryRuntime(stack.blocks, "cpu"),
            "training_step",
            [(microbatch, 0)],
            [span],
            list(model.parameters()),
            torch.device("cpu"),
            modes=["none"],
        )
    finally:
        runner.remove()
    saved: dict[int, int] = defaultdict(int)
    for record in records:
        saved[record.unit] += record.saved_bytes
    return saved


CASES = {
    "tiny_gpt_float64": (lambda: TinyGPT(layers=3, dim=32, vocab=64).double(), lambda b, n: _ids(64, b, n), 33),
    "gpt_example": (
        lambda: GPT(vocab_size=256, block_size=256, n_layer=2, n_embd=64),
        lambda b, n: _ids(256, b, n),
        129,
    ),
    "multihead_attention_with_mask": (lambda: MaskedModel(layers=3), _masked_batch, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_meta_saved_bytes_match_a_real_run_on_held_out_shapes(case):
    make, batch_of, length = CASES[case]
    torch.manual_seed(0)
    model = make()
    stack = find_blocks(model)
    sample = batch_of(2, length)
    probes = [(2, length), (2, length // 2 + 1), (4, length // 4 + 1)]
    estimate = fit_cost_model(
        count_units(model, stack, "training_step", (sample, 0), probes), model, analyze_units(model, stack)
    )
    for held_out in [(3, length - 5), (1, length)]:
        microbatch = resize_microbatch(sample, *held_out)
        measured = _measured_saved_bytes(model, microbatch)
        shape = estimate.shape(sequence_lengths(microbatch))
        predicted = [unit.saved_bytes.evaluate(shape) for unit in estimate.cost_model.units]
        block_bytes = measured[1]
        assert block_bytes > 0
        for unit, value in enumerate(predicted):
            if unit == 0:  # pre keeps only position indices here: a few hundred bytes
                assert value == pytest.approx(measured[0], rel=0.10, abs=0.01 * block_bytes)
            else:
                assert value == pytest.approx(measured[unit], rel=0.10), (case, held_out, unit)
        assert sum(predicted) == pytest.approx(sum(measured.values()), rel=0.10)


@pytest.mark.parametrize("case", ["tiny_gpt_float64", "multihead_attention_with_mask"])
def test_a_model_made_only_from_real_runs_predicts_saved_and_output_bytes(case):
    """What planners fall back to when the step cannot run on meta: bytes measured, not counted."""
    make, batch_of, length = CASES[case]
    torch.manual_seed(0)
    model = make()
    stack = find_blocks(model)
    sample = batch_of(2, length)
    probes = [(2, length), (2, length // 2 + 1), (4, length // 4 + 1), (1, length // 2 + 1)]
    runner = StageRunner(model, stack)
    try:
        span = StageSpan(0, 0, stack.num_blocks, stack.num_blocks)
        timings = time_units(
            runner, "training_step", (sample, 0), [span], probes, list(model.parameters()), torch.device("cpu"), 1, 0
        )
    finally:
        runner.remove()
    estimate = fit_timings(timings, measured_template(timings, model, analyze_units(model, stack)))
    assert estimate.source == "profile"
    for held_out in [(3, length - 5), (1, length)]:
        microbatch = resize_microbatch(sample, *held_out)
        measured = _measured_saved_bytes(model, microbatch)
        shape = estimate.shape(sequence_lengths(microbatch))
        units = estimate.cost_model.units
        for unit in range(1, len(units) - 1):
            assert units[unit].saved_bytes.evaluate(shape) == pytest.approx(measured[unit], rel=0.10), (held_out, unit)
        hidden = next(p for p in model.parameters() if p.dim() == 2).shape[-1]
        element = next(model.parameters()).element_size()
        for unit in units[1:-1]:  # a block hands on [B, T, dim] (and a scalar in MaskedModel)
            assert unit.output_bytes_per_token == pytest.approx(hidden * element, rel=0.05)


def test_meta_flops_are_the_analytic_counts():
    dim, vocab, batch, positions = 32, 64, 2, 32
    model = TinyGPT(layers=2, dim=dim, vocab=vocab, heads=2)
    counts = count_units(model, find_blocks(model), "training_step", (_ids(vocab, 2, 33), 0), [(batch, positions + 1)])
    by_unit = {c.unit: c for c in counts}
    tokens = batch * positions
    attention = 4 * batch * positions**2 * dim  # q k^T and attention x v: 2 * 2 * B * T^2 * C
    assert by_unit[1].forward_flops == 24 * dim**2 * tokens + attention  # qkv 6, proj 2, mlp 16 (x h^2 per token)
    assert by_unit[3].forward_flops == 2 * dim * vocab * tokens  # the head
    assert by_unit[1].backward_flops > 2 * 24 * dim**2 * tokens  # weight and input gradients, attention backward
    assert by_unit[1].positions == positions and by_unit[1].output_bytes == tokens * dim * 4


def test_meta_probe_leaves_the_module_and_random_state_untouched():
    model = TinyGPT(layers=2).double()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    count_units(model, find_blocks(model), "training_step", (_ids(32, 2, 9), 0), [(2, 9), (4, 5)])
    assert torch.equal(rng, torch.get_rng_state())
    for name, param in model.named_parameters():
        assert param is before[name][0] and torch.equal(param, before[name][1]) and param.grad is None
    assert "log" not in vars(model)  # the silenced self.log is gone


class _Float32Region(torch.nn.Module):
    """A block whose second half runs in float32 under any autocast, written as models write it."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return self.block(x.float())


def test_a_block_with_an_autocast_region_on_its_inputs_device_is_probed_on_meta():
    """On meta tensors ``x.device.type`` is ``"meta"``, for which torch refuses an autocast context; the
    probe counts such a block as the plain one (meta tensors are never autocast)."""
    plain = TinyGPT(layers=2)
    regions = TinyGPT(layers=2)
    regions.load_state_dict(plain.state_dict())
    regions.blocks = torch.nn.ModuleList([_Float32Region(block) for block in regions.blocks])
    args, shapes = (_ids(32, 2, 9), 0), [(2, 9)]
    got = count_units(regions, find_blocks(regions), "training_step", args, shapes)
    expected = count_units(plain, find_blocks(plain), "training_step", args, shapes)
    assert [(c.forward_flops, c.backward_flops, c.output_bytes) for c in got] == [
        (c.forward_flops, c.backward_flops, c.output_bytes) for c in expected
    ]


class _ReadsValues(TinyGPT):
    def training_step(self, batch, batch_idx):
        if self(batch[:, :-1]).max().item() > 1000:  # a decision on computed values: impossible on meta
            return None
        return super().training_step(batch, batch_idx)


def test_a_step_reading_values_cannot_be_probed_on_meta_and_says_what_to_do():
    model = _ReadsValues(layers=2)
    with pytest.raises(RuntimeError, match="PipelineProfiler"):
        count_units(model, find_blocks(model), "training_step", (_ids(32, 2, 9), 0), [(2, 9)])


def test_resize_microbatch_keeps_structure_and_valid_values():
    batch = _masked_batch(2, 6)
    bigger = resize_microbatch(batch, 3, 10)
    assert bigger["input_ids"].shape == (3, 10) and bigger["scale"].shape == (3,)
    assert torch.equal(bigger["input_ids"][2, 7], batch["input_ids"][0, 1])  # samples and positions cycle
    meta = resize_microbatch(batch, 5, 4, device="meta")
    assert meta["labels"].is_meta and meta["labels"].shape == (5, 4)


def test_attention_is_counted_as_the_fused_kernel_a_cpu_runs():
    """Without the routing, meta would count the math path's [B, H, T, T] attention matrix."""
    query = torch.randn(2, 2, 64, 8, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        F.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert (2, 2, 64, 64) not in kept  # the CPU's own choice: a fused kernel
    model = TinyGPT(layers=2, dim=16, heads=2)
    counts = count_units(model, find_blocks(model), "training_step", (_ids(32, 1, 65), 0), [(1, 33), (1, 65)])
    short, long = (c.saved_bytes for c in counts if c.unit == 1)
    assert long == 2 * short  # linear in the length: no [T, T] matrix is kept
