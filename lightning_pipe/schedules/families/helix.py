"""HelixPipe (Zhang et al.): attention-parallel partition and (two-fold) first-in-last-out schedule.

Every transformer layer is cut at its attention into pre-attention (norm, QKV), the parameter-free
attention core and post-attention (output projection, MLP). The program's global stages follow one
microbatch through the model: stage ``2l`` is *unit* ``l`` (post-attention of layer ``l - 1`` fused with
pre-attention of layer ``l``; stage 0 is pre-attention of layer 0 and stage ``2L`` post-attention of the
last layer with the loss), stage ``2l + 1`` is the attention of layer ``l``. Placement (the paper's helix,
``Program.pair_ranks``):

* unit ``l`` on rank ``l mod p`` (so the embedding and the head both sit on rank 0; ``L % p == 0``);
* the attention of layer ``l`` for microbatch ``i`` on rank ``(l + d + 1) mod p``, where ``d`` is the
  microbatch's data offset in its loop of ``p * folds`` microbatches (the folds of one offset share it).

Order (FILO): every rank runs all its forwards, then all its backwards in the reverse order. The
forwards of a rank are ordered by their start in the ideal helix timeline, where a loop's microbatches
run unit ``l`` back to back and then their attentions in parallel on ``p`` ranks, and consecutive loops
chain as if the model had ``loops * L`` layers (post-attention of the last layer of loop ``c`` right
before pre-attention of layer 0 of loop ``c + 1``). With ``recompute=True`` every unit's backward is
preceded by its ``RECOMPUTE``: HelixPipe's recomputation without attention (attention keeps its
activations, units keep only their inputs).

The paper's bubble per stage (Table 2), which the simulator reproduces for fold pairs that run as one
(two-fold = naive FILO on microbatches of twice the cost): ``3(p-1)(t_pre+t_post)`` (naive),
``6(p-1)(...)`` (two-fold), ``8(p-1)(...)`` (two-fold with recomputation). Run on real ranks by
``runtime/split_executor.py`` (``runtime/helix.py``), not by the strategy (``check_executable``
refuses split placement there).
"""

from __future__ import annotations

import math

from ..ir import Action, ActionType, B, F, Program
from ..split_placement import build_split_program
from ._common import check_sizes

__all__ = ["helix", "helix_stage_costs"]

_T_UNIT, _T_ATTN = 1.0, math.sqrt(2.0)  # generic ratio: the helix order does not depend on it


def _offsets(num_ranks: int, folds: int, microbatch: int) -> tuple[int, int, int]:
    """``(loop, data offset, fold)`` of a microbatch."""
    loop, within = divmod(microbatch, num_ranks * folds)
    offset, fold = divmod(within, folds)
    return loop, offset, fold


def helix(
    num_ranks: int,
    num_microbatches: int,
    *,
    layers_per_rank: int = 1,
    folds: int = 2,
    recompute: bool = True,
    recompute_in_backward: bool = False,
) -> Program:
    """Build the HelixPipe program.

    Args:
        num_ranks: pipeline ranks ``p``.
        num_microbatches: microbatches per step ``m``; a multiple of ``p * folds``.
        layers_per_rank: transformer layers per rank (``L = p * layers_per_rank``).
        folds: microbatches that advance together (1: naive FILO, 2: the paper's two-fold).
        recompute: recomputation without attention (a ``RECOMPUTE`` before every unit's backward).
        recompute_in_backward: with ``recompute``, emit no ``RECOMPUTE`` action: the units' backward
            includes it (the costs must charge it, as the paper's formulas do). A separate action may
            run before the gradient arrives, which hides part of it.

    Returns:
        The program (``2L + 1`` stages, split placement, communication included).

    Raises:
        ValueError: for sizes that do not fit.
    """
    check_sizes("helix", num_ranks, num_microbatches)
    for argument, value in (("layers_per_rank", layers_per_rank), ("folds", folds)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"helix: {argument} must be a positive integer, got {argument}={value!r}")
    if num_microbatches % (num_ranks * folds):
        raise ValueError(
            f"helix: num_microbatches={num_microbatches} must be a multiple of num_ranks * folds = "
            f"{num_ranks * folds} (FILO admits p * folds microbatches per loop)"
        )
    p, f, m = num_ranks, folds, num_microbatches
    layers = p * layers_per_rank
    num_stages = 2 * layers + 1
    period = f * (_T_UNIT + _T_ATTN)
    pair_ranks: list[tuple[tuple[int, int], ...]] = []
    owner: list[int] = []
    for stage in range(num_stages):
        layer, is_attention = divmod(stage, 2)
        if is_attention:
            row = tuple(((layer + _offsets(p, f, mb)[1] + 1) % p,) * 2 for mb in range(m))
            owner.append((layer + 1) % p)
        else:
            row = tuple((layer % p, layer % p) for _ in range(m))
            owner.append(layer % p)
        pair_ranks.append(row)  # type: ignore[arg-type]
    keyed: list[list[tuple[tuple[float, int], Action]]] = [[] for _ in range(p)]
    for mb in range(m):
        loop, offset, fold = _offsets(p, f, mb)
        for stage in range(num_stages):
            layer, is_attention = divmod(stage, 2)
            virtual = loop * layers + layer
            if is_attention:
                start = virtual * period + (offset + 1) * f * _T_UNIT + fold * _T_ATTN
            else:
                start = virtual * period + (offset * f + fold) * _T_UNIT
            # post-attention of the last layer runs right before the next loop's pre-attention
            keyed[pair_ranks[stage][mb][0]].append(((start, 0 if stage == num_stages - 1 else 1), F(stage, mb)))
    orders = []
    for rank in range(p):
        forwards = [action for _, action in sorted(keyed[rank])]
        backwards: list[Action] = []
        for action in reversed(forwards):
            if recompute and not recompute_in_backward and action.stage % 2 == 0:
                backwards.append(Action(action.stage, ActionType.RECOMPUTE, action.microbatch))
            backwards.append(B(action.stage, action.microbatch))
        orders.append(forwards + backwards)
    pair_table = tuple(pair_ranks)
    name = f"helix(folds={f}{', recompute' if recompute else ''})"
    return build_split_program(name, m, tuple(owner), pair_table, orders)


def helix_stage_costs(num_ranks: int, layers_per_rank: int, t_pre: float, t_attn: float, t_post: float) -> list[float]:
    """Forward time of every helix stage from per-layer part times: ``t_pre`` for stage 0, ``t_post``
    for the last, ``t_post + t_pre`` for the other units and ``t_attn`` for attention stages."""
    layers = num_ranks * layers_per_rank
    costs = []
    for stage in range(2 * layers + 1):
        if stage % 2:
            costs.append(t_attn)
        elif stage == 0:
            costs.append(t_pre)
        elif stage == 2 * layers:
            costs.append(t_post)
        else:
            costs.append(t_pre + t_post)
    return costs
