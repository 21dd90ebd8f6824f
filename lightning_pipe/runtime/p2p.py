"""Point-to-point transfer of activations and gradients between pipeline ranks.

Sends are posted asynchronously and waited for at the end of the step; receives block where the
tensor is needed, or are posted earlier (:meth:`PointToPoint.post_receive`) where the executor
knows the shapes before it needs the tensors. Every message carries a tag derived from (kind, stage, microbatch, leaf), so gloo
matches messages by tag; NCCL ignores tags and matches in order, which holds because both sides
derive their order from the same validated program.

The receiver allocates buffers from the shapes and dtypes it predicted on the meta device. Under
autocast that prediction can be wrong about dtypes (autocast does not apply to meta tensors: a
block ending in a linear layer outputs bfloat16 for real but float32 on meta), so with
``send_dtypes`` every activation message is preceded by a small header with its tensors' dtypes.
A step whose microbatches have their own lengths sends the header with the shapes too
(``describe=True`` on both sides): the receiver then allocates what was sent, whatever it
predicted (predictions of new shapes are learned, not probed: ``model/shape_rules.py``).
"""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.runtime.failures import PeerFailure

ACTIVATION = 0
GRADIENT = 1
HEADER = 2  # dtypes (and shapes) of an activation message's tensors
_KINDS = 3
_KIND_NAMES = {ACTIVATION: "activations", GRADIENT: "gradients", HEADER: "activation header"}
_MAX_LEAVES = 64
_MAX_DIMS = 8  # dimensions a described tensor may have
_MAX_STAGES = 256


def message_tag(kind: int, stage: int, microbatch: int, leaf: int) -> int:
    """Unique tag of one tensor message; ``stage`` is the sending stage."""
    if leaf >= _MAX_LEAVES or stage >= _MAX_STAGES:
        raise ValueError(f"Too many tensors ({leaf + 1}) or stages ({stage + 1}) at one stage boundary.")
    return (((microbatch * _MAX_STAGES) + stage) * _MAX_LEAVES + leaf) * _KINDS + kind


_DTYPE_LIST = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPE_LIST)}


