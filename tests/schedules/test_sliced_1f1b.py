"""Sliced 1F1B: slices of a sequence go backward last first; the in-flight window is InfiniPipe's Eq. 7."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import simulate, validate
from lightning_pipe.schedules.costs import ActionCosts
from lightning_pipe.schedules.families import one_f_one_b
from lightning_pipe.schedules.families.sliced_1f1b import backward_order, sliced_1f1b
from lightning_pipe.schedules.ir import ActionType


def test_backward_order_is_last_slice_first_per_sequence():
    assert backward_order((1, 3, 2)) == [0, 3, 2, 1, 5, 4]


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("slices", [(1, 1, 1, 1), (3, 3, 3), (1, 3, 2, 1), (4, 4), (5, 1, 1)])
def test_valid_ordered_and_eq7_windows(num_ranks, slices):
    m = sum(slices)
    program = sliced_1f1b(num_ranks, m, slices)
    validate(program)
    for rank in range(num_ranks):
        backwards = [a.microbatch for a in program.actions[rank] if a.type is ActionType.BACKWARD]
        assert backwards == backward_order(slices)
    result = simulate(program, ActionCosts.uniform(num_ranks, m))
    # Eq. 7: |W_p| = d_p - p + N_prefill in the steady phase (p from 1), capped by the microbatches
    n = max(slices)
    assert result.max_in_flight == tuple(min(m, num_ranks - p + n) for p in range(1, num_ranks + 1))


@pytest.mark.parametrize(("num_ranks", "slices"), [(3, (3, 3, 3)), (4, (4, 4, 4, 4)), (4, (2,) * 6)])
def test_same_makespan_as_1f1b_for_equal_slices(num_ranks, slices):
    """Equal-cost slices: reversing the backward order inside a sequence costs no bubble."""
    m = sum(slices)
    costs = ActionCosts.uniform(num_ranks, m)
    assert simulate(sliced_1f1b(num_ranks, m, slices), costs).makespan == simulate(one_f_one_b(num_ranks, m), costs).makespan


def test_one_slice_per_sequence_is_1f1b():
    assert sliced_1f1b(4, 6).actions == one_f_one_b(4, 6).actions


def test_slices_must_cover_the_microbatches():
    with pytest.raises(ValueError, match=r"`slices=\(2, 2\)` must be positive counts summing to num_microbatches=5"):
        sliced_1f1b(2, 5, (2, 2))
