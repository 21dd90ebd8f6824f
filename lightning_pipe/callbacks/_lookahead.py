"""A plan computed on a background thread while the current batch trains (lookahead).

Planners are pure computation (numpy, HiGHS), so they can run beside the step; the training thread
joins the job before the next batch and gets the plan, or the planner's exception re-raised there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Result = TypeVar("Result")


class LookaheadJob(Generic[Result]):
    """``compute()`` for the batch described by ``key``, started on a daemon thread at once."""

    def __init__(self, key: Any, compute: Callable[[], Result], name: str) -> None:
        self.key = key
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # wall seconds ``compute`` took (known once joined)
        self.thread = threading.Thread(target=self._run, args=(compute,), name=name, daemon=True)
        self.thread.start()

    def _run(self, compute: Callable[[], Result]) -> None:
        started = time.perf_counter()
        try:
            self.result = compute()
        except BaseException as error:  # noqa: BLE001  (re-raised in the training thread by join())
            self.error = error
        self.seconds = time.perf_counter() - started

    def join(self) -> Result:
        """Wait for the plan; raise the planner's error here if it failed."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result