@dataclass
class PointToPoint:
    """Sends and receives lists of tensors to pipeline peers given by global rank.

    Attributes:
        group: the process group of the pipeline (None: the default group).
        pending: send works not yet known to be complete.
        bytes_sent: bytes posted so far (for the monitor).
        send_dtypes: precede activation messages with their dtypes (set it on both sides alike;
            needed when the receiver's meta-device prediction of dtypes can be wrong: autocast).
        host_staging: copy device tensors to host memory before sending and received ones back to
            the device (gloo has no point-to-point for CUDA tensors; ranks sharing one GPU use it).
        timeout: the longest any wait may take (the strategy's ``timeout``); None: the group's own.
            A wait that fails or runs out raises :class:`~lightning_pipe.runtime.failures.PeerFailure`
            naming the peer, its stage, the tensors and the microbatch.
    """

    group: dist.ProcessGroup | None = None
    pending: list[dist.Work] = field(default_factory=list)
    bytes_sent: int = 0
    send_dtypes: bool = False
    host_staging: bool = False
    timeout: timedelta | None = None
    last_arrival: float | None = None
    _by_tag: bool | None = field(default=None, repr=False)
    _pending_peers: list[tuple[int, int, int, int]] = field(default_factory=list, repr=False)

    def send(self, tensors: list[Tensor], dst: int, kind: int, stage: int, microbatch: int, describe: bool = False) -> None:
        """Post asynchronous sends of ``tensors`` to global rank ``dst``; ``describe``: precede
        activations with their shapes (the receiver must pass ``describe`` too)."""
        if (self.send_dtypes or describe) and kind == ACTIVATION and tensors:
            device = "cpu" if self.host_staging else tensors[0].device
            header = _header(tensors, describe).to(device)
            self._post(header, dst, message_tag(HEADER, stage, microbatch, 0), (dst, HEADER, stage, microbatch))
        for leaf, tensor in enumerate(tensors):
            payload = tensor.detach().contiguous()
            if self.host_staging:
                payload = payload.cpu()  # synchronous: the send may start at once
            self.bytes_sent += payload.numel() * payload.element_size()
            tag = message_tag(kind, stage, microbatch, leaf)
            self._post(payload, dst, tag, (dst, kind, stage, microbatch))

    def _post(self, payload: Tensor, dst: int, tag: int, peer: tuple[int, int, int, int]) -> None:
        try:
            work = dist.isend(payload, dst=dst, group=self.group, tag=tag)
        except RuntimeError as error:
            self._fail(peer, receiving=False, error=error)
        self.pending.append(work)
        self._pending_peers.append(peer)

    def _wait(self, work: dist.Work, peer: tuple[int, int, int, int], receiving: bool) -> None:
        """Wait for one transfer, at most ``timeout``; a failure names the peer (PeerFailure)."""
        try:
            if self.timeout is not None:
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as error:
            self._fail(peer, receiving, error)

    def _fail(self, peer: tuple[int, int, int, int], receiving: bool, error: RuntimeError):
        rank, kind, stage, microbatch = peer
        # the peer's stage: the sender's for receives (``stage``), the next or previous for sends
        peer_stage = stage if receiving else stage + 1 if kind in (ACTIVATION, HEADER) else stage - 1
        raise PeerFailure(rank, peer_stage, _KIND_NAMES[kind], microbatch, receiving, self.timeout, error) from error

    def receive(
        self,
        shapes: list[tuple[torch.Size, torch.dtype]],
        src: int,
        kind: int,
        stage: int,
        microbatch: int,
        device: torch.device,
        describe: bool = False,
        header: PendingHeader | None = None,
    ) -> list[Tensor]:
        """Receive tensors of the given shapes from global rank ``src``, blocking until they arrive.

        ``stage`` is the *sending* stage, as in :meth:`send`. With ``send_dtypes``, the dtypes of
        activations are the sender's, whatever ``shapes`` says; with ``describe``, their shapes too
        (``header``: that message's header, posted earlier by :meth:`post_header_receive`).
        Sets :attr:`last_arrival` to the ``time.perf_counter()`` at which the message completed if
        this call had to wait for it, else None (it was there already).
        """
        started = time.perf_counter()
        wire = torch.device("cpu") if self.host_staging else device
        if header is not None:
            shapes = header.wait(shapes)
        elif (self.send_dtypes or describe) and kind == ACTIVATION and shapes:
            buffer = torch.empty(_header_size(len(shapes), describe), dtype=torch.int64, device=wire)
            peer = (src, HEADER, stage, microbatch)
            self._wait(self._irecv(buffer, src, message_tag(HEADER, stage, microbatch, 0), peer), peer, receiving=True)
            shapes = _read_header(buffer.tolist(), shapes, describe, peer)
        return self.post_receive(shapes, src, kind, stage, microbatch, device).wait(started)

    def post_header_receive(self, src: int, stage: int, microbatch: int, device: torch.device) -> PendingHeader:
        """Post the receive of the header that describes an activation message (``describe=True`` on
        the sender) and return at once: the header has one size whatever it describes, so its receive
        can be posted before the receiver knows the tensors' number or shapes, and it lands when sent
        instead of when asked for. Pass it to :meth:`receive` as ``header``. Only where
        :attr:`matches_by_tag` holds."""
        wire = torch.device("cpu") if self.host_staging else device
        buffer = torch.empty(_header_size(0, True), dtype=torch.int64, device=wire)
        peer = (src, HEADER, stage, microbatch)
        return PendingHeader(self, buffer, self._irecv(buffer, src, message_tag(HEADER, stage, microbatch, 0), peer), peer)

    @property
    def matches_by_tag(self) -> bool:
        """Whether receives may be posted in any order: gloo matches messages by tag; NCCL matches
        them in the order they are posted, which must then be the program's."""
        if self._by_tag is None:
            self._by_tag = dist.get_backend(self.group) == "gloo"
        return self._by_tag

    def post_receive(
        self,
        shapes: list[tuple[torch.Size, torch.dtype]],
        src: int,
        kind: int,
        stage: int,
        microbatch: int,
        device: torch.device,
    ) -> PendingReceive:
        """Post receives of tensors of exactly ``shapes`` (no header) and return at once; the transfer
        runs while this rank computes, and :meth:`PendingReceive.wait` collects it. Posting early
        only where :attr:`matches_by_tag` holds."""
        wire = torch.device("cpu") if self.host_staging else device
        buffers = [torch.empty(shape, dtype=dtype, device=wire) for shape, dtype in shapes]
        peer = (src, kind, stage, microbatch)
        works = [
            self._irecv(buffer, src, message_tag(kind, stage, microbatch, leaf), peer)
            for leaf, buffer in enumerate(buffers)
        ]
        return PendingReceive(self, buffers, works, peer, device)

    def _irecv(self, buffer: Tensor, src: int, tag: int, peer: tuple[int, int, int, int]) -> dist.Work:
        try:
            return dist.irecv(buffer, src=src, group=self.group, tag=tag)
        except RuntimeError as error:
            self._fail(peer, receiving=True, error=error)

    def wait_sends(self) -> None:
        """Block until every posted send completed (end of step), each at most ``timeout``."""
        try:
            for work, peer in zip(self.pending, self._pending_peers, strict=True):
                self._wait(work, peer, receiving=False)
        finally:
            self.pending.clear()
            self._pending_peers.clear()


