"""Start a job of independent rank processes (as torchrun does) in which one rank fails; watch the rest."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import failing_rank  # imported here, so forked ranks start with torch and Lightning loaded

REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass
class RankExit:
    """How one rank of a failing job ended.

    Attributes:
        rank: global rank.
        returncode: the process's exit status (negative: killed by that signal).
        seconds: from the victim's signal to this process's end (None: it did not end by itself
            within the limit and was killed by the test).
        output: everything it wrote to stdout and stderr.
    """

    rank: int
    returncode: int | None
    seconds: float | None
    output: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forked_rank(env: dict[str, str], argv: list[str], log_path: str) -> None:
    """A rank forked from the test: its own environment and output file, then the script's main."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # pytest replaced the Python-level streams
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    failing_rank.main(argv)


class _Forked:
    """A forked rank with the ``poll``/``kill``/``wait``/``returncode`` of a ``subprocess.Popen``."""

    def __init__(self, process: multiprocessing.Process) -> None:
        self.process = process

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> None:
        self.process.join()


def run_failing_job(
    directory: Path,
    world_size: int,
    pp: int,
    victim: int,
    signal_name: str,
    timeout: float,
    limit: float,
    fork: bool = True,
) -> dict[int, RankExit]:
    """Run tests/helpers/failing_rank.py on ``world_size`` processes; rank ``victim`` sends itself
    SIG``signal_name`` at step 2. Waits until every other rank ended or ``limit`` seconds after the
    signal, then kills what is left (the frozen victim included) so no process outlives the test.

    ``fork``: fork the ranks from the test (no imports to pay; a forked process ends without the
    interpreter's finalization); otherwise start ``python -m tests.helpers.failing_rank`` per rank,
    exactly as torchrun would.
    """
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    processes = []
    for rank in range(world_size):
        env = dict(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPOSITORY),
        )
        argv = [
            "--pp",
            str(pp),
            "--victim",
            str(victim),
            "--signal",
            signal_name,
            "--timeout",
            str(timeout),
            "--directory",
            str(directory),
        ]
        log_path = directory / f"rank{rank}.log"
        if fork:
            process = multiprocessing.get_context("fork").Process(target=_forked_rank, args=(env, argv, str(log_path)))
            process.start()
            processes.append(_Forked(process))
        else:
            command = [sys.executable, "-m", "tests.helpers.failing_rank", *argv]
            log = open(log_path, "w")
            processes.append(
                subprocess.Popen(
                    command, cwd=REPOSITORY, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
                )
            )
    ended: dict[int, float] = {}
    signalled = directory / "signalled.txt"
    start_limit = time.time() + 120  # until the victim signals (imports, setup, two steps)
    try:
        while True:
            now = time.time()
            for rank, process in enumerate(processes):
                if rank not in ended and process.poll() is not None:
                    ended[rank] = now
            others_done = all(r in ended for r in range(world_size) if r != victim)
            sent = float(signalled.read_text()) if signalled.exists() and signalled.read_text() else None
            if others_done or (sent is not None and now > sent + limit) or (sent is None and now > start_limit):
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    sent = float(signalled.read_text()) if signalled.exists() else None
    exits = {}
    for rank, process in enumerate(processes):
        seconds = ended[rank] - sent if rank in ended and sent is not None else None
        exits[rank] = RankExit(rank, process.returncode, seconds, (directory / f"rank{rank}.log").read_text())
    return exits


__all__ = ["RankExit", "run_failing_job", "signal"]
