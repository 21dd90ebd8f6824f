"""GPipe (Huang et al., 2019): every forward, then every backward.

Rank ``r`` holds stage ``r``. It runs ``F`` of all microbatches, then ``B`` of all microbatches in the
same (ascending) order, as torch's ``ScheduleGPipe`` does. With uniform costs the bubble is
``(p - 1) / (m + p - 1)``; every rank keeps all ``m`` microbatches' activations alive at its peak.

Defined once, as the DSL preset ``gpipe`` (``priority=forward_first``, no in-flight limit); this module
registers the family name (see ``docs/schedules.md``, "One source per family").
"""

from __future__ import annotations

from ..dsl import build_preset
from ..ir import Program
from ..registry import register_schedule
from ._common import check_sizes


def gpipe(num_ranks: int, num_microbatches: int) -> Program:
    """Build the GPipe program (the ``gpipe`` preset).

    Args:
        num_ranks: pipeline ranks (= stages).
        num_microbatches: microbatches per step.

    Returns:
        The program, communication included, validated.
    """
    check_sizes("gpipe", num_ranks, num_microbatches)
    return build_preset("gpipe", num_ranks, num_microbatches)


register_schedule("gpipe", gpipe)
