"""Workload-balanced chunking (InfiniPipe Algorithm 1): slices of equal time, chunks that cover every
token once, never two tails in a chunk, the token limit, and Table 2's direction."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.chunking import (
    BATCHED,
    HYBRID,
    SPLIT,
    chunk_batch,
    chunk_time_model,
    piece_time,
    relative_std,
    split_mesh,
)
from lightning_pipe.planning.cost_model import LinearCost
from lightning_pipe.planning.gpt import gpt_7b
from lightning_pipe.planning.traces import github_like_trace

TIME = LinearCost(constant=0.01, per_token=1e-4, per_squared_length=1e-8)


@pytest.mark.parametrize("num_slices", [1, 2, 4, 7])
def test_mesh_slices_take_equal_time_earlier_ones_longer(num_slices):
    length = 65536
    mesh = split_mesh(length, num_slices, TIME)
    assert len(mesh) == num_slices and sum(mesh) == length
    assert list(mesh) == sorted(mesh, reverse=True)  # later slices pay for a longer context
    contexts = [sum(mesh[:i]) for i in range(num_slices)]
    times = [piece_time(TIME, c, s) for c, s in zip(contexts, mesh)]
    one_token = piece_time(TIME, length - 1, 1)  # integer slices: equal up to about one token's time
    assert max(times) - min(times) <= 2 * one_token


def test_quadratic_work_telescopes_over_slices():
    lengths = [40000, 9000, 3000, 700, 700, 120]
    plan = chunk_batch(lengths, 4, TIME)
    assert sum(chunk.shape.sum_squared_lengths for chunk in plan.chunks) == sum(n * n for n in lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_slices", [1, 3, 6])
def test_chunks_cover_every_token_once_and_never_hold_two_tails(seed, num_slices):
    lengths = list(github_like_trace(1, tokens_per_batch=262144, seed=seed).batches[0])
    plan = chunk_batch(lengths, num_slices, TIME)
    covered = {i: [] for i in range(len(lengths))}
    for chunk in plan.chunks:
        with_context = [p for p in chunk.pieces if p.start > 0 or p.length < lengths[p.sequence]]
        assert len(with_context) <= 1 and (not with_context or chunk.pieces[0] == with_context[0])
        assert chunk.kind in (BATCHED, SPLIT, HYBRID)
        assert chunk.tokens <= plan.token_limit
        for piece in chunk.pieces:
            covered[piece.sequence].append((piece.start, piece.length))
    for i, pieces in covered.items():
        starts = sorted(pieces)
        assert starts[0][0] == 0 and sum(n for _, n in starts) == lengths[i]
        assert all(a + n == b for (a, n), (b, _) in zip(starts, starts[1:]))
    # groups: a sliced sequence's chunks are consecutive, in order, the hybrid (tail) last
    assert sum(plan.slices) == len(plan.chunks)
    index = 0
    for count in plan.slices:
        group = plan.chunks[index : index + count]
        if count > 1:
            sequence = group[0].pieces[0].sequence
            assert [c.pieces[0].sequence for c in group] == [sequence] * count
            assert [c.kind for c in group] == [SPLIT] * (count - 1) + [HYBRID]
            assert [c.context for c in group] == sorted(c.context for c in group)
        index += count


def test_one_slice_is_batch_level_packing():
    plan = chunk_batch([500, 300, 200, 100], 1, TIME)
    assert all(c.kind == BATCHED or c.context == 0 for c in plan.chunks)
    assert plan.mesh == (500,) and all(count == 1 for count in plan.slices)


def test_balancing_length_too_evens_chunk_lengths_table_2_direction():
    """Table 2: balancing time only leaves chunk lengths uneven (35.2% RSD in the paper); InfiniPipe's
    token limit evens them (5.5%). On GitHub-like batches with the 7B cost model the length RSD falls
    at every slice count (the figures are printed by benchmarks/simulated_long.py)."""
    time = chunk_time_model(gpt_7b())
    for num_slices in (2, 4, 8):
        rsd = {}
        for balance_length in (False, True):
            values = []
            for lengths in github_like_trace(4, tokens_per_batch=262144, seed=3).batches:
                plan = chunk_batch(lengths, num_slices, time, balance_length=balance_length)
                values.append(relative_std([c.tokens for c in plan.chunks]))
            rsd[balance_length] = sum(values) / len(values)
        assert rsd[True] < rsd[False], (num_slices, rsd)


def test_refuses_empty_or_zero_lengths():
    with pytest.raises(ValueError, match="every length >= 1"):
        chunk_batch([3, 0], 2, TIME)
    with pytest.raises(ValueError, match=r"`num_slices` must be in \[1, 5\]"):
        split_mesh(5, 6, TIME)


# --- chunks as the plan's microbatching part ---------------------------------------------------


def _planned(lengths=(900, 120, 80, 300, 60, 40), num_slices=3):
    from lightning_pipe.planning.chunking import PlannedChunks

    return PlannedChunks.from_plan(chunk_batch(list(lengths), num_slices, TIME), lengths)


def test_planned_chunks_are_checked_to_cover_every_token_in_order():
    from lightning_pipe.planning.chunking import PlannedChunks

    chunks = _planned()
    assert chunks.is_sliced and chunks.num_microbatches == sum(chunks.slices)
    assert sum(s.tokens for s in chunks.shapes) == 1500 and sum(s.sum_squared_lengths for s in chunks.shapes) == sum(
        n * n for n in (900, 120, 80, 300, 60, 40)
    )
    with pytest.raises(ValueError, match="not covered to their ends"):
        PlannedChunks(chunks.pieces[:-1], (*chunks.slices[:-1], chunks.slices[-1] - 1) if chunks.slices[-1] > 1
                      else chunks.slices[:-1], chunks.sequence_lengths)
    with pytest.raises(ValueError, match=r"does not continue sequence 0"):
        PlannedChunks((((0, 10, 890),),), (1,), (900,))
    with pytest.raises(ValueError, match="sum to the 1 microbatches"):
        PlannedChunks((((0, 0, 900),),), (2,), (900,))


def test_chunks_are_the_plans_microbatching_part():
    """A proposal's chunks set the count, reach the merged plan, and do not outlive their batch; the
    joint planner's evaluation prices them by their pieces on sliced 1F1B."""
    from lightning_pipe.planning.joint import evaluate_plan
    from lightning_pipe.planning.plan import PipelinePlan
    from lightning_pipe.planning.proposals import PlanProposal, merge_proposals
    from lightning_pipe.schedules import simulate
    from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b

    chunks = _planned()
    current = PipelinePlan((0, 16, 32), "1f1b", 4)
    merged = merge_proposals(current, [PlanProposal("chunker", chunks=chunks)], 2, lambda n: (0, 16, 32)).plan
    assert merged.chunks == chunks and merged.num_microbatches == chunks.num_microbatches
    assert merge_proposals(merged, [], 2, lambda n: (0, 16, 32)).plan.chunks is None  # one batch only
    with pytest.raises(ValueError, match="give `num_microbatches="):
        PipelinePlan((0, 16, 32), "1f1b", 4, chunks=chunks)
    with pytest.raises(ValueError, match="without `microbatch_sizes`"):
        PlanProposal("x", chunks=chunks, microbatch_sizes=(1, 1))

    cost = gpt_7b()
    seconds, planned = evaluate_plan(cost, list(chunks.sequence_lengths), merged, 2, None, plan_memory_too=False)
    program = sliced_1f1b(2, chunks.num_microbatches, chunks.slices)
    assert seconds == pytest.approx(simulate(program, cost.stage_costs((0, 16, 32), chunks.shapes)).makespan, rel=1e-9)
    assert planned.chunks == chunks
    with pytest.raises(ValueError, match="schedule 'gpipe' cannot run them"):
        evaluate_plan(cost, list(chunks.sequence_lengths), PipelinePlan((0, 16, 32), "gpipe", chunks.num_microbatches,
                                                                        chunks=chunks), 2, None)
