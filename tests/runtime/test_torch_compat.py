"""The private torch names of ``runtime/_torch_compat.py`` (and the model layer's twin) still behave as we rely on.

When torch moves one, the test of that name fails here with a message naming the file to update.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.model import _torch_compat as model_compat
from lightning_pipe.runtime import _torch_compat as compat


def test_a_missing_private_name_says_which_file_to_update():
    with pytest.raises(ImportError, match=r"no private `torch.utils._pytree.no_such_name`.*update lightning_pipe/runtime/_torch_compat.py"):
        compat.private_name("torch.utils._pytree", "no_such_name", "runtime/_torch_compat.py")
    with pytest.raises(ImportError, match=r"update lightning_pipe/model/_torch_compat.py"):
        model_compat.private_name("torch.no_such_module", "tree_map")


def test_pytree_flattens_and_rebuilds_nested_batches():
    batch = {"ids": torch.ones(2, 3), "extra": [torch.zeros(1), 4]}
    leaves, spec = compat.tree_flatten(batch)
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, torch.Tensor, int]
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert rebuilt.keys() == batch.keys() and rebuilt["extra"][1] == 4
    doubled = compat.tree_map(lambda x: x * 2, batch)
    assert torch.equal(doubled["ids"], torch.full((2, 3), 2.0)) and doubled["extra"][1] == 8


def test_tensor_registries_are_the_modules_own_dicts():
    layer = nn.BatchNorm1d(3)
    parameters, buffers = compat.tensor_registries(layer)
    assert set(parameters) == {"weight", "bias"} and {"running_mean", "running_var"} <= set(buffers)
    replacement = nn.Parameter(torch.full((3,), 5.0))
    parameters["weight"] = replacement  # what migration and the meta swap rely on
    assert layer.weight is replacement


def test_dispatch_mode_sees_aten_ops():
    seen = []

    class Recorder(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Recorder():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen


def test_op_argument_names_reads_the_schema():
    assert compat.op_argument_names(torch.ops.aten.native_dropout.default) == ["input", "p", "train"]
    assert "dropout_p" in compat.op_argument_names(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def test_flash_attention_cpu_ops_compute_attention():
    forward, backward = compat.flash_attention_cpu_ops()
    query = torch.randn(1, 2, 4, 8)
    out = forward(query, query, query, 0.0, False)[0]
    expected = torch.nn.functional.scaled_dot_product_attention(query, query, query)
    torch.testing.assert_close(out, expected)
    assert callable(backward)


def test_record_found_inf_makes_update_back_off():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, enabled=True)
    optimizer = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
    scaler.scale(torch.ones(()))  # initializes the scale
    compat.record_found_inf(scaler, optimizer, torch.ones(()))
    scaler.update()
    assert scaler.get_scale() == 4.0  # backed off by the default factor 0.5


def test_foreach_mul_scales_every_tensor_in_place():
    tensors = [torch.ones(2), torch.full((3,), 2.0, dtype=torch.float64)]
    compat.foreach_mul_(tensors, 0.5)
    assert tensors[0].tolist() == [0.5, 0.5] and tensors[1].tolist() == [1.0, 1.0, 1.0]


def test_grad_output_count_counts_a_nodes_outputs():
    x = torch.ones(3, requires_grad=True)
    a, b = x.split([1, 2])
    assert compat.grad_output_count(a.grad_fn) == 2


def test_accumulate_from_edges_is_backward_from_gradient_edges():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    edge = torch.autograd.graph.GradientEdge(y.grad_fn, 0)
    compat.accumulate_from_edges((edge,), (grad,), (layer.weight,))
    compat.accumulate_from_edges((edge,), (grad,), (layer.weight,))  # accumulates, graph retained
    assert x.grad is None and layer.bias.grad is None  # only the inputs asked for
    assert torch.allclose(layer.weight.grad, 2 * grad.T @ x.detach(), atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4)])
def test_linear_weight_factors_multiply_to_the_tensor_autograd_computes(bias, shape):
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=bias).double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    product = out.grad_fn
    while type(product).__name__ not in ("AddmmBackward0", "MmBackward0"):  # under the views of a 3-D input
        product = product.next_functions[0][0]
    found = compat.linear_weight_factors(product, grad.reshape(-1, 3))
    assert found is not None
    accumulator, left, right = found
    assert accumulator.variable is layer.weight
    with torch.no_grad():
        weight_grad = left.mm(right)
    out.backward(grad)
    assert torch.equal(weight_grad, layer.weight.grad) and weight_grad.stride() == layer.weight.grad.stride()
    assert not weight_grad.requires_grad  # computed as the engine computes it: no graph of its own


def test_gradient_hooks_are_seen():
    plain, hooked, offloaded = (nn.Parameter(torch.randn(2)) for _ in range(3))
    hooked.register_hook(lambda g: g)
    offloaded.register_post_accumulate_grad_hook(lambda p: None)
    assert [compat.has_gradient_hooks(p) for p in (plain, hooked, offloaded)] == [False, True, True]
    leaf = torch.zeros(1, requires_grad=True)
    assert type(leaf.view_as(leaf).grad_fn.next_functions[0][0]) is compat.AccumulateGrad


def test_linear_weight_factors_decline_other_products():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    assert compat.linear_weight_factors((a @ b).grad_fn, torch.ones(3, 2)) is None  # no transposed parameter
    assert compat.linear_weight_factors(a.exp().grad_fn, torch.ones(3, 4)) is None
    w = nn.Parameter(torch.randn(4, 2))
    assert compat.linear_weight_factors(torch.addmm(torch.zeros(2), a, w, alpha=2).grad_fn, torch.ones(3, 2)) is None


def test_model_names():
    assert issubclass(nn.BatchNorm2d, model_compat.BatchNormBase) and not issubclass(nn.LayerNorm, model_compat.BatchNormBase)
    assert model_compat.legacy_reduction(None, None) == "mean"
    assert model_compat.legacy_reduction(False, None) == "sum"
    base = torch.ones(4)
    assert model_compat.view_base(base[1:]) is base and model_compat.view_base(base) is None


def test_torchmetrics_private_names_merge_a_batch_state_as_forward_does():
    from torchmetrics.aggregation import SumMetric

    from lightning_pipe.model import _torchmetrics_compat as metrics_compat

    metric = SumMetric()
    metrics_compat.check_metric(metric)
    metric.update(torch.tensor(2.0))
    saved, count = metrics_compat.state_copy(metric), metrics_compat.update_count(metric)
    assert count == 1
    metric.reset()
    metric.update(torch.tensor(3.0))  # the batch
    assert metrics_compat.batch_compute(metric).item() == 3.0
    metrics_compat.set_update_count(metric, count + 1)
    metrics_compat.reduce_states(metric, saved)
    metrics_compat.clear_computed(metric)
    assert metric.compute().item() == 5.0 and metrics_compat.update_count(metric) == 2
    metrics_compat.set_forward_cache(metric, torch.tensor(3.0))
    assert metrics_compat.forward_cache(metric).item() == 3.0


def test_an_unknown_torchmetrics_says_which_file_to_update():
    from torchmetrics.aggregation import SumMetric

    from lightning_pipe.model import _torchmetrics_compat as metrics_compat

    metric = SumMetric()
    del metric._forward_cache
    with pytest.raises(RuntimeError, match=r"\['_forward_cache'\].*_torchmetrics_compat.py"):
        metrics_compat.check_metric(metric)


def test_tree_leaves_agrees_with_pytree_on_plain_and_registered_containers():
    from collections import OrderedDict, namedtuple

    from torch.utils._pytree import tree_leaves as pytree_leaves

    from lightning_pipe.model._torch_compat import tree_leaves

    pair = namedtuple("pair", "a b")
    t = torch.ones(2)
    for value in [
        ((t, 1), {"x": [t, None], "y": "s"}),  # the plain loop
        (pair(t, 2), OrderedDict(k=t)),  # pytree's own containers
        [t, (pair(1, t),)],
    ]:
        got, expected = tree_leaves(value), pytree_leaves(value)
        assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))


def test_function_modes_removed_takes_only_the_chosen_modes_off_the_stack():
    from torch.overrides import TorchFunctionMode

    from lightning_pipe.model._torch_compat import function_modes_removed

    class Counting(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    outer, inner = Counting(), Counting()
    with outer, inner:
        with function_modes_removed(lambda mode: mode is outer):
            torch.ones(2) + 1
        assert (outer.calls, inner.calls) == (0, 2)
        torch.ones(2) + 1
    assert (outer.calls, inner.calls) == (2, 4)  # back on the stack, in order
    with outer, model_compat.torch_function_disabled():
        torch.ones(2) + 1
    assert outer.calls == 2  # no mode sees what runs inside


def test_tensor_version_counts_in_place_changes():
    tensor = torch.zeros(3)
    before = compat.tensor_version(tensor)
    tensor.add_(1)
    tensor[0] = 5.0
    assert compat.tensor_version(tensor) == before + 2
    assert compat.tensor_version(tensor + 1) == 0  # a new tensor


def test_meta_autocast_disabled_makes_autocast_on_meta_a_disabled_context_and_only_that():
    from torch import autocast  # a name bound before the context: it must see the change too

    from lightning_pipe.model._torch_compat import meta_autocast_disabled

    with pytest.raises(RuntimeError):
        torch.autocast("meta", enabled=False)  # what torch does without it (the reason it exists)
    x = torch.ones(2, 2, device="meta")
    with meta_autocast_disabled(), meta_autocast_disabled():  # nested
        with autocast("meta", enabled=False), torch.autocast("meta", dtype=torch.bfloat16):
            assert (x @ x).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):  # other devices untouched
            assert torch.is_autocast_enabled("cpu") and (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        torch.autocast("meta")  # restored on exit
