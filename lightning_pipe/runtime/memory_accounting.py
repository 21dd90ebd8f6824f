"""Count the activations autograd keeps for backward, with saved-tensor hooks.

:class:`SavedActivationCounter` is installed with ``torch.autograd.graph.saved_tensors_hooks`` around
a step. Every tensor autograd saves passes through its pack hook, which wraps it in a handle; the
handle lives exactly as long as autograd keeps the tensor (it is dropped when the backward frees the
node's saved variables, or when the graph is freed), and its storage is counted once however many
nodes save it. Parameters (and views of them) and meta tensors are not activations and are not
counted. Recomputation (``torch.utils.checkpoint``) saves its inputs through the hook too; what a
selective-checkpoint policy keeps is registered by the policy (:meth:`hold`).

The count is attributed to the (stage, microbatch, block) running when the tensor is saved, so the
same counter measures a probe microbatch unit by unit (``memory_profile.py``) and checks a real step
against a budget: with ``budget_bytes`` set, ``static_bytes + saved bytes alive`` above the budget
raises :class:`MemoryBudgetExceeded` naming the rank, stage, microbatch and block. On CPU this is how
the budget is enforced (there is no device allocator to run out).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

BEFORE_BLOCKS = -1
"""Block index for tensors saved before the stage's first block call (``pre`` code)."""
AFTER_BLOCKS = -2
"""Block index for tensors saved after the stage's last block call (``post`` code and the loss)."""


class MemoryBudgetExceeded(RuntimeError):
    """The accounted bytes of a rank went over its memory budget."""


@dataclass
class _Storage:
    refs: int
    nbytes: int
    owner: tuple[int, int, int]


@dataclass
class StepMemory:
    """What a counter saw during one step on one rank.

    Attributes:
        peak_saved_bytes: peak of saved-activation bytes alive on the device.
        peak_host_bytes: peak of offloaded bytes alive in host memory.
        static_bytes: parameters, gradients and optimizer state accounted for the budget.
        saved_by_block: bytes first saved by each ``(stage, microbatch, block)`` (block
            ``BEFORE_BLOCKS`` / ``AFTER_BLOCKS`` for code outside blocks), summed over the step.
        offloaded_tensors: tensors copied to host memory.
        reloaded_tensors: tensors copied back.
    """

    peak_saved_bytes: int = 0
    peak_host_bytes: int = 0
    static_bytes: int = 0
    saved_by_block: dict[tuple[int, int, int], int] = field(default_factory=lambda: defaultdict(int))
    offloaded_tensors: int = 0
    reloaded_tensors: int = 0


class _Saved:
    """What the pack hook returns: the tensor, and a counter reference released with it."""

    __slots__ = ("tensor", "key", "counter", "__weakref__")

    def __init__(self, tensor: Tensor, key: int, counter: SavedActivationCounter) -> None:
        self.tensor = tensor
        self.key = key
        self.counter = counter

    def __del__(self) -> None:
        self.counter.release(self.key)


class Holder:
    """Keeps storages registered with :meth:`SavedActivationCounter.hold` counted while it lives."""

    def __init__(self, counter: SavedActivationCounter) -> None:
        self.counter = counter
        self.keys: list[int] = []
        self.tensors: list[Tensor] = []  # keeps the storages (and so their addresses) while counted

    def __del__(self) -> None:
        for key in self.keys:
            self.counter.release(key)


