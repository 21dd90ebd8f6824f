"""Every private torch name ``model/`` touches, each in one place with a test
(tests/runtime/test_torch_compat.py). ``model/`` sits below ``runtime/`` and cannot use
``runtime/_torch_compat.py``, which re-exports the names both layers need from here.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "PYTREE_NODES",
    "BatchNormBase",
    "function_modes_removed",
    "legacy_reduction",
    "private_name",
    "tensor_registries",
    "torch_function_disabled",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "view_base",
]


def private_name(module: str, name: str, home: str = "model/_torch_compat.py") -> Any:
    """``module.name`` from torch, or an ImportError that says which compatibility file (``home``) needs
    updating.

    Raises:
        ImportError: when this torch version has no such name.
    """
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"torch {torch.__version__} has no private `{module}.{name}` that lightning-pipe relies on: "
            f"update lightning_pipe/{home}."
        ) from error


tree_flatten = private_name("torch.utils._pytree", "tree_flatten")
tree_map = private_name("torch.utils._pytree", "tree_map")
tree_unflatten = private_name("torch.utils._pytree", "tree_unflatten")
_pytree_leaves = private_name("torch.utils._pytree", "tree_leaves")
PYTREE_NODES = private_name("torch.utils._pytree", "SUPPORTED_NODES")


def tree_leaves(value: Any) -> list[Any]:
    """pytree's leaves of ``value``, in pytree's order.

    The arguments of a call are almost always tuples, lists and dicts of tensors and numbers; for
    those a plain loop gives the same leaves several times faster than pytree (which the stage
    runner otherwise paid a few times per block and microbatch). Anything else goes to pytree.
    """
    leaves: list[Any] = []
    return leaves if _plain_leaves(value, leaves) else _pytree_leaves(value)


# types that are leaves for pytree, checked first: most arguments are one of them
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None), torch.dtype, torch.device})


def _plain_leaves(value: Any, leaves: list[Any]) -> bool:
    """Append the leaves of a nest of exact tuples, lists and dicts; False on any other container."""
    kind = type(value)
    if kind in _LEAF_TYPES:
        leaves.append(value)
        return True
    if kind is tuple or kind is list:
        for item in value:  # a loop, not all(generator): this runs for every operation of a later stage's code
            if not _plain_leaves(item, leaves):
                return False
        return True
    if kind is dict:
        for item in value.values():
            if not _plain_leaves(item, leaves):
                return False
        return True
    if kind in PYTREE_NODES or isinstance(value, (tuple, list, dict)):  # namedtuples, OrderedDicts, ...
        return False
    leaves.append(value)
    return True
# the common base of BatchNorm1d/2d/3d and their lazy forms (layers that mix samples)
BatchNormBase = private_name("torch.nn.modules.batchnorm", "_BatchNorm")


def tensor_registries(module: nn.Module) -> tuple[dict[str, Tensor | None], dict[str, Tensor | None]]:
    """The dicts a module keeps its own parameters and buffers in (``_parameters``, ``_buffers``)."""
    try:
        return module._parameters, module._buffers
    except AttributeError as error:
        raise RuntimeError(
            "torch.nn.Module has no `_parameters`/`_buffers` in this torch version: update "
            "lightning_pipe/model/_torch_compat.py."
        ) from error


def legacy_reduction(size_average: Any, reduce: Any) -> str:
    """The ``reduction`` string of a loss called with the deprecated ``size_average``/``reduce``."""
    return private_name("torch.nn._reduction", "legacy_get_string")(size_average, reduce)


def view_base(tensor: Tensor) -> Tensor | None:
    """The tensor ``tensor`` is a view of (None for a tensor that owns its storage)."""
    return tensor._base


torch_function_disabled = private_name("torch._C", "DisableTorchFunction")
"""Context manager: no torch-function handling inside (no mode, no subclass ``__torch_function__``);
for the runner's own bookkeeping on tensors, at a fraction of :func:`function_modes_removed`'s cost."""

_mode_stack = private_name("torch.overrides", "_get_current_function_mode_stack")
_pop_mode = private_name("torch.overrides", "_pop_mode")
_push_mode = private_name("torch.overrides", "_push_mode")


@contextlib.contextmanager
def function_modes_removed(remove: Callable[[Any], bool]) -> Iterator[None]:
    """Run the body with the torch-function modes for which ``remove(mode)`` holds taken off the mode
    stack (the others stay, in their order), and restore the stack as it was afterwards.

    A mode that does nothing in a region still costs a Python call per operation there (a few
    microseconds, a few percent of a CPU step); taking it off the stack costs nothing per operation.
    """
    stack = _mode_stack()
    kept = [mode for mode in stack if not remove(mode)]
    if len(kept) == len(stack):
        yield
        return
    for _ in stack:
        _pop_mode()
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in stack:
            _push_mode(mode)


_AUTOCAST = torch.amp.autocast_mode.autocast  # what ``torch.autocast`` and ``torch.amp.autocast`` name


@contextlib.contextmanager
def meta_autocast_disabled() -> Iterator[None]:
    """While active, ``torch.autocast("meta", ...)`` is a disabled autocast instead of an error.

    Blocks of other stages, and the whole step in the cost probe, run on meta tensors; a model that
    opens ``torch.autocast(x.device.type, enabled=False)`` around a float32 region (routers, norms,
    rotary tables) then asks torch for autocast on the ``meta`` device, which it refuses
    ("unsupported scalarType"). Meta tensors are never autocast, so a disabled context is exactly
    what the region does there. It replaces ``autocast.__init__`` for the duration (every name of
    the class, including ``from torch import autocast``, sees it) and leaves other devices alone.
    """
    original = _AUTOCAST.__init__
    if getattr(original, "_lightning_pipe_meta", False):  # nested: already in place
        yield
        return

    def __init__(self, device_type: str, dtype: Any = None, enabled: bool = True, cache_enabled: Any = None) -> None:
        if device_type == "meta":
            device_type, enabled = "cpu", False  # CPU autocast never applies to meta tensors; off besides
        original(self, device_type, dtype, enabled, cache_enabled)

    __init__._lightning_pipe_meta = True  # type: ignore[attr-defined]
    _AUTOCAST.__init__ = __init__
    try:
        yield
    finally:
        _AUTOCAST.__init__ = original
