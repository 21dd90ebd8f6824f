"""1F1B (PipeDream-Flush, Narayanan et al., 2019): one forward, one backward in the steady state.

Rank ``r`` holds stage ``r``. It runs ``min(p - 1 - r, m)`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. Same bubble as GPipe,
``(p - 1) / (m + p - 1)``, but rank ``r`` never holds more than ``p - r`` microbatches in flight.

Defined once, as the DSL preset ``1f1b`` (``priority=backward_first``, ``max_in_flight=auto``, which
is ``p - r`` one-to-one); this module registers the family name.
"""

from __future__ import annotations

from ..dsl import build_preset
from ..ir import Program
from ..registry import register_schedule
from ._common import check_sizes


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Program:
    """Build the 1F1B program (the ``1f1b`` preset).

    Args:
        num_ranks: pipeline ranks (= stages).
        num_microbatches: microbatches per step.

    Returns:
        The program, communication included, validated.
    """
    check_sizes("1f1b", num_ranks, num_microbatches)
    return build_preset("1f1b", num_ranks, num_microbatches)


register_schedule("1f1b", one_f_one_b)