class SavedActivationCounter:
    """Bytes of activations saved for backward on one rank, by (stage, microbatch, block).

    Args:
        rank: pipeline rank (for messages).
        budget_bytes: raise :class:`MemoryBudgetExceeded` when ``static_bytes`` plus the saved bytes
            alive exceed it; None: only count.
        enforce: if False, a budget is recorded but never raises.
    """

    def __init__(self, rank: int = 0, budget_bytes: int | None = None, enforce: bool = True) -> None:
        self.rank = rank
        self.budget_bytes = budget_bytes
        self.enforce = enforce
        self.static_bytes = 0
        self.saved_bytes = 0
        self.host_bytes = 0
        self.step = StepMemory()
        self._storages: dict[int, _Storage] = {}
        self._host: dict[int, int] = {}
        self._host_keys = itertools.count()
        self._excluded: set[int] = set()
        self._position: tuple[int, int, int] = (-1, -1, BEFORE_BLOCKS)

    # --- configuration -------------------------------------------------------------------------

    def start_step(self, parameters: Iterable[Tensor], static_bytes: int = 0) -> None:
        """Begin a step: parameters to exclude and the static bytes accounted against the budget."""
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters if p.device.type != "meta"}
        self.static_bytes = int(static_bytes)
        self.step = StepMemory(static_bytes=self.static_bytes)
        self.step.peak_saved_bytes = self.saved_bytes
        self.step.peak_host_bytes = self.host_bytes

    @contextlib.contextmanager
    def position(self, stage: int, microbatch: int, block: int = BEFORE_BLOCKS):
        """Attribute what is saved inside the context to ``(stage, microbatch, block)``."""
        previous = self._position
        self._position = (stage, microbatch, block)
        try:
            yield
        finally:
            self._position = previous

    def set_position(self, stage: int, microbatch: int, block: int = BEFORE_BLOCKS) -> None:
        """Attribute what is saved from now on to ``(stage, microbatch, block)``."""
        self._position = (stage, microbatch, block)

    def hooks(self) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks that count every tensor autograd keeps (innermost hooks win)."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # --- hooks -----------------------------------------------------------------------------------

    def is_activation(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` counts: real memory that is not a parameter's."""
        return not tensor.is_meta and tensor.untyped_storage().data_ptr() not in self._excluded

    def pack(self, tensor: Tensor):
        """Pack hook: count the tensor's storage while autograd keeps it."""
        key = self.register(tensor)
        # detached: a node saving its own output would otherwise hold itself through the handle (a
        # reference cycle through C++ that Python's collector cannot see)
        return tensor if key is None else _Saved(tensor.detach(), key, self)

    @staticmethod
    def unpack(packed) -> Tensor:
        """Unpack hook."""
        return packed.tensor if isinstance(packed, _Saved) else packed

    def hold(self, tensors: Iterable[Tensor], holder: Holder) -> None:
        """Count ``tensors`` (kept by some other mechanism) for as long as ``holder`` lives."""
        for tensor in tensors:
            if isinstance(tensor, Tensor):
                key = self.register(tensor)
                if key is not None:
                    holder.keys.append(key)
                    holder.tensors.append(tensor.detach())

    # --- bookkeeping -----------------------------------------------------------------------------

    def register(self, tensor: Tensor) -> int | None:
        """Count one more reference to ``tensor``'s storage; None if it does not count."""
        if not self.is_activation(tensor):
            return None
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        entry = self._storages.get(key)
        if entry is not None:
            entry.refs += 1
            return key
        nbytes = storage.nbytes()
        self._storages[key] = _Storage(1, nbytes, self._position)
        self.saved_bytes += nbytes
        self.step.saved_by_block[self._position] += nbytes
        if self.saved_bytes > self.step.peak_saved_bytes:
            self.step.peak_saved_bytes = self.saved_bytes
        self._check()
        return key

    def release(self, key: int) -> None:
        """Drop one reference taken by :meth:`register`."""
        entry = self._storages.get(key)
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs == 0:
            del self._storages[key]
            self.saved_bytes -= entry.nbytes

    def add_host(self, nbytes: int) -> int:
        """Count ``nbytes`` offloaded to host memory; returns a key for :meth:`release_host`."""
        key = next(self._host_keys)
        self._host[key] = nbytes
        self.host_bytes += nbytes
        self.step.offloaded_tensors += 1
        self.step.peak_host_bytes = max(self.step.peak_host_bytes, self.host_bytes)
        return key

    def release_host(self, key: int) -> None:
        """Forget offloaded bytes whose host copy was freed."""
        self.host_bytes -= self._host.pop(key, 0)

    def _check(self) -> None:
        if self.budget_bytes is None or not self.enforce:
            return
        total = self.static_bytes + self.saved_bytes
        if total > self.budget_bytes:
            stage, microbatch, block = self._position
            where = {BEFORE_BLOCKS: "before its blocks", AFTER_BLOCKS: "after its blocks"}.get(block, f"block {block}")
            raise MemoryBudgetExceeded(
                f"Rank {self.rank} stage {stage} microbatch {microbatch} ({where}): accounted memory {total} bytes "
                f"(static {self.static_bytes} + saved activations {self.saved_bytes}) exceeds `memory_budget` "
                f"{self.budget_bytes} bytes. Raise `memory_budget`, or recompute/offload more (`recompute=`, "
                "`offload=`, or the MemoryPlanner callback)."
            )
