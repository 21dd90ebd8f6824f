"""Every private torch name the runtime and the profilers touch, each in one place with a test
(tests/runtime/test_torch_compat.py): a torch upgrade that moves one breaks this file, with a
message saying so, and nothing else.

``model/`` cannot import this layer and keeps its own ``model/_torch_compat.py``; the names both need
(pytree, a module's tensor dicts) are defined there and re-exported here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node

# shared with model/ (which cannot import this layer): one definition each
from lightning_pipe.model._torch_compat import (
    meta_autocast_disabled,
    private_name,
    tensor_registries,
    tree_flatten,
    tree_map,
    tree_unflatten,
)

__all__ = [
    "AccumulateGrad",
    "TorchDispatchMode",
    "accumulate_from_edges",
    "flash_attention_cpu_ops",
    "foreach_mul_",
    "grad_output_count",
    "has_gradient_hooks",
    "linear_weight_factors",
    "meta_autocast_disabled",
    "op_argument_names",
    "record_found_inf",
    "tensor_version",
    "tensor_registries",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "private_name",
]

# the base class of dispatch modes (the FLOP and saved-bytes counters of the cost probe)
TorchDispatchMode = private_name("torch.utils._python_dispatch", "TorchDispatchMode", "runtime/_torch_compat.py")


def _accumulator_class() -> type:
    leaf = torch.zeros(1, requires_grad=True)
    return type(leaf.view_as(leaf).grad_fn.next_functions[0][0])


# the class of a leaf's gradient accumulator node (its ``variable`` is the leaf), found from a graph:
# torch names it only in the private ``torch._C._functions``
AccumulateGrad = _accumulator_class()


_ENGINE_RUN_BACKWARD = private_name("torch.autograd.graph", "_engine_run_backward", "runtime/_torch_compat.py")

# ``tensor *= scalar`` for a list of dense tensors in one call (what torch's optimizers use)
foreach_mul_ = private_name("torch", "_foreach_mul_", "runtime/_torch_compat.py")


def accumulate_from_edges(
    edges: tuple, grads: tuple[Tensor, ...], inputs: tuple[Tensor, ...], accumulate: bool = True
) -> tuple[Tensor | None, ...] | None:
    """``torch.autograd.backward(edges, grads, inputs=inputs, retain_graph=True)`` without its checks
    (``accumulate=False``: ``torch.autograd.grad`` of the same, returning the gradients of ``inputs``).

    The zero-bubble W pass runs one engine call per parameter group with gradients the I pass
    captured from the same graph (their shapes and dtypes are the nodes' own), so the public call's
    validation of every gradient (``_make_grads``, about a tenth of a W pass on CPU) is skipped by
    calling the engine entry it ends in, the private ``torch.autograd.graph._engine_run_backward``.
    """
    result = _ENGINE_RUN_BACKWARD(edges, grads, True, False, inputs, allow_unreachable=True, accumulate_grad=accumulate)
    return None if accumulate else result


def linear_weight_factors(node: Node, grad: Tensor) -> tuple[Node, Tensor, Tensor] | None:
    """For a matrix product whose second operand is a parameter's transpose (a linear layer's
    ``addmm(bias, x, W.t())`` or ``mm(x, W.t())``), the weight's gradient accumulator and the two
    factors whose product ``left.mm(right)`` is the weight's gradient from ``grad``, the gradient of
    the product: ``grad.t()`` and ``x``, the very operation autograd runs there (``mm_mat2_backward``
    for a column-major ``mat2``, then ``TBackward0``), so the product is the same tensor. None for any
    other node.

    The zero-bubble W pass uses it to skip one autograd engine call per linear weight: each call
    walks the whole retained graph below the product, about 0.1 ms on the benchmark GPT's stages.
    It reads the nodes' saved tensors (``_saved_mat1``, ``_saved_self``, ``_saved_mat2_sym_*``,
    ``_saved_alpha``), torch's generated and private names for them.
    """
    kind = type(node).__name__
    if kind == "AddmmBackward0":
        if getattr(node, "_saved_alpha", None) != 1:
            return None
        operand, weight_edge = getattr(node, "_saved_mat1", None), node.next_functions[2][0]
    elif kind == "MmBackward0":
        operand, weight_edge = getattr(node, "_saved_self", None), node.next_functions[1][0]
    else:
        return None
    sizes, strides = getattr(node, "_saved_mat2_sym_sizes", None), getattr(node, "_saved_mat2_sym_strides", None)
    if (
        operand is None or sizes is None or strides is None or type(weight_edge).__name__ != "TBackward0"
        or not (strides[0] == 1 and strides[1] == sizes[0])  # W.t() of a row-major W: the formula's first branch
        or operand.layout != torch.strided or grad.layout != torch.strided or operand.is_complex()
    ):
        return None
    accumulator = weight_edge.next_functions[0][0]
    if accumulator is None or not hasattr(accumulator, "variable"):
        return None
    return accumulator, grad.t(), operand  # multiply them under no_grad, as the engine does (``x`` requires grad)


def has_gradient_hooks(tensor: Tensor) -> bool:
    """Whether hooks run when autograd accumulates ``tensor``'s gradient: tensor hooks
    (``register_hook``) and post-accumulate-grad hooks (optimizer offload), kept in the private
    ``Tensor._backward_hooks`` and ``Tensor._post_accumulate_grad_hooks``. A gradient accumulated
    outside the engine skips them, so it is only done where this is False."""
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        if not hasattr(tensor, name):
            raise RuntimeError(
                f"torch.Tensor has no `{name}` in this torch version; lightning-pipe's split backward checks a "
                "parameter's gradient hooks before accumulating outside the engine: update runtime/_torch_compat.py."
            )
        if getattr(tensor, name):
            return True
    return False


def grad_output_count(node: Node) -> int:
    """How many gradients flow into ``node`` (the outputs of its forward): the length of the tuple a
    node pre-hook receives. torch keeps it in the private ``Node._input_metadata``."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None:
        raise RuntimeError(
            "torch.autograd Node has no `_input_metadata` in this torch version; lightning-pipe's split backward "
            "(zero-bubble schedules) needs the number of a node's gradient outputs: update runtime/_torch_compat.py."
        )
    return len(metadata)


