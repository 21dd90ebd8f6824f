"""Every private torch name ``model/`` touches, each in one place with a test
(tests/runtime/test_torch_compat.py). ``model/`` sits below ``runtime/`` and cannot use
``runtime/_torch_compat.py``, which re-exports the names both layers need from here.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "BatchNormBase",
    "legacy_reduction",
    "private_name",
    "tensor_registries",
    "tree_flatten",
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