@dataclass
class PendingReceive:
    """Receives posted by :meth:`PointToPoint.post_receive`, not yet waited for."""

    p2p: PointToPoint
    buffers: list[Tensor]
    works: list[dist.Work]
    peer: tuple[int, int, int, int]
    device: torch.device

    def wait(self, started: float | None = None) -> list[Tensor]:
        """Block until the tensors arrived and return them on ``device``; sets the transfer layer's
        ``last_arrival`` (``started``: when the caller began waiting, header included)."""
        started = time.perf_counter() if started is None else started
        self.p2p.last_arrival = None
        for work in self.works:
            self.p2p._wait(work, self.peer, receiving=True)
        finished = time.perf_counter()
        if finished - started > _ALREADY_THERE_S:
            self.p2p.last_arrival = finished
        return [buffer.to(self.device) for buffer in self.buffers] if self.p2p.host_staging else self.buffers


@dataclass
class PendingHeader:
    """A describing header's receive posted by :meth:`PointToPoint.post_header_receive`."""

    p2p: PointToPoint
    buffer: Tensor
    work: dist.Work
    peer: tuple[int, int, int, int]

    def wait(self, expected: list[tuple[torch.Size, torch.dtype]]) -> list[tuple[torch.Size, torch.dtype]]:
        """Block until the header arrived; the shapes and dtypes it describes (``expected``: what the
        receiver predicted, whose number of tensors the sender's must match)."""
        self.p2p._wait(self.work, self.peer, receiving=True)
        return _read_header(self.buffer.tolist(), expected, True, self.peer)


# A receive whose message is already there returns within this (tens of microseconds). gloo's
# `Work.is_completed()` cannot tell: it turns True only inside `wait()`.
_ALREADY_THERE_S = 2e-4


_NO_TENSOR = -1  # a describing header's entries after its last tensor


def _header_size(leaves: int, describe: bool) -> int:
    """A dtype header holds one code per tensor; a describing header room for the most tensors a
    boundary may carry, whatever it carries, so that its receive can be posted early."""
    return _MAX_LEAVES * (2 + _MAX_DIMS) if describe else leaves


def _header(tensors: list[Tensor], describe: bool) -> Tensor:
    """Per tensor its dtype code, and with ``describe`` its rank and sizes (padded to a fixed size,
    then entries of code ``_NO_TENSOR`` up to :func:`_header_size`)."""
    if not describe:
        return torch.tensor([_DTYPE_CODES[t.dtype] for t in tensors], dtype=torch.int64)
    values = []
    for tensor in tensors:
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"A tensor of {tensor.dim()} dimensions cannot cross a stage boundary (at most {_MAX_DIMS}).")
        sizes = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
        values += [_DTYPE_CODES[tensor.dtype], tensor.dim(), *sizes]
    values += [_NO_TENSOR] * (_header_size(0, True) - len(values))
    return torch.tensor(values, dtype=torch.int64)


def _read_header(
    values: list[int], shapes: list[tuple[torch.Size, torch.dtype]], describe: bool, peer: tuple[int, int, int, int]
) -> list[tuple[torch.Size, torch.dtype]]:
    if not describe:
        return [(shape, _DTYPE_LIST[code]) for (shape, _), code in zip(shapes, values, strict=True)]
    width = 2 + _MAX_DIMS
    described = []
    for leaf in range(_MAX_LEAVES):
        code, ndim, *sizes = values[leaf * width : (leaf + 1) * width]
        if code == _NO_TENSOR:
            break
        described.append((torch.Size(sizes[:ndim]), _DTYPE_LIST[code]))
    if len(described) != len(shapes):
        rank, _, stage, microbatch = peer
        raise RuntimeError(
            f"Stage {stage} (rank {rank}) sent {len(described)} tensors for microbatch {microbatch}, but the next "
            f"stage expects {len(shapes)} at its first block: the block before the boundary returned a different "
            "structure on the two ranks."
        )
    return described
