"""Split-placement schedules by name: ``"helix"`` (HelixPipe) and ``"spipe"`` (SPipe) for a given model.

The registered families build a program from ``(ranks, microbatches)`` with ``ranks x stages_per_rank``
stages. The two split-placement families cannot: their stage count follows the model (HelixPipe: ``2L +
1`` stages for ``L`` blocks, each block cut at its attention; SPipe: ``ranks x stages_per_rank x
backward_split`` finer stages of whole blocks that must divide ``L``), and one stage's actions run on
several ranks (``Program.pair_ranks``). So a :class:`~lightning_pipe.schedules.Schedule` named
``"helix"`` or ``"spipe"`` is built here, from the block count as well, and not through the registry
(``Schedule.build`` refuses them, naming this function). The strategy reads it in
``strategies/split_step.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .costs import ActionCosts
from .families.helix import helix, helix_stage_costs
from .families.spipe import spipe
from .ir import Program
from .registry import Schedule
from .validate import validate

__all__ = [
    "HELIX_PRE_SHARE", "SPLIT_PLACEMENT_FAMILIES", "check_split_options", "is_split_placement", "refuse_split_placement",
    "split_program", "split_share_costs",
]

#: HelixPipe's pre-attention share of a block's time outside the attention core (post-attention: the
#: rest): the paper's Table 1 counts 6bsh^2 FLOPs for the QKV projection against 2bsh^2 + 16bsh^2 for the
#: output projection and the MLP (and 3h^2 parameters against 9h^2), so a quarter.
HELIX_PRE_SHARE = 0.25

#: Family names whose programs place one stage on several ranks, with the options each accepts.
SPLIT_PLACEMENT_FAMILIES: Mapping[str, tuple[str, ...]] = {
    "helix": ("folds", "recompute"),
    "spipe": ("stages_per_rank", "backward_split", "decoupled"),
}


def is_split_placement(schedule: Any) -> bool:
    """Whether ``schedule`` (a :class:`Schedule` or a name) is HelixPipe or SPipe."""
    name = schedule.name if isinstance(schedule, Schedule) else schedule
    return isinstance(name, str) and name.lower() in SPLIT_PLACEMENT_FAMILIES


def refuse_split_placement(program: Program, who: str) -> None:
    """For planners that price stages placed whole on one rank: refuse a split-placement program.

    Raises:
        ValueError: ``program`` places a stage's actions on several ranks (``Program.pair_ranks``).
    """
    if program.pair_ranks is not None:
        raise ValueError(
            f"{who} prices stages placed whole on one rank; program {program.name!r} places a stage's actions on "
            "several ranks (split placement: HelixPipe, SPipe), which it does not model. Compare split placement "
            "with `schedules.simulate` or `auto_schedule(..., num_blocks=...)`."
        )


def check_split_options(name: str, options: Mapping[str, Any]) -> None:
    """Refuse options the family does not take (before any model is seen).

    Raises:
        ValueError: naming the unknown options and the valid ones.
    """
    valid = SPLIT_PLACEMENT_FAMILIES[name]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"schedule {name!r} takes the options {list(valid)}, got unknown {unknown}")


def split_program(schedule: Schedule, num_ranks: int, num_microbatches: int, num_blocks: int) -> Program:
    """The validated program of a split-placement ``schedule`` for a model of ``num_blocks`` blocks.

    Args:
        schedule: ``Schedule("helix", options={"folds": 2, "recompute": True})`` or
            ``Schedule("spipe", options={"stages_per_rank": 2, "backward_split": 2, "decoupled": True})``.
        num_ranks: pipeline ranks.
        num_microbatches: microbatches per step.
        num_blocks: the model's blocks ``L``.

    Returns:
        The program: ``2L + 1`` stages for helix, ``ranks x stages_per_rank x backward_split`` for spipe.

    Raises:
        ValueError: sizes that do not fit, naming what to change.
    """
    options = dict(schedule.options)
    check_split_options(schedule.name, options)
    if schedule.name == "helix":
        if num_blocks % num_ranks:
            raise ValueError(
                f"schedule 'helix' places block l's units on rank l mod p and needs a block count that is a multiple "
                f"of the pipeline ranks: {num_blocks} blocks on {num_ranks} ranks. Change `pipeline_parallel_size`."
            )
        folds = int(options.get("folds", 2))
        if num_microbatches % (num_ranks * folds):
            raise ValueError(
                f"schedule 'helix' runs microbatches in loops of ranks x folds = {num_ranks * folds}; "
                f"`num_microbatches={num_microbatches}` is not a multiple. Change `num_microbatches` or the `folds` option."
            )
        return validate(
            helix(num_ranks, num_microbatches, layers_per_rank=num_blocks // num_ranks, folds=folds,
                  recompute=bool(options.get("recompute", True)))
        )
    stages_per_rank = int(options.get("stages_per_rank", 2))
    backward_split = int(options.get("backward_split", 2))
    num_stages = num_ranks * stages_per_rank * backward_split
    if num_blocks % num_stages:
        raise ValueError(
            f"schedule 'spipe' cuts the model into ranks x stages_per_rank x backward_split = {num_ranks} x "
            f"{stages_per_rank} x {backward_split} = {num_stages} stages of equal block counts; {num_blocks} blocks do "
            "not divide. Change the `stages_per_rank` or `backward_split` option or `pipeline_parallel_size`."
        )
    return validate(
        spipe(num_ranks, num_microbatches, stages_per_rank=stages_per_rank, backward_split=backward_split,
              decoupled=bool(options.get("decoupled", True)))
    )


def split_share_costs(program: Program, num_ranks: int, attention_share: float = 0.25) -> ActionCosts:
    """Uniform costs of a split-placement program where one rank's share of the model takes 1 (forward) and
    2 (backward), as ``gallery.uniform_share_costs`` charges the other families.

    HelixPipe: a block's forward is split ``attention_share`` (attention core), the rest between
    pre-attention and post-attention as :data:`HELIX_PRE_SHARE` says; every backward is twice its forward.
    SPipe: every finer stage's forward is its share, its backward (with its recomputation) twice that.
    A ``RECOMPUTE`` costs its stage's forward (``ActionCosts`` default).
    """
    m, num_stages = program.num_microbatches, program.num_stages
    if num_stages % 2 and program.name.startswith("helix"):
        layers = (num_stages - 1) // 2
        share = num_ranks / layers  # one block's part of a rank's share
        rest = 1.0 - attention_share
        pre, post = HELIX_PRE_SHARE * rest, (1.0 - HELIX_PRE_SHARE) * rest
        forward = [share * t for t in helix_stage_costs(num_ranks, layers // num_ranks, pre, attention_share, post)]
    else:
        forward = [num_ranks / num_stages] * num_stages
    return ActionCosts(
        forward=tuple(tuple(t for _ in range(m)) for t in forward),
        backward=tuple(tuple(2 * t for _ in range(m)) for t in forward),
        saved_bytes=tuple(tuple(t for _ in range(m)) for t in forward),
    )
