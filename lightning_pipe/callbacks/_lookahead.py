"""A plan computed on a background thread while the current batch trains (lookahead).

Planners are pure computation (numpy, HiGHS), so they can run beside the step; the training thread
joins the job before the next batch and gets the plan, or the planner's exception re-raised there.
Jobs run on one worker thread per process, started with the first job: starting a thread per job
cost the training thread about 2 ms a batch (``Thread.start`` waits until the new thread runs).

On Linux the worker thread runs at the lowest CPU priority (nice 19, for that thread only): on a
machine whose cores all train (CPU training, one process per core) a planner at equal priority
takes its CPU time from the step, and the planners do not price that; at the lowest priority it runs
in the step's idle time (pipeline bubbles, waits on messages) and at full speed once the training
thread blocks on its result.

A job created while the strategy plans a batch (its callbacks' ``on_train_batch_start`` and the
plan's application) is queued only once that plan is applied (``start_after``, the strategy's
``plan_gate``): started at once, it shared the GIL with the hooks, the plan's broadcast and the
migration that every rank waits for. Held back rather than queued and blocked, it keeps no thread
waiting when the gate never opens (an error in a hook), which would hang the process at exit. On
``bench_planning``'s chained planners, delaying the jobs' start by 20 ms halved the ranks' wait at the
memory plan's broadcast (4.9 to 2.8 and 1.2 ms, one invocation each); the gate starts them as soon as
the plan is in place instead.

While a job runs, the interpreter's switch interval is 0.2 ms instead of 5 ms (restored after): a
planner holds the GIL while it runs Python, and the training thread, back from a wait on a message,
waited up to the switch interval for it at every collective and receive. On ``bench_planning``'s
chained planners (repartition, memory, switch) the ranks' wait at the memory plan's broadcast fell
from 7.8-8.8 ms to 3.9-5.4 ms a step (2 invocations each), against 1-3 ms for a bare broadcast.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Result = TypeVar("Result")

_SWITCH_INTERVAL = 0.0002  # seconds a thread holds the GIL while another waits for it, during jobs

_WORKER: dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # by process id: a forked child starts its own


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """The process's lookahead thread (jobs of several planners run one after the other). A process
    forked from one that had it does not inherit the thread, only the object: it makes its own."""
    pid = os.getpid()
    if pid not in _WORKER:
        _WORKER.clear()
        _WORKER[pid] = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lightning-pipe-lookahead", initializer=_lowest_priority
        )
    return _WORKER[pid]


def _lowest_priority() -> None:
    """Nice 19 for the calling thread only: Linux applies ``setpriority`` to a thread id alone (other
    systems would apply it to a process, so they keep the default)."""
    if not sys.platform.startswith("linux"):
        return
    # a container may forbid changing priorities: then the thread plans at the default one
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class LookaheadJob(Generic[Result]):
    """``compute()`` for the batch described by ``key``, queued on the lookahead thread at once, or
    when ``start_after`` (a gate with ``defer(start)``: the strategy's ``plan_gate``) opens; see the
    module docstring."""

    def __init__(self, key: Any, compute: Callable[[], Result], name: str, start_after: Any = None) -> None:
        self.key = key
        self.name = name
        self.seconds = 0.0  # wall seconds ``compute`` took (known once joined)
        self._compute = compute
        self._future: concurrent.futures.Future | None = None
        if start_after is None:
            self._queue()
        else:
            start_after.defer(self._queue)

    def _queue(self) -> None:
        if self._future is None:
            self._future = _worker().submit(self._run, self._compute)

    def _run(self, compute: Callable[[], Result]) -> Result:
        started = time.perf_counter()
        previous = sys.getswitchinterval()  # jobs run one at a time: no other job changes it meanwhile
        sys.setswitchinterval(min(previous, _SWITCH_INTERVAL))
        try:
            return compute()
        finally:
            sys.setswitchinterval(previous)
            self.seconds = time.perf_counter() - started

    def join(self) -> Result:
        """Wait for the plan; raise the planner's error here if it failed."""
        self._queue()  # needed now: held back no longer
        return self._future.result()

    def wait(self) -> None:
        """Wait for the job to end, whatever its outcome (training ends: nothing may run on); a job
        still held back never starts."""
        if self._future is not None:
            concurrent.futures.wait([self._future])