def tensor_version(tensor: Tensor) -> int:
    """How many times ``tensor``'s data was changed in place (autograd's counter, the private
    ``Tensor._version``): a batch whose tensors were edited in place since it was split is split again."""
    version = getattr(tensor, "_version", None)
    if version is None:
        raise RuntimeError(
            "torch.Tensor has no `_version` in this torch version; lightning-pipe tells a batch edited in place "
            "from the one it split by it: update runtime/_torch_compat.py."
        )
    return version


def op_argument_names(op: Any) -> list[str]:
    """Argument names of an ATen op overload, from its private ``_schema``."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise RuntimeError(
            f"torch op {op} has no `_schema` in this torch version; lightning-pipe reads argument names there: "
            "update runtime/_torch_compat.py."
        )
    return [argument.name for argument in schema.arguments]


def flash_attention_cpu_ops() -> tuple[Any, Any]:
    """torch's private fused CPU attention kernels (forward, backward), the ones ``scaled_dot_product_attention``
    dispatches to on CPU; the cost probe counts their FLOPs."""
    try:
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    except (AttributeError, RuntimeError) as error:
        raise RuntimeError(
            "torch has no `aten._scaled_dot_product_flash_attention_for_cpu` in this version; lightning-pipe's cost "
            "probe counts its FLOPs: update runtime/_torch_compat.py."
        ) from error


def record_found_inf(scaler: torch.amp.GradScaler, optimizer: Any, found_inf: Tensor) -> None:
    """Record ``found_inf`` as ``scaler``'s verdict for ``optimizer`` in this iteration, as
    ``scaler.step`` would, so that ``scaler.update()`` backs off or grows from it (the private
    ``GradScaler._per_optimizer_states``)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is None:
        raise RuntimeError(
            "torch.amp.GradScaler has no `_per_optimizer_states` in this torch version; lightning-pipe's 16-mixed "
            "optimizer offload records the agreed overflow there: update runtime/_torch_compat.py."
        )
    states[id(optimizer)]["found_inf_per_device"][found_inf.device] = found_inf
