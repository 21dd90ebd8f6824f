"""Memory mechanisms on one process: exact gradients, what they keep, accounting, probes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks
from lightning_pipe.runtime.memory import MemoryRuntime, find_mlps
from lightning_pipe.runtime.memory_accounting import MemoryBudgetExceeded
from lightning_pipe.profiling.memory_profile import measure_stages, probe_microbatches
from lightning_pipe.strategies.memory import build_profile
from tests.helpers.models import Block, TinyGPT

DIM, HEADS, T, B = 16, 2, 12, 2


class DropoutBlock(Block):
    """Block with dropout in attention, after the projection, and in the MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.3), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.2).transpose(1, 2).reshape(B, T, C)
        x = x + F.dropout(self.proj(y), 0.1)
        return x + self.mlp(self.ln2(x))


def _stack(block=Block, count: int = 3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([block(DIM, HEADS) for _ in range(count)]).double()


def _run(blocks, modes, chunk=None, runtime=None, seed=1):
    """Forward and backward through the stack with ``modes``; gradients, input gradient, step memory."""
    runtime = runtime or MemoryRuntime(blocks, "cpu")
    torch.manual_seed(seed)
    x = torch.randn(B, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    with runtime.step(blocks.parameters()) as step:
        wrap = runtime.wrapper(0, 0, 0, modes, chunk)
        h = x
        for index, block in enumerate(blocks):
            h = wrap(index, block.forward, (h,), {})
        h.pow(2).sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    return grads, step, runtime


def _assert_same(actual, expected, atol=1e-12):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=atol, rtol=0)


@pytest.mark.parametrize("modes", [["full"] * 3, ["keep_attention"] * 3, ["offload"] * 3, ["full", "none", "offload"]])
@pytest.mark.parametrize("chunk", [None, 5])
def test_modes_give_the_gradients_of_the_plain_stack(modes, chunk):
    blocks = _stack()
    expected, plain, _ = _run(blocks, ["none"] * 3)
    actual, step, runtime = _run(blocks, modes, chunk)
    _assert_same(actual, expected)
    assert runtime.counter.saved_bytes == 0 and runtime.counter.host_bytes == 0  # all released after backward
    assert step.peak_saved_bytes < plain.peak_saved_bytes
    if "offload" in modes:
        assert step.offloaded_tensors > 0 and step.reloaded_tensors >= step.offloaded_tensors
        assert step.peak_host_bytes > 0
    else:
        assert step.offloaded_tensors == 0 and step.peak_host_bytes == 0


def test_what_each_mode_keeps():
    """Full keeps each block's input; keep-attention also the attention output and log-sum-exp; offload nothing."""
    blocks = _stack()
    _, plain, _ = _run(blocks, ["none"] * 3)
    _, full, _ = _run(blocks, ["full"] * 3)
    _, keep, _ = _run(blocks, ["keep_attention"] * 3)
    _, offload, _ = _run(blocks, ["offload"] * 3)
    hidden = B * T * DIM * 8
    in_blocks = lambda step: sum(n for (_, _, block), n in step.saved_by_block.items() if block >= 0)  # noqa: E731
    assert in_blocks(full) == 3 * hidden
    attention = hidden + B * HEADS * T * 8  # output [B, H, T, D] + log-sum-exp [B, H, T] (float64 here)
    assert in_blocks(keep) == 3 * (hidden + attention)
    assert in_blocks(offload) == 0 and offload.peak_host_bytes >= in_blocks(plain)
    assert in_blocks(plain) > 10 * 3 * hidden


@pytest.mark.parametrize("modes", [["full"] * 3, ["keep_attention"] * 3, ["offload"] * 3])
def test_dropout_reproduces_under_recompute(modes):
    """The RNG state is restored for recomputation: the same masks, the same gradients."""
    blocks = _stack(DropoutBlock)
    expected, _, _ = _run(blocks, ["none"] * 3)
    actual, _, _ = _run(blocks, modes)
    _assert_same(actual, expected)
    other_seed, _, _ = _run(blocks, ["none"] * 3, seed=2)
    assert not torch.equal(other_seed[-1], expected[-1])  # dropout really is random


def test_keep_attention_keeps_random_ops_after_a_random_attention_op():
    """If the kept attention draws random numbers, later random ops are kept too (else masks would shift)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from lightning_pipe.runtime.memory import keep_attention_policy

    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    dropout = torch.ops.aten.native_dropout.default
    policy = keep_attention_policy(frozenset({attention}))
    ctx = type("Ctx", (), {"op_output": None})()
    assert policy(ctx, dropout, torch.ones(1), 0.5, True) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(ctx, attention, None, None, None, 0.0) == CheckpointPolicy.MUST_SAVE
    assert policy(ctx, dropout, torch.ones(1), 0.5, True) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(ctx, attention, None, None, None, 0.1) == CheckpointPolicy.MUST_SAVE
    assert policy(ctx, dropout, torch.ones(1), 0.5, True) == CheckpointPolicy.MUST_SAVE


def test_full_recompute_survives_split_backward():
    """Zero-bubble schedules run backward twice (I with retained graph, then W): full recompute and offload allow it."""
    blocks = _stack()
    expected, _, _ = _run(blocks, ["none"] * 3)
    for modes in (["full"] * 3, ["offload"] * 3):
        runtime = MemoryRuntime(blocks, "cpu")
        x = torch.randn(B, T, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).requires_grad_()
        with runtime.step(blocks.parameters()):
            wrap = runtime.wrapper(0, 0, 0, modes)
            h = x
            for index, block in enumerate(blocks):
                h = wrap(index, block.forward, (h,), {})
            loss = h.pow(2).sum()
            (input_grad,) = torch.autograd.grad(loss, [x], retain_graph=True)
            loss.backward()
        torch.testing.assert_close(input_grad, expected[-1], atol=1e-12, rtol=0)
        _assert_same([p.grad for p in blocks.parameters()], expected[:-1])
        blocks.zero_grad(set_to_none=True)


def test_chunked_mlp_runs_chunks():
    blocks = _stack()
    sizes = []
    handle = blocks[0].mlp[0].register_forward_hook(lambda m, args, out: sizes.append(args[0].shape[-2]))
    try:
        _run(blocks, ["none"] * 3, chunk=5)
    finally:
        handle.remove()
    assert sizes == [5, 5, 2]
    assert find_mlps(blocks[0]) == [blocks[0].mlp]
    assert "forward" not in blocks[0].mlp.__dict__  # the patch is gone after the call


def test_budget_is_enforced_on_accounted_bytes():
    blocks = _stack()
    runtime = MemoryRuntime(blocks, "cpu", rank=3, budget_bytes=40_000)
    with pytest.raises(MemoryBudgetExceeded, match=r"Rank 3 stage 0 microbatch 0 \(block \d\).*exceeds `memory_budget` 40000"):
        _run(blocks, ["none"] * 3, runtime=runtime)
    _, step, _ = _run(blocks, ["full"] * 3, runtime=MemoryRuntime(blocks, "cpu", budget_bytes=40_000))
    assert step.peak_saved_bytes <= 40_000


def test_probe_measures_units_without_side_effects():
    """Probing a stage per mode counts per block; RNG and buffers are untouched; nothing stays counted."""
    torch.manual_seed(0)
    model = TinyGPT(layers=4).double()
    model.log = lambda *args, **kwargs: None
    stack = find_blocks(model)
    runner = StageRunner(model, stack)
    runtime = MemoryRuntime(stack.blocks, "cpu")
    batch = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(0))
    spans = [StageSpan(0, 0, 2, 4), StageSpan(1, 2, 4, 4)]
    state = torch.get_rng_state()
    records = measure_stages(
        runner, runtime, "training_step", [(p, 0) for p in probe_microbatches(batch)], spans, list(model.parameters()),
        torch.device("cpu"),
    )
    assert torch.equal(state, torch.get_rng_state())
    assert runtime.counter.saved_bytes == 0
    profile = build_profile(records, model, analyze_units(model, stack), 4.0)
    assert profile.length_offset == 1  # ids [B, T + 1] feed T positions
    block = profile.units[1]
    shape = profile.shape([17, 17])
    hidden = 2 * 16 * 16 * 8  # [B, T, C] float64
    assert block.saved["full"].evaluate(shape) == pytest.approx(hidden)
    assert block.saved["full"].evaluate(shape) < block.saved["keep_attention"].evaluate(shape) < block.saved["none"].evaluate(shape)
    assert profile.units[-1].saved["none"].evaluate(shape) > 0 and block.hidden == 16
    assert profile.units[1].parameter_bytes == sum(p.numel() * 8 for p in model.blocks[0].parameters())
