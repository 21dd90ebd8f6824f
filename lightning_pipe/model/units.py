"""Units, the atoms of partitioning, and which of the module's tensors belong to each.

Unit ``0`` is ``pre`` (what runs before block 0: embeddings, ...), units ``1..n`` are the blocks,
and unit ``n + 1`` is ``post`` (final norm, head, loss). Non-block tensors are assigned by where
their module is registered relative to the block stack: modules registered before it belong to
``pre``, after it to ``post``; parameters held directly by an ancestor of the stack (a learned
position table on the root, say) belong to ``pre``. A tensor registered under two names in
different units (tied input and output embeddings) is *tied*: every stage owning one of those units
holds a real copy, and the strategy keeps the copies equal by summing their gradients.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipe.model.blocks import BlockStack


@dataclass(frozen=True)
class UnitLayout:
    """Which tensor names (parameters and buffers, fully qualified) belong to which unit.

    Attributes:
        stack: the block stack the units are cut from.
        unit_names: per unit, the names of the tensors it holds (first name of a tied tensor wins
            its own unit; the other units list it under their own names).
        tied: groups of names that refer to one tensor used by several units.
    """

    stack: BlockStack
    unit_names: tuple[tuple[str, ...], ...]
    tied: tuple[tuple[str, ...], ...]

    @property
    def num_blocks(self) -> int:
        """Number of blocks (units minus pre and post)."""
        return len(self.unit_names) - 2

    @property
    def num_units(self) -> int:
        """Number of units: pre, the blocks, post."""
        return len(self.unit_names)

    def unit_of(self, name: str) -> int:
        """Unit index that holds tensor ``name``."""
        for unit, names in enumerate(self.unit_names):
            if name in names:
                return unit
        raise KeyError(name)


def _unit_of_module(path: str, stack_path: str, num_blocks: int, after_stack: bool) -> int:
    if path == stack_path or path.startswith(stack_path + "."):
        rest = path[len(stack_path) + 1 :]
        if not rest:
            raise AssertionError("the stack container itself holds no tensors of its own")
        return 1 + int(rest.split(".")[0])
    return num_blocks + 1 if after_stack else 0


def analyze_units(root: nn.Module, stack: BlockStack) -> UnitLayout:
    """Assign every parameter and buffer of ``root`` to a unit.

    Raises:
        ValueError: the stack container holds tensors of its own, or a tensor is shared between
            blocks (only pre/post ties are supported).
    """
    if any(True for _ in stack.container.named_parameters(recurse=False)):
        raise ValueError(f"The block container `{stack.path}` holds parameters of its own; they belong to no block.")
    num_blocks = stack.num_blocks
    owners: dict[int, list[tuple[int, str]]] = defaultdict(list)  # id(tensor) -> [(unit, name)]
    seen_stack = False  # named_modules walks in pre-order: a module outside the stack seen after it is "post"
    for path, module in root.named_modules(remove_duplicate=False):
        in_stack = path == stack.path or path.startswith(stack.path + ".")
        seen_stack = seen_stack or in_stack
        if path == stack.path:
            continue
        unit = _unit_of_module(path, stack.path, num_blocks, after_stack=seen_stack and not in_stack)
        prefix = f"{path}." if path else ""
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None:
                owners[id(tensor)].append((unit, prefix + name))

    unit_names: list[list[str]] = [[] for _ in range(num_blocks + 2)]
    tied = []
    for entries in owners.values():
        units = sorted({u for u, _ in entries})
        if len(units) > 1:
            if any(1 <= u <= num_blocks for u in units):
                raise ValueError(
                    f"Tensor {[n for _, n in entries]} is shared by several blocks; pipeline stages cannot split it. "
                    "Only ties between pre and post (tied embeddings) are supported."
                )
            tied.append(tuple(n for _, n in entries))
        seen_units = set()
        for unit, name in entries:
            if unit not in seen_units:
                unit_names[unit].append(name)
                seen_units.add(unit)
    return UnitLayout(stack, tuple(tuple(n) for n in unit_names), tuple(tied))


def tensor_bytes(module: nn.Module, names: tuple[str, ...] | list[str]) -> int:
    """Bytes of the named real (non-meta) tensors of ``module``."""
    state = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    return sum(t.numel() * t.element_size() for n, t in state.items() if n in names and t.device.type != "meta")


def real_parameter_bytes(module: nn.Module) -> int:
    """Bytes of parameters held in real memory (not on the meta device)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")


def is_float(tensor: torch.Tensor) -> bool:
    """True for floating-point and complex tensors (those that carry gradients)."""
    return tensor.is_floating_point() or tensor.is_complex()
