"""Zero-bubble's split backward: I (input gradients) + W (weight gradients) equal one backward,
in values and in work."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_pipe.runtime._torch_compat import grad_output_count
from lightning_pipe.runtime.split_backward import backward_input
from tests.helpers.models import Block


class SharedAndSide(nn.Module):
    """A layer applied twice (weights shared across depth), a free parameter added to the output
    (off the input path), and a second output that does not depend on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)
        self.offset = nn.Parameter(torch.randn(8, dtype=torch.float64))
        self.side = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = self.other(h) + self.shared(h)
        return h * 2 + self.offset, self.side.square()


def _split_and_full(module, make_inputs, grads):
    reference = copy.deepcopy(module)
    inputs = make_inputs()
    outputs = module(*inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    floats = [t for t in inputs if t.is_floating_point()]
    with FlopCounterMode(display=False) as flops_i:
        input_grads, weight_pass = backward_input(outputs, grads, floats)
    with FlopCounterMode(display=False) as flops_w:
        weight_pass.run()
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in make_inputs()]
    ref_outputs = reference(*ref_inputs)
    ref_outputs = list(ref_outputs) if isinstance(ref_outputs, tuple) else [ref_outputs]
    with FlopCounterMode(display=False) as flops_full:
        torch.autograd.backward(ref_outputs, [torch.ones_like(o) if g is None else g for o, g in zip(ref_outputs, grads)])
    for got, want in zip(input_grads, [t for t in ref_inputs if t.is_floating_point()]):
        assert (got is None) == (want.grad is None) and (got is None or torch.equal(got, want.grad))
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    return flops_i.get_total_flops(), flops_w.get_total_flops(), flops_full.get_total_flops()


def test_i_plus_w_is_one_backward_on_transformer_blocks():
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16, 2) for _ in range(3)]).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    grad = torch.randn(2, 5, 16, dtype=torch.float64)
    i, w, full = _split_and_full(blocks, lambda: [x.clone().requires_grad_()], [grad])
    assert i + w == full  # the old W re-ran the whole backward: i + full
    assert 0.3 * full < i < 0.7 * full


def test_shared_weights_free_parameters_and_outputs_off_the_input_path():
    torch.manual_seed(0)
    module = SharedAndSide().double()
    x = torch.randn(4, 8, dtype=torch.float64)
    grads = [torch.randn(4, 8, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    _split_and_full(module, lambda: [x.clone().requires_grad_()], grads)


def test_first_stage_without_input_gradients_computes_every_weight_in_w():
    """Token ids need no gradient: I computes nothing, W everything (the loss as a scalar output)."""
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 8).double(), nn.Linear(8, 10).double()
    module = nn.Sequential(embed, head)
    ids = torch.randint(0, 10, (3, 4))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, ids):
            return self.inner(ids).logsumexp(-1).mean()

    i, w, full = _split_and_full(Loss(), lambda: [ids], [None])
    assert i == 0 and w == full


