"""Point-to-point transfer of activations and gradients between pipeline ranks.

Sends are posted asynchronously and waited for at the end of the step; receives block where the
tensor is needed. Every message carries a tag derived from (kind, stage, microbatch, leaf), so gloo
matches messages by tag; NCCL ignores tags and matches in order, which holds because both sides
derive their order from the same validated program.

The receiver allocates buffers from the shapes and dtypes it predicted on the meta device. Under
autocast that prediction can be wrong about dtypes (autocast does not apply to meta tensors: a
block ending in a linear layer outputs bfloat16 for real but float32 on meta), so with
``send_dtypes`` every activation message is preceded by a small header with its tensors' dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

ACTIVATION = 0
GRADIENT = 1
DTYPES = 2  # the dtype header of an activation message
_KINDS = 3
_MAX_LEAVES = 64
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
    """

    group: dist.ProcessGroup | None = None
    pending: list[dist.Work] = field(default_factory=list)
    bytes_sent: int = 0
    send_dtypes: bool = False
    host_staging: bool = False

    def send(self, tensors: list[Tensor], dst: int, kind: int, stage: int, microbatch: int) -> None:
        """Post asynchronous sends of ``tensors`` to global rank ``dst``."""
        if self.send_dtypes and kind == ACTIVATION and tensors:
            device = "cpu" if self.host_staging else tensors[0].device
            codes = torch.tensor([_DTYPE_CODES[t.dtype] for t in tensors], dtype=torch.int64, device=device)
            tag = message_tag(DTYPES, stage, microbatch, 0)
            self.pending.append(dist.isend(codes, dst=dst, group=self.group, tag=tag))
        for leaf, tensor in enumerate(tensors):
            payload = tensor.detach().contiguous()
            if self.host_staging:
                payload = payload.cpu()  # synchronous: the send may start at once
            self.bytes_sent += payload.numel() * payload.element_size()
            tag = message_tag(kind, stage, microbatch, leaf)
            self.pending.append(dist.isend(payload, dst=dst, group=self.group, tag=tag))

    def receive(
        self,
        shapes: list[tuple[torch.Size, torch.dtype]],
        src: int,
        kind: int,
        stage: int,
        microbatch: int,
        device: torch.device,
    ) -> list[Tensor]:
        """Receive tensors of the given shapes from global rank ``src``, blocking until they arrive.

        ``stage`` is the *sending* stage, as in :meth:`send`. With ``send_dtypes``, the dtypes of
        activations are the sender's, whatever ``shapes`` says.
        """
        wire = torch.device("cpu") if self.host_staging else device
        if self.send_dtypes and kind == ACTIVATION and shapes:
            codes = torch.empty(len(shapes), dtype=torch.int64, device=wire)
            dist.irecv(codes, src=src, group=self.group, tag=message_tag(DTYPES, stage, microbatch, 0)).wait()
            shapes = [(shape, _DTYPE_LIST[code]) for (shape, _), code in zip(shapes, codes.tolist(), strict=True)]
        buffers = [torch.empty(shape, dtype=dtype, device=wire) for shape, dtype in shapes]
        works = [
            dist.irecv(buffer, src=src, group=self.group, tag=message_tag(kind, stage, microbatch, leaf))
            for leaf, buffer in enumerate(buffers)
        ]
        for work in works:
            work.wait()
        return [buffer.to(device) for buffer in buffers] if self.host_staging else buffers

    def wait_sends(self) -> None:
        """Block until every posted send completed (end of step)."""
        for work in self.pending:
            work.wait()
        self.pending.clear()
