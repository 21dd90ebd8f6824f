"""Lookahead jobs: results and errors come back to the training thread, in forked ranks too."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

import pytest

from lightning_pipe.callbacks._lookahead import LookaheadJob
from lightning_pipe.strategies.plan_merging import PlanGate


def _child(queue) -> None:
    queue.put(LookaheadJob("child", lambda: 2, "test").join())


def test_a_job_returns_its_result_or_raises_its_error():
    assert LookaheadJob("k", lambda: 1, "test").join() == 1
    job = LookaheadJob("k", lambda: 1 / 0, "test")
    job.wait()
    with pytest.raises(ZeroDivisionError):
        job.join()
    assert job.seconds >= 0.0


def test_a_forked_process_runs_jobs_on_its_own_thread():
    """A rank forked from a process that had run a job (the fork launcher) would otherwise wait forever
    on the parent's worker thread, which it does not have."""
    LookaheadJob("parent", lambda: 1, "test").join()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(queue,))
    child.start()
    assert queue.get(timeout=30) == 2
    child.join(timeout=30)
    assert child.exitcode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities: Linux's setpriority")
def test_lookahead_thread_plans_at_the_lowest_priority_and_leaves_the_training_thread_alone():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    job = LookaheadJob("key", lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), "test")
    assert job.join() == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_job_runs_with_a_short_switch_interval_and_restores_it():
    """The training thread must not wait up to 5 ms for the GIL a planner holds, after each message."""
    before = sys.getswitchinterval()
    during = LookaheadJob("k", sys.getswitchinterval, "test").join()
    assert during < before and during <= 0.0005
    assert sys.getswitchinterval() == before
    failed = LookaheadJob("k", lambda: 1 / 0, "test")
    failed.wait()
    assert sys.getswitchinterval() == before  # restored after an error too


def test_a_job_made_while_a_batch_is_planned_starts_once_its_plan_is_applied():
    """Started at once, a job shared the GIL with the hooks and the plan's broadcast every rank waits
    for; it waits for the strategy's ``plan_gate`` instead, and a join does not wait for it."""
    gate, started = PlanGate(), threading.Event()
    job = LookaheadJob("k", lambda: started.set() or 3, "test", start_after=gate)
    assert not started.wait(0.2)  # the plan is not applied: the job has not started
    gate.open()
    assert started.wait(10) and job.join() == 3
    assert LookaheadJob("k", lambda: 4, "test", start_after=PlanGate()).join() == 4  # needed now: no gate waited for
    assert LookaheadJob("k", lambda: 5, "test", start_after=gate).join() == 5  # an open gate starts it at once


def test_a_job_whose_gate_never_opens_does_not_keep_the_process_alive():
    """An error in a hook leaves the batch's gate closed; the held job must not block the exit."""
    code = (
        "from lightning_pipe.callbacks._lookahead import LookaheadJob\n"
        "from lightning_pipe.strategies.plan_merging import PlanGate\n"
        "job = LookaheadJob('k', lambda: 1, 'test', start_after=PlanGate())\n"
        "job.wait()\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