def test_i_and_w_accumulate_through_the_engine():
    """Existing .grad (an accumulation window) is added to and post-accumulate hooks fire (optimizer
    offload): the bias (a vector) in I, on its way to the input's gradient, the weight (a matrix) in W.
    The input's own .grad is left as it was."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4).double()
    before = {n: torch.randn_like(p) for n, p in layer.named_parameters()}
    for n, p in layer.named_parameters():
        p.grad = before[n].clone()
    fired = []
    for name, p in layer.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    held = torch.randn_like(x)
    x.grad = held
    out = layer(x)
    grad = torch.randn_like(out)
    (input_grad,), weight_pass = backward_input([out], [grad], [x])
    assert fired == ["bias"]
    assert x.grad is held
    torch.testing.assert_close(input_grad, grad @ layer.weight.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(layer.bias.grad, before["bias"] + grad.sum(0))
    weight_pass.run()
    assert fired == ["bias", "weight"]
    torch.testing.assert_close(layer.weight.grad, before["weight"] + grad.T @ x.detach())


def test_w_computes_linear_weights_without_the_engine_and_bit_exact(monkeypatch):
    """A linear layer's weight gradient is the product autograd itself computes (same tensor, bit for
    bit): W computes it directly (runtime/_torch_compat.linear_weight_factors) for every linear of
    the blocks and stores it without an engine call (no hooks to run); nothing else is left to W."""
    from lightning_pipe.runtime import split_backward

    taken, engine_calls = [], []
    original = split_backward.linear_weight_factors
    monkeypatch.setattr(
        split_backward, "linear_weight_factors", lambda node, grad: taken.append(original(node, grad)) or taken[-1]
    )
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16, 2) for _ in range(2)]).double()
    reference = copy.deepcopy(blocks)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    grad = torch.randn(2, 5, 16, dtype=torch.float64)
    leaf = x.clone().requires_grad_()
    (input_grad,), weight_pass = backward_input([blocks(leaf)], [grad], [leaf])
    engine = split_backward.accumulate_from_edges
    monkeypatch.setattr(split_backward, "accumulate_from_edges", lambda *a: engine_calls.append(a) or engine(*a))
    weight_pass.run()
    assert engine_calls == []
    ref_leaf = x.clone().requires_grad_()
    reference(ref_leaf).backward(grad)
    linears = [m for m in blocks.modules() if isinstance(m, nn.Linear)]
    assert len([t for t in taken if t is not None]) == len(linears) > 0
    for (name, p), q in zip(blocks.named_parameters(), reference.parameters(), strict=True):
        if p.dim() >= 2:
            assert torch.equal(p.grad, q.grad), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(input_grad, ref_leaf.grad, rtol=0, atol=1e-12)


def test_w_adds_to_existing_gradients_and_runs_tensor_hooks():
    """Microbatches after the first add their linear weights' gradients to ``.grad`` (fused into the
    product, equal to one backward per microbatch to float64 rounding); a weight with a tensor hook
    goes through the engine, which runs the hook on the gradient, as one backward does."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16, 2) for _ in range(2)]).double()
    reference = copy.deepcopy(blocks)
    seen, ref_seen = [], []
    blocks[1].proj.weight.register_hook(lambda g: seen.append(g.clone()) or g * 2)
    reference[1].proj.weight.register_hook(lambda g: ref_seen.append(g.clone()) or g * 2)
    for _ in range(3):  # three microbatches accumulate
        x = torch.randn(2, 5, 16, dtype=torch.float64)
        grad = torch.randn(2, 5, 16, dtype=torch.float64)
        leaf = x.clone().requires_grad_()
        _, weight_pass = backward_input([blocks(leaf)], [grad], [leaf])
        weight_pass.run()
        reference(x.clone().requires_grad_()).backward(grad)
    assert len(seen) == len(ref_seen) == 3
    for got, want in zip(seen, ref_seen):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for (name, p), q in zip(blocks.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


class Swapped(nn.Module):
    """Two linear layers applied in an order chosen per call: the graphs have one shape and differ in
    which parameter sits where."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, order):
        first, second = (self.a, self.b) if order == "ab" else (self.b, self.a)
        h = second(torch.tanh(first(x)))
        return h.exp() if order == "exp" else h


def test_one_analysis_per_graph_shape_and_exact_for_each(monkeypatch):
    """Graphs of one shape share I's analysis (the parameters are read from each graph's own nodes),
    a graph of another shape gets its own, and every split equals one backward."""
    from lightning_pipe.runtime import split_backward

    analysed = []
    original = split_backward._analyse
    monkeypatch.setattr(split_backward, "_analyse", lambda *a: analysed.append(1) or original(*a))
    monkeypatch.setattr(split_backward, "_ANALYSES", {})
    torch.manual_seed(0)
    module = Swapped().double()
    reference = copy.deepcopy(module)
    for order in ("ab", "ba", "ab", "exp", "ba"):
        x = torch.randn(3, 8, dtype=torch.float64)
        grad = torch.randn(3, 8, dtype=torch.float64)
        leaf = x.clone().requires_grad_()
        (input_grad,), weight_pass = backward_input([module(leaf, order)], [grad], [leaf])
        weight_pass.run()
        ref_leaf = x.clone().requires_grad_()
        reference(ref_leaf, order).backward(grad)
        torch.testing.assert_close(input_grad, ref_leaf.grad, rtol=0, atol=1e-12)
    assert len(analysed) == 2  # "ab" and "ba" have one shape, "exp" another
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("with_input", [True, False])
def test_a_parameter_returned_as_an_output_gets_its_gradient(with_input):
    """A stage output that is a parameter itself (a vector and a matrix) gets the output's gradient,
    with input gradients to compute (I and W) or without (W alone)."""

    class PassesParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.randn(4))
            self.table = nn.Parameter(torch.randn(3, 4))

        def forward(self, x):
            return self.layer(x), self.scale, self.table

    torch.manual_seed(0)
    module = PassesParameters().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    grads = [torch.randn(shape, dtype=torch.float64) for shape in ((2, 4), (4,), (3, 4))]
    make_inputs = (lambda: [x.clone().requires_grad_()]) if with_input else (lambda: [x.clone()])
    _split_and_full(module, make_inputs, grads)


def test_split_under_autocast_equals_one_backward_under_autocast():
    """bf16 autocast (what `precision="bf16-mixed"` wraps the step in): the weights reach the products
    through autocast's casts, W runs them through the engine, and every gradient equals one backward's."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16, 2) for _ in range(2)])
    reference = copy.deepcopy(blocks)
    x = torch.randn(2, 5, 16)
    grad = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        leaf = x.clone().requires_grad_()
        (input_grad,), weight_pass = backward_input([blocks(leaf)], [grad], [leaf])
        weight_pass.run()
        ref_leaf = x.clone().requires_grad_()
        reference(ref_leaf).backward(grad)
    for (name, p), q in zip(blocks.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert torch.equal(input_grad, ref_leaf.grad)


def test_w_is_the_matrices_only_when_there_are_input_gradients():
    """On transformer blocks, W's work is exactly the matrix weights' products and I leaves no matrix
    gradient behind; norms and biases are done by I."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[Block(16, 2) for _ in range(2)]).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    _, weight_pass = backward_input([blocks(x)], [torch.randn(2, 5, 16, dtype=torch.float64)], [x])
    assert all((p.grad is None) == (p.dim() >= 2) for p in blocks.parameters())
    assert sorted(map(id, weight_pass.params_by_node.values())) == sorted(id(p) for p in blocks.parameters() if p.dim() >= 2)
    weight_pass.run()
    assert all(p.grad is not None for p in blocks.parameters())


def test_private_torch_name_is_still_there():
    x = torch.randn(4, requires_grad=True)
    first, _ = x.split(2)
    assert grad_output_count(first.grad_fn) == 2
    with pytest.raises(RuntimeError, match="_torch_compat"):
        grad_output_count(object())
