"""Activation offload: saved activations of chosen blocks live in host memory between forward and backward.

Installed with saved-tensor hooks around one block call: the pack hook copies each saved activation
to a host buffer (the device copy is then free as soon as nothing else holds it), the unpack hook
copies it back when backward needs it. Copies are bitwise, so gradients do not change.

On CUDA, host buffers are pinned and copies run on a side stream: device-to-host right after the
tensor is saved (the device tensor is kept until its copy completes), host-to-device ahead of use.
When backward unpacks the first tensor of block ``b`` of a (stage, microbatch), the tensors of block
``b - 1`` (the next one backward needs) are prefetched; :meth:`ActivationOffloader.prefetch` starts
the last block of a (stage, microbatch) early, for an executor that knows when its backward comes.
The CUDA path cannot be exercised on a CPU-only machine; the CPU path makes a real copy into host
buffers in both directions so tests can count and check it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

Group = tuple[int, int, int]  # (stage, microbatch, block)


class _Offloaded:
    """One saved activation in host memory (what the pack hook returns)."""

    __slots__ = ("host", "group", "owner", "device", "copied", "pending", "prefetched", "ready", "host_key", "__weakref__")

    def __init__(self, host: Tensor, group: Group, owner: ActivationOffloader, device: torch.device) -> None:
        self.host = host
        self.group = group
        self.owner = owner
        self.device = device
        self.copied = None  # CUDA event: device-to-host copy done
        self.pending: Tensor | None = None  # device tensor kept alive until that copy completes
        self.prefetched: Tensor | None = None
        self.ready = None  # CUDA event: prefetch done
        self.host_key: int | None = None

    def __del__(self) -> None:
        counter = self.owner.counter
        if counter is not None and self.host_key is not None:
            counter.release_host(self.host_key)


class ActivationOffloader:
    """Moves saved activations of chosen block calls to host memory and back.

    Args:
        device: where the activations live (``cpu`` or a CUDA device).
        is_activation: which saved tensors to move (default: real, non-meta tensors); parameters
            should be excluded, they stay where they are.
        counter: optional :class:`~lightning_pipe.runtime.memory_accounting.SavedActivationCounter`
            that counts host bytes and copies.
        prefetch: on CUDA, bring the next block's tensors back ahead of use.
    """

    def __init__(
        self,
        device: torch.device | str,
        is_activation: Callable[[Tensor], bool] | None = None,
        counter=None,
        prefetch: bool = True,
    ) -> None:
        self.device = torch.device(device)
        self.is_activation = is_activation or (lambda t: not t.is_meta)
        self.counter = counter
        self.prefetch_enabled = prefetch
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._groups: dict[Group, weakref.WeakSet] = {}
        self._pending: list[_Offloaded] = []
        self.offloaded_tensors = 0
        self.offloaded_bytes = 0
        self.reloaded_tensors = 0

    def hooks(self, stage: int, microbatch: int, block: int) -> contextlib.AbstractContextManager:
        """Saved-tensor hooks for one block call of ``(stage, microbatch)``."""
        group = (stage, microbatch, block)
        # One host copy per view saved several times. Only weak references to device storages: the
        # hooks live as long as the graph, and an address may be reused once its storage is freed.
        seen: dict[tuple, tuple[StorageWeakRef, _Offloaded]] = {}

        def pack(tensor: Tensor):
            if not self.is_activation(tensor):
                return tensor
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            found = seen.get(key)
            if found is not None and not found[0].expired():
                return found[1]
            item = self._offload(tensor, group)
            seen[key] = (StorageWeakRef(storage), item)
            return item

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    # --- forward: device -> host -----------------------------------------------------------------

    def _offload(self, tensor: Tensor, group: Group) -> _Offloaded:
        self._poll()
        tensor = tensor.detach()
        if self.cuda:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            item = _Offloaded(host, group, self, tensor.device)
            item.copied, item.pending = event, tensor
            self._pending.append(item)
        else:
            host = torch.empty_like(tensor, device="cpu", memory_format=torch.preserve_format)
            host.copy_(tensor)
            item = _Offloaded(host, group, self, tensor.device)
        if self.counter is not None:
            item.host_key = self.counter.add_host(host.untyped_storage().nbytes())
        self._groups.setdefault(group, weakref.WeakSet()).add(item)
        self.offloaded_tensors += 1
        self.offloaded_bytes += host.untyped_storage().nbytes()
        return item

    def _poll(self) -> None:
        """Release device tensors whose copy to host has completed."""
        still = []
        for item in self._pending:
            if item.copied is not None and item.copied.query():
                item.pending = None
            else:
                still.append(item)
        self._pending = still

    # --- backward: host -> device ----------------------------------------------------------------

    def _unpack(self, packed) -> Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        self.reloaded_tensors += 1
        if self.counter is not None:
            self.counter.step.reloaded_tensors += 1
        stage, microbatch, block = packed.group
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            if packed.prefetched is not None:
                current.wait_event(packed.ready)
                tensor, packed.prefetched = packed.prefetched, None
                tensor.record_stream(current)
            else:
                current.wait_event(packed.copied)
                tensor = packed.host.to(packed.device, non_blocking=True)
            if self.prefetch_enabled:
                self._prefetch_group((stage, microbatch, block - 1))
            return tensor
        return packed.host.clone()  # CPU: a real copy back from the host buffer

    def _prefetch_group(self, group: Group) -> None:
        items = self._groups.get(group)
        if not items or not self.cuda:
            return
        with torch.cuda.stream(self._stream):
            for item in list(items):
                if item.prefetched is None:
                    self._stream.wait_event(item.copied)
                    item.prefetched = item.host.to(item.device, non_blocking=True)
                    item.ready = torch.cuda.Event()
                    item.ready.record(self._stream)

    def prefetch(self, stage: int, microbatch: int) -> None:
        """Start bringing back the last offloaded block of ``(stage, microbatch)`` (CUDA only)."""
        blocks = [g[2] for g in self._groups if g[:2] == (stage, microbatch) and self._groups[g]]
        if blocks:
            self._prefetch_group((stage, microbatch, max(blocks)))

    def start_step(self) -> None:
        """Forget groups whose host buffers are gone (they go with the autograd graph)."""
        self._groups = {group: items for group, items in self._groups.items() if len(items)}
