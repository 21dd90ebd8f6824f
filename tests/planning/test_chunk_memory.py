"""Chunks in the memory planner: each chunk's own length, its attention bytes and its slice's stored keys
and values (the formulas themselves are pinned against a real block in tests/runtime/test_packing.py)."""

from __future__ import annotations

import pytest

from lightning_pipe.planning.chunk_memory import ChunkMemory, chunk_memory, chunk_shapes
from lightning_pipe.planning.chunking import chunk_pieces
from lightning_pipe.planning.cost_model import LinearCost
from lightning_pipe.planning.memory_model import MemoryPlan, StageMemory, predict_memory
from lightning_pipe.planning.memory_planner import MemoryBudgetError, plan_memory
from lightning_pipe.schedules.families.sliced_1f1b import sliced_1f1b
from tests.planning.test_memory_model import toy_profile

LENGTHS = [900, 120, 80, 300, 60, 40]
TIME = LinearCost(per_token=1.0, per_squared_length=1e-3)


def _chunks(max_tokens=400):
    pieces, slices = chunk_pieces(LENGTHS, TIME, max_tokens)
    program = sliced_1f1b(2, len(pieces), slices)
    return pieces, program


def test_chunk_shapes_price_each_piece_with_its_context():
    pieces, _ = _chunks()
    shapes = chunk_shapes(pieces)
    assert sum(s.tokens for s in shapes) == sum(LENGTHS)
    assert sum(s.sum_squared_lengths for s in shapes) == sum(n * n for n in LENGTHS)  # Eq. 1's term telescopes
    sliced = [s for s, group in zip(shapes, pieces) if group[0][1] > 0]
    assert sliced and all(
        s.sum_squared_lengths > sum(n * n for _, _, n in g) for s, g in zip(shapes, pieces) if g[0][1] > 0
    )


def test_chunk_memory_counts_masks_context_and_the_store():
    pieces, _ = _chunks()
    memory = chunk_memory(pieces, LENGTHS, hidden=4, element_bytes=2)
    for group, attention, kept in zip(pieces, memory.attention, memory.kept):
        sequence, start, length = group[0]
        rows = sum(n for _, _, n in group)
        if length < LENGTHS[sequence]:  # a slice: mask [rows, start + rows], K/V of start + rows tokens, store
            assert attention == 2 * (rows * (start + rows) + 8 * (start + rows))
            assert kept == 2 * (12 * rows + 8 * length)
        else:
            assert kept == 0 and attention == (2 * rows * rows if len(group) > 1 else 0)
    flash = chunk_memory(pieces, LENGTHS, hidden=4, element_bytes=2, masked=False, masked_slices=False)
    assert all(a == 0 for a, g in zip(flash.attention, pieces) if g[0][2] == LENGTHS[g[0][0]])
    with pytest.raises(ValueError, match="2 attention entries but 1 kept"):
        ChunkMemory((0.0, 0.0), (0.0,))


def test_predicted_bytes_keep_the_store_under_full_recompute_and_attention_under_keep_attention():
    pieces, program = _chunks()
    shapes, profile = chunk_shapes(pieces), toy_profile(num_blocks=4)
    memory = chunk_memory(pieces, LENGTHS, hidden=4, element_bytes=2)
    boundaries = (0, 2, 4)

    def saved(plan, chunks):
        return predict_memory(program, boundaries, shapes, plan, profile, chunks=chunks).saved_peak_bytes

    empty = ChunkMemory.empty(len(pieces))
    assert saved(MemoryPlan(), empty) == saved(MemoryPlan(), None)
    full, keep = MemoryPlan.from_options("full"), MemoryPlan.from_options("keep_attention")
    only_kept = ChunkMemory((0.0,) * len(pieces), memory.kept)
    only_attention = ChunkMemory(memory.attention, (0.0,) * len(pieces))
    assert all(a > b for a, b in zip(saved(full, only_kept), saved(full, None)))  # nothing removes the store
    assert saved(full, only_attention) == saved(full, None)  # recomputed: no mask, no context kept
    assert all(a > b for a, b in zip(saved(keep, only_attention), saved(keep, None)))  # attention's inputs kept


def test_the_planner_recomputes_for_the_chunks_bytes_and_fits_with_them():
    """A budget the profile alone fits without recompute, but not with the chunks' masks, contexts and
    stores: the plan counting them recomputes some (stage, chunk) pairs and its prediction fits."""
    pieces, program = _chunks()
    shapes, profile = chunk_shapes(pieces), toy_profile(num_blocks=4)
    memory = chunk_memory(
        pieces, LENGTHS, hidden=1, element_bytes=2, masked=False, masked_slices=False
    )  # toy: 34 bytes/token
    boundaries = (0, 2, 4)
    unaware = max(predict_memory(program, boundaries, shapes, MemoryPlan(), profile).peak_bytes)
    aware = max(predict_memory(program, boundaries, shapes, MemoryPlan(), profile, chunks=memory).peak_bytes)
    assert aware > unaware
    budget = unaware + 0.1 * (aware - unaware)
    assert plan_memory(program, boundaries, shapes, profile, budget).plan.is_empty  # blind to the chunks
    result = plan_memory(program, boundaries, shapes, profile, budget, chunks=memory, options=("full",))
    assert not result.plan.is_empty
    assert max(predict_memory(program, boundaries, shapes, result.plan, profile, chunks=memory).peak_bytes) <= budget
    chosen = {key for key, choice in result.plan.microbatches.items() if choice != StageMemory()}
    assert chosen != {(s, m) for s in range(2) for m in range(len(pieces))}  # per (stage, chunk), not all
    floor = max(
        predict_memory(program, boundaries, shapes, MemoryPlan.from_options("full"), profile, chunks=memory).peak_bytes
    )
    with pytest.raises(MemoryBudgetError, match="No memory plan fits"):
        plan_memory(program, boundaries, shapes, profile, floor * 0.9, chunks=memory, options=("full",))
