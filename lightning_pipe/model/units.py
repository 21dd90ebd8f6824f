"""Units, the atoms of partitioning, and which of the module's tensors each unit needs.

Unit ``0`` is ``pre`` (what runs before block 0: embeddings, ...), units ``1..n`` are the blocks,
and unit ``n + 1`` is ``post`` (final norm, head, loss). Each parameter has a *home* unit, and a
parameter the step uses in several units (tied input and output embeddings, ``h @ embed.weight.T``
in the head, a free ``nn.Parameter`` of the root used between blocks) is *shared*: every rank
running one of those units holds a real copy, and the strategy keeps the copies equal by summing
their gradients. Buffers outside the block stack (rotary tables, causal-mask caches, position-id
ranges) are *replicated*: every rank holds them, so the code between units computes masks and
positions for real on every stage.

:func:`analyze_units` gives the layout known without running anything: units by where modules
are declared relative to the block stack, sharing by tensor identity (a module or parameter
registered twice). :func:`layout_from_observation` (``model/observation.py``) replaces it after the
first step was observed: units by where the step *uses* each parameter.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from lightning_pipe.model.blocks import BlockStack

from lightning_pipe.model._torch_compat import tensor_registries


@dataclass(frozen=True)
class UnitLayout:
    """Which tensor names (parameters and buffers, fully qualified) each unit needs.

    Attributes:
        stack: the block stack the units are cut from.
        unit_names: per unit, the (canonical) names of the tensors it needs: those at home there
            and the shared ones it uses. A shared name appears under every unit that uses it.
        tied: groups of names that refer to one tensor (a module or parameter registered twice);
            the first name is the canonical one.
        shared: ``(canonical name, units)`` for every tensor needed by more than one unit.
        replicated: buffers held by every rank (those outside the block stack).
    """

    stack: BlockStack
    unit_names: tuple[tuple[str, ...], ...]
    tied: tuple[tuple[str, ...], ...]
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()
    replicated: tuple[str, ...] = ()

    @property
    def num_blocks(self) -> int:
        """Number of blocks (units minus pre and post)."""
        return len(self.unit_names) - 2

    @property
    def num_units(self) -> int:
        """Number of units: pre, the blocks, post."""
        return len(self.unit_names)

    def unit_of(self, name: str) -> int:
        """The first unit that needs tensor ``name`` (its home)."""
        name = self.canonical(name)
        for unit, names in enumerate(self.unit_names):
            if name in names:
                return unit
        raise KeyError(name)

    def canonical(self, name: str) -> str:
        """The first name of the tensor registered as ``name``."""
        for group in self.tied:
            if name in group:
                return group[0]
        return name

    def aliases(self, name: str) -> tuple[str, ...]:
        """Every name of the tensor called ``name`` (itself if it is registered once)."""
        for group in self.tied:
            if name in group:
                return group
        return (name,)

    def needed_names(self, units: set[int] | frozenset[int]) -> set[str]:
        """Every name (aliases included) a rank running ``units`` must hold for real."""
        names = {alias for name in self.replicated for alias in self.aliases(name)}
        for unit in units:
            for name in self.unit_names[unit]:
                names.update(self.aliases(name))
        return names

    def pieces(self) -> list[tuple[tuple[str, ...], frozenset[int]]]:
        """The layout as ``(names, units that need them)`` pieces that move between ranks as one.

        Each unit's unshared tensors form one piece; each shared tensor is a piece of its own,
        held wherever one of its units is. Replicated buffers never move and are not listed.
        """
        shared = dict(self.shared)
        pieces = [
            (tuple(n for n in names if n not in shared), frozenset({unit})) for unit, names in enumerate(self.unit_names)
        ]
        pieces += [((name,), frozenset(units)) for name, units in self.shared]
        return [(names, units) for names, units in pieces if names]

    def shared_parameters(self) -> list[tuple[str, frozenset[int]]]:
        """``(canonical name, units)`` of shared tensors, in a fixed order (identical on every rank)."""
        return [(name, frozenset(units)) for name, units in self.shared]


def _unit_of_module(path: str, stack_path: str, num_blocks: int, after_stack: bool) -> int:
    if path == stack_path or path.startswith(stack_path + "."):
        rest = path[len(stack_path) + 1 :]
        if not rest:
            raise AssertionError("the stack container itself holds no tensors of its own")
        return 1 + int(rest.split(".")[0])
    return num_blocks + 1 if after_stack else 0


def registered_tensors(root: nn.Module, stack: BlockStack) -> dict[int, list[tuple[int, str, bool]]]:
    """``id(tensor) -> [(declaration unit, name, is_parameter), ...]`` for every registration.

    The declaration unit follows where the module is registered: before the stack ``pre``, inside
    it its block, after it ``post``; parameters held directly by an ancestor of the stack count as
    ``pre``.
    """
    if any(True for _ in stack.container.named_parameters(recurse=False)):
        raise ValueError(f"The block container `{stack.path}` holds parameters of its own; they belong to no block.")
    owners: dict[int, list[tuple[int, str, bool]]] = defaultdict(list)
    seen_stack = False  # named_modules walks in pre-order: a module outside the stack seen after it is "post"
    for path, module in root.named_modules(remove_duplicate=False):
        in_stack = path == stack.path or path.startswith(stack.path + ".")
        seen_stack = seen_stack or in_stack
        if path == stack.path:
            continue
        unit = _unit_of_module(path, stack.path, stack.num_blocks, after_stack=seen_stack and not in_stack)
        prefix = f"{path}." if path else ""
        for registry, is_parameter in zip(tensor_registries(module), (True, False)):
            for name, tensor in registry.items():
                if tensor is not None:
                    owners[id(tensor)].append((unit, prefix + name, is_parameter))
    return owners


def make_layout(
    stack: BlockStack, owners: dict[int, list[tuple[int, str, bool]]], units_of: dict[str, set[int]]
) -> UnitLayout:
    """Build a layout from registrations and, per canonical name, the units that need it.

    Buffers registered outside the block stack are replicated (needed everywhere, listed nowhere).
    """
    num_units = stack.num_blocks + 2
    unit_names: list[list[str]] = [[] for _ in range(num_units)]
    tied, shared, replicated = [], [], []
    for entries in owners.values():
        names = tuple(dict.fromkeys(n for _, n, _ in entries))
        if len(names) > 1:
            tied.append(names)
        canonical = names[0]
        is_parameter = entries[0][2]
        in_blocks = any(1 <= u <= stack.num_blocks for u, _, _ in entries)
        if not is_parameter and not in_blocks:
            replicated.append(canonical)
            continue
        units = sorted(units_of[canonical])
        for unit in units:
            unit_names[unit].append(canonical)
        if len(units) > 1:
            shared.append((canonical, tuple(units)))
    return UnitLayout(stack, tuple(tuple(n) for n in unit_names), tuple(tied), tuple(shared), tuple(replicated))


def analyze_units(root: nn.Module, stack: BlockStack) -> UnitLayout:
    """Assign every parameter and buffer of ``root`` to units by declaration (before any step runs).

    A tensor registered in several units (tied embeddings) is shared by them.

    Raises:
        ValueError: the stack container holds parameters of its own.
    """
    owners = registered_tensors(root, stack)
    units_of = {entries[0][1]: {u for u, _, _ in entries} for entries in owners.values()}
    return make_layout(stack, owners, units_of)


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
