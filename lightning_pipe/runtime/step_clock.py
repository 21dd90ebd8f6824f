"""Where a step's time goes outside the program of actions: named parts, summed per step.

The executor's records say what the program did (compute, waits, sends); a step also splits the
batch and plans it, shares the loss and logs, synchronizes gradients and steps the optimizer. The
strategy measures those parts here, and the monitor reports them beside the program's, so a step's
framework overhead is measured, not guessed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["StepClock"]


@dataclass
class StepClock:
    """Wall seconds of named parts of the current step (``perf_counter``), reset before each step.

    A step starts when its batch is moved to the device, before the callbacks' ``on_train_batch_start``,
    so that what planner callbacks do on the step's critical path counts in it (part ``plan``; merging
    their proposals and installing the plan, migrations included, is ``apply``).
    Work done for the step off its critical path (a plan made on a lookahead thread while the step
    before ran) is kept apart, in :attr:`background`.

    Attributes:
        parts: seconds per part name since the last :meth:`reset`, on the step's critical path.
        background: seconds per part name done for this step beside the previous one.
        started: ``perf_counter()`` at the last :meth:`reset`.
        fresh: reset for a step that has not begun its own work yet.
    """

    parts: dict[str, float] = field(default_factory=dict)
    background: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    fresh: bool = False
    _open: list[str | None] = field(default_factory=list, init=False, repr=False)  # parts being measured (None: aside)

    def reset(self) -> None:
        """Start a new step."""
        self.parts, self.background = {}, {}
        self.started, self.fresh = time.perf_counter(), True

    def add_background(self, part: str, seconds: float) -> None:
        """Count ``seconds`` of ``part`` done for this step off its critical path."""
        self.background[part] = self.background.get(part, 0.0) + seconds

    @contextlib.contextmanager
    def measure(self, part: str) -> Iterator[None]:
        """Add the time of the body to ``part``; a part measured inside another is taken out of the
        enclosing one (the next batch fetched inside a planner's hook is ``data``, not ``plan``)."""
        with self._timed(part):
            yield

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Take the body's time out of the enclosing part without counting it in any (the training
        closure Lightning runs inside the optimizer step is not the optimizer's); parts measured in
        the body still count."""
        with self._timed(None):
            yield

    @contextlib.contextmanager
    def _timed(self, part: str | None) -> Iterator[None]:
        started = time.perf_counter()
        self._open.append(part)
        try:
            yield
        finally:
            self._open.pop()
            seconds = time.perf_counter() - started
            if part is not None:
                self.parts[part] = self.parts.get(part, 0.0) + seconds
            if self._open and self._open[-1] is not None:  # the enclosing part keeps only its own time
                self.add(self._open[-1], -seconds)

    def add(self, part: str, seconds: float) -> None:
        """Add ``seconds`` to ``part`` (negative to take back a nested part's time)."""
        self.parts[part] = self.parts.get(part, 0.0) + seconds
