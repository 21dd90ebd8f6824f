"""Keep real tensors only for the units a rank runs (and replicated buffers); the rest lives on the meta device."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_pipe.model._torch_compat import tensor_registries
from lightning_pipe.model.units import UnitLayout


def owned_units(boundaries: tuple[int, ...] | list[int], stages: tuple[int, ...] | list[int]) -> set[int]:
    """Units held by a rank running ``stages`` of a partition given as block boundaries.

    Stage ``k`` runs blocks ``boundaries[k] <= i < boundaries[k + 1]`` (units ``i + 1``); the first
    stage also runs ``pre`` (unit 0) and the last stage ``post`` (unit ``num_blocks + 1``).
    """
    num_stages = len(boundaries) - 1
    num_blocks = boundaries[-1]
    units: set[int] = set()
    for stage in stages:
        units.update(range(boundaries[stage] + 1, boundaries[stage + 1] + 1))
        if stage == 0:
            units.add(0)
        if stage == num_stages - 1:
            units.add(num_blocks + 1)
    return units


def shard_module(root: nn.Module, layout: UnitLayout, units: set[int], device: torch.device) -> None:
    """Move the tensors ``units`` need (and replicated buffers) to ``device``; all others become meta, in place.

    Parameters that change device are replaced by new ``nn.Parameter`` objects (a tensor cannot change
    between meta and a real device in place), so call this before optimizers are created; those
    already where they belong (on ``device``, or on meta when not owned) stay themselves, so sharding
    again for the same units (``trainer.test`` after ``trainer.fit`` in the same processes) leaves
    the optimizers' parameters those of the module. Tensors registered under
    several names stay shared. Owned tensors that are still on the meta device (a module built under
    ``trainer.init_module(empty_init=True)``) are allocated uninitialized on ``device``, to be filled
    from a checkpoint, as with any empty initialization.
    """
    owned = layout.needed_names(units)
    replaced: dict[int, torch.Tensor] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for registry in tensor_registries(module):
            for name, tensor in registry.items():
                if tensor is None:
                    continue
                if id(tensor) not in replaced:
                    keep = prefix + name in owned
                    if not keep:  # one already on meta stays itself: optimizers made before hold it
                        new = tensor if tensor.is_meta else torch.empty_like(tensor, device="meta")
                    elif tensor.is_meta:
                        new = torch.empty_like(tensor, device=device)
                    else:
                        new = tensor.to(device)
                    if isinstance(tensor, nn.Parameter) and not isinstance(new, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                    replaced[id(tensor)] = new
                registry[name] = replaced[id(tensor)]


_PLACEMENT = "_lightning_pipe_placement"


def recorded_placement(root: nn.Module) -> Any:
    """What :func:`record_placement` last kept on ``root`` (None: never sharded in this process)."""
    return vars(root).get(_PLACEMENT)


def record_placement(root: nn.Module, placement: Any) -> None:
    """Keep on the module itself where its tensors are held, so that a later sharding of it gathers
    rather than allocates. On the module, not beside it: a copy (``copy.deepcopy(model)`` after a
    fit) carries it, and on every rank the copy holds the same real tensors as the original."""
    vars(root)[_PLACEMENT] = placement


def move_real_tensors(root: nn.Module, device: torch.device) -> None:
    """Move every non-meta parameter and buffer to ``device`` (``Module.to`` fails on meta tensors)."""
    shard_module_tensors = [(m, reg) for _, m in root.named_modules() for reg in tensor_registries(m)]
    for _, registry in shard_module_tensors:
        for name, tensor in registry.items():
            if tensor is not None and tensor.device.type != "meta" and tensor.device != device:
                moved = tensor.to(device)
                registry[name] = nn.Parameter(moved, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else moved
