"""Nothing hangs: when a rank dies (SIGKILL) or freezes (SIGSTOP), every other rank ends within
``timeout`` plus a few seconds, with an error naming the peer it waited for.

The ranks run as torchrun starts them (one process per rank, rendezvous through environment
variables; tests/helpers/failures.py), forked from the test so they start in a second; one test
starts real interpreters to cover a normal process exit. Rank ``victim`` signals itself at the start
of step 2 (tests/helpers/failing_rank.py).
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.failures import run_failing_job

TIMEOUT = 5.0  # seconds: the strategy's `timeout`
BOUND = TIMEOUT + 30.0  # generous: a loaded 2-core machine; measured about TIMEOUT + 0.3 s


def _final_error(output: str) -> str:
    """The last exception line of a rank's output."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in output.splitlines()]  # torch's rank prefix
    lines = [line for line in lines if re.match(r"^[\w.]+(Error|Failure|Exception): ", line)]
    assert lines, output[-3000:]
    return lines[-1]


def _check(exits: dict, victim: int, signal_name: str) -> dict[int, str]:
    """Every rank but the victim ended by itself within the bound with a named failure; their messages."""
    cause = "no answer within the timeout of 5 s" if signal_name == "STOP" else "its process died"
    messages = {}
    for rank, result in exits.items():
        if rank == victim:
            assert result.returncode == -9  # killed itself, or frozen and killed by the test
            continue
        assert result.seconds is not None and result.seconds < BOUND, (
            f"rank {rank} did not end: {result.output[-2000:]}"
        )
        assert result.returncode == 1, result.output[-2000:]
        error = _final_error(result.output)
        assert error.startswith(
            ("lightning_pipe.runtime.failures.PeerFailure: ", "lightning_pipe.runtime.failures.CollectiveFailure: ")
        ), error
        assert f"Rank {rank} " in error and "gave up" in error and "ElasticPipelineStrategy(timeout=...)" in error, (
            error
        )
        messages[rank] = error
    return messages, cause


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
@pytest.mark.parametrize(
    ("world_size", "pp", "victim", "named"),
    [
        # named: rank -> the peer (rank, stage, what, action) its message must name
        (2, 2, 1, {0: ("rank 1 (stage 1)", "gradients of microbatch 0", "BACKWARD of stage 0, microbatch 0")}),
        (
            4,
            4,
            2,
            {
                1: ("rank 2 (stage 2)", "gradients of microbatch 0", "BACKWARD of stage 1, microbatch 0"),
                3: ("rank 2 (stage 2)", "activations of microbatch 0", "FORWARD of stage 3, microbatch 0"),
            },
        ),
        (4, 2, 0, {2: ("rank 0 (stage 0)", "activations of microbatch 0", "FORWARD of stage 1, microbatch 0")}),
    ],
    ids=["pp2", "pp4", "pp2xdp2"],
)
def test_every_other_rank_ends_with_the_peer_named(tmp_path, world_size, pp, victim, named, signal_name):
    exits = run_failing_job(tmp_path, world_size, pp, victim, signal_name, TIMEOUT, limit=BOUND + 5)
    messages, cause = _check(exits, victim, signal_name)
    for rank, (peer, what, action) in named.items():
        error = messages[rank]
        assert peer in error and "running " in error and "microbatch" in error and cause in error, error
        if signal_name == "STOP":  # a frozen peer: the transfer it never answered (a dead one may fail a send first)
            assert f"from {peer}" in error and what in error and action in error, error
    if world_size == 4 and pp == 2:  # the victim's data-parallel partner waited in the gradient average
        assert (
            "gave up in the gradient average of stages [0] over data-parallel replicas, waiting for rank 0"
            in messages[1]
        )


@pytest.mark.timeout(180)
def test_frozen_rank_in_real_processes(tmp_path):
    """Interpreters started as torchrun starts them (imports, a normal exit): the survivor still ends in time."""
    exits = run_failing_job(tmp_path, 2, 2, 0, "STOP", TIMEOUT, limit=BOUND + 5, fork=False)
    messages, cause = _check(exits, 0, "STOP")
    assert (
        "from rank 0 (stage 0)" in messages[1] and "activations of microbatch 0" in messages[1] and cause in messages[1]
    )
