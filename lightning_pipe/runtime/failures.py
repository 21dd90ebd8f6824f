"""Errors that say which peer a rank waited for, what for, and what to check, when the peer is gone.

Every wait of the pipeline is bounded by the strategy's ``timeout`` (process groups are created with
it, point-to-point waits pass it). When it runs out, or the peer's process died (gloo: "Connection
closed by peer"), the backend's own error names neither the rank nor the stage; these errors do:
:class:`PeerFailure` for point-to-point transfers (the executor adds its own rank, stage, action and
microbatch), :class:`CollectiveFailure` for collectives over a group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

_HINT = (
    "did it fail with its own error (see its output), run out of memory, get killed (OOM killer, preemption) "
    "or suspended (SIGSTOP, a debugger)"
)


def describe_cause(error: BaseException, timeout: timedelta | None) -> str:
    """Why a wait ended, in words: the peer stopped answering (timeout), died, or the transfer failed."""
    text = str(error)
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        limit = f" of {timeout.total_seconds():g} s" if timeout is not None else ""
        return f"no answer within the timeout{limit} (it stopped answering)"
    if "Connection closed" in text or "Connection reset" in text or "Broken pipe" in text:
        return "the connection was closed (its process died)"
    return "the transfer failed"


def _backend_message(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return first if len(first) <= 300 else first[:300] + "..."


class PeerFailure(RuntimeError):
    """A point-to-point transfer with a pipeline peer failed: the peer stopped answering or died.

    Attributes:
        peer: the peer's global rank.
        peer_stage: the peer's stage in the transfer (the sending stage for receives, the receiving
            stage for sends).
        what: ``"activations"``, ``"gradients"`` or ``"activation dtypes"``.
        microbatch: the microbatch transferred.
        receiving: True for a receive, False for a send.
        timeout: the bound of the wait.
        where: this rank's side (rank, stage, action), filled in by the executor.
    """

    def __init__(
        self,
        peer: int,
        peer_stage: int,
        what: str,
        microbatch: int,
        receiving: bool,
        timeout: timedelta | None,
        cause: BaseException,
        where: str = "",
    ) -> None:
        self.peer, self.peer_stage, self.what, self.microbatch = peer, peer_stage, what, microbatch
        self.receiving, self.timeout, self.cause, self.where = receiving, timeout, cause, where
        super().__init__(self._message())

    def located(self, where: str) -> PeerFailure:
        """The same failure with this rank's side described (``"Rank 1 (stage 1) in F(...)"``)."""
        return PeerFailure(
            self.peer, self.peer_stage, self.what, self.microbatch, self.receiving, self.timeout, self.cause, where
        )

    def _message(self) -> str:
        direction = (
            f"receive the {self.what} of microbatch {self.microbatch} from"
            if self.receiving
            else (f"send the {self.what} of microbatch {self.microbatch} to")
        )
        where = self.where or "This rank"
        return (
            f"{where} gave up waiting to {direction} rank {self.peer} (stage {self.peer_stage}): "
            f"{describe_cause(self.cause, self.timeout)}. Check rank {self.peer} first: {_HINT}? "
            "If a step legitimately takes longer, raise `ElasticPipelineStrategy(timeout=...)`. "
            f"[{_backend_message(self.cause)}]"
        )

    def __reduce__(self):  # picklable for spawn's error reporting
        return (
            PeerFailure,
            (
                self.peer,
                self.peer_stage,
                self.what,
                self.microbatch,
                self.receiving,
                self.timeout,
                RuntimeError(str(self.cause)),
                self.where,
            ),
        )


class CollectiveFailure(RuntimeError):
    """A collective over a process group failed: one of its ranks stopped answering or died."""


@contextmanager
def naming_failures(
    operation: str, group: dist.ProcessGroup | None, timeout: timedelta | None = None
) -> Iterator[None]:
    """Turn a backend error inside a collective into a :class:`CollectiveFailure` that names the
    collective (``operation``), this rank and the group's ranks, and says what to check."""
    try:
        yield
    except CollectiveFailure:
        raise
    except RuntimeError as error:
        me = dist.get_rank() if dist.is_initialized() else 0
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        except (RuntimeError, ValueError):
            ranks = []
        others = [r for r in ranks if r != me]
        peers = f"rank {others[0]}" if len(others) == 1 else f"ranks {others}"
        raise CollectiveFailure(
            f"Rank {me} gave up in {operation}, waiting for {peers}: {describe_cause(error, timeout)}. Check "
            f"{'it' if len(others) == 1 else 'them'} first: {_HINT}? (The first rank to fail names the peer it waited "
            "for.) If a step legitimately takes longer, raise `ElasticPipelineStrategy(timeout=...)`. "
            f"[{_backend_message(error)}]"
        ) from error
