"""What the split-placement programs (HelixPipe, SPipe) cost, from a per-unit cost model.

The joint planner prices families whose stages are ranges of blocks with ``CostModel.stage_costs``.
Split placement cuts the model differently, so its action costs are derived here, per microbatch
shape, from the same per-unit costs:

* **spipe**: ``ranks x stages_per_rank x backward_split`` stages of equal block counts (the only cut
  ``split_program`` accepts), costed as any partition, plus each stage's input as the checkpoint its
  backward rank recomputes from (SPipe sends it ahead).
* **helix**: ``2L + 1`` stages, each block cut at its attention. A block's forward (and backward) cost is
  ``constant + per_token x tokens + per_squared_length x sum of squared lengths``; the quadratic term is
  the attention core (it is what grows with a sequence's length squared), the rest is split between
  pre-attention and post-attention by the paper's Table 1 (``HELIX_PRE_SHARE``: a quarter, the QKV
  projection; three quarters, the output projection and the MLP). Parameters follow the same quarter;
  saved activations follow Table 1's elements per token (pre-attention 2, attention 3, post-attention 11
  of 16). Messages: pre-attention to attention carries Q, K, V and the residual (4 hidden states per
  token), attention to post-attention the output and the residual (2), as ``runtime/helix.py`` sends
  them (grouped-query attention sends less: priced high). With recomputation (the default) a unit
  keeps its input (2 hidden states per token) until its ``RECOMPUTE``; attention is never recomputed.

A cost model fitted to one sequence length cannot separate the quadratic term from the rest: helix
is then priced with attention costing nothing, which flatters it; fit the model on several lengths
(``StrategyCosts`` measures more than one) before trusting a helix choice.

Pure: ``schedules`` and numpy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lightning_pipe.planning.boundaries import uniform_partition
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.schedules import ActionCosts, Schedule
from lightning_pipe.schedules.ir import Program
from lightning_pipe.schedules.split_schedules import HELIX_PRE_SHARE

__all__ = ["HELIX_SAVED_SHARES", "split_placement_costs"]

#: Shares of a block's saved activations (per token) kept by pre-attention, the attention core and
#: post-attention: HelixPipe's Table 1 counts 2, 3 and 11 of 16 elements of ``bsh``.
HELIX_SAVED_SHARES = (2 / 16, 3 / 16, 11 / 16)

Table = tuple[tuple[float, ...], ...]


def split_placement_costs(
    cost_model: CostModel, schedule: Schedule, program: Program, microbatches: Sequence[MicrobatchShape]
) -> ActionCosts:
    """Action costs of ``program`` (built by ``split_program`` for ``schedule`` and the model's blocks) for
    microbatches of ``microbatches``' shapes, for :func:`~lightning_pipe.schedules.simulate`.

    Raises:
        ValueError: ``schedule`` is not a split-placement family, or the program's stages do not match
            the model's blocks.
    """
    if schedule.name == "spipe":
        return _spipe_costs(cost_model, program, microbatches)
    if schedule.name == "helix":
        return _helix_costs(cost_model, program, microbatches)
    raise ValueError(f"split_placement_costs prices 'helix' and 'spipe', got {schedule.name!r}.")


def _spipe_costs(cost_model: CostModel, program: Program, microbatches: Sequence[MicrobatchShape]) -> ActionCosts:
    if cost_model.num_blocks % program.num_stages:
        raise ValueError(f"spipe's {program.num_stages} stages do not divide the cost model's {cost_model.num_blocks} blocks.")
    costs = cost_model.stage_costs(uniform_partition(cost_model.num_blocks, program.num_stages), microbatches)
    assert costs.activation_bytes is not None
    zero = tuple(0.0 for _ in microbatches)
    # a stage's checkpoint is what the stage before sent it
    return dataclasses.replace(costs, checkpoint_bytes=(zero, *costs.activation_bytes[:-1]))


def _helix_costs(cost_model: CostModel, program: Program, microbatches: Sequence[MicrobatchShape]) -> ActionCosts:
    num_blocks = cost_model.num_blocks
    if program.num_stages != 2 * num_blocks + 1:
        raise ValueError(f"helix's {program.num_stages} stages are not 2L + 1 for the cost model's {num_blocks} blocks.")
    tables = cost_model.tables(microbatches)
    squares = np.array([mb.sum_squared_lengths for mb in microbatches])
    blocks = cost_model.units[1:-1]

    def parts(total: np.ndarray, quadratic: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A block's (pre, attention, post) share of one per-microbatch row."""
        rest = total - quadratic
        return HELIX_PRE_SHARE * rest, quadratic, (1.0 - HELIX_PRE_SHARE) * rest

    forward = [parts(tables.forward[1 + b], blocks[b].forward.per_squared_length * squares) for b in range(num_blocks)]
    backward = [parts(tables.backward[1 + b], blocks[b].backward.per_squared_length * squares) for b in range(num_blocks)]
    saved = []
    for b in range(num_blocks):
        quadratic = blocks[b].saved_bytes.per_squared_length * squares  # attention scores without flash attention
        linear = tables.saved_bytes[1 + b] - quadratic
        pre, core, post = HELIX_SAVED_SHARES
        saved.append((pre * linear, core * linear + quadratic, post * linear))
    hidden = [tables.output_bytes[1 + b] for b in range(num_blocks)]  # one hidden state per token, in bytes
    zero = np.zeros(len(microbatches))
    rows: dict[str, list[np.ndarray]] = {"forward": [], "backward": [], "saved": [], "sent": [], "checkpoint": []}
    static = []
    for stage in range(program.num_stages):
        layer, is_attention = divmod(stage, 2)
        if is_attention:
            rows["forward"].append(forward[layer][1])
            rows["backward"].append(backward[layer][1])
            rows["saved"].append(saved[layer][1])
            rows["sent"].append(2 * hidden[layer])  # the attention output and the residual
            rows["checkpoint"].append(zero)
            static.append(0.0)
            continue
        # unit stage: post-attention of block layer - 1 (or the model's pre unit) and pre-attention of
        # block layer (or the model's post unit)
        fwd, bwd, keep, params = zero.copy(), zero.copy(), zero.copy(), 0.0
        if layer > 0:
            fwd, bwd, keep = fwd + forward[layer - 1][2], bwd + backward[layer - 1][2], keep + saved[layer - 1][2]
            params += (1.0 - HELIX_PRE_SHARE) * tables.static_bytes[layer]
        else:
            fwd, bwd, keep = fwd + tables.forward[0], bwd + tables.backward[0], keep + tables.saved_bytes[0]
            params += tables.static_bytes[0]
        if layer < num_blocks:
            fwd, bwd, keep = fwd + forward[layer][0], bwd + backward[layer][0], keep + saved[layer][0]
            params += HELIX_PRE_SHARE * tables.static_bytes[1 + layer]
            rows["sent"].append(4 * hidden[layer])  # Q, K, V and the residual
        else:
            fwd, bwd, keep = fwd + tables.forward[-1], bwd + tables.backward[-1], keep + tables.saved_bytes[-1]
            params += tables.static_bytes[-1]
            rows["sent"].append(zero)
        rows["forward"].append(fwd)
        rows["backward"].append(bwd)
        rows["saved"].append(keep)
        rows["checkpoint"].append(2 * hidden[layer - 1] if layer > 0 else zero)  # the unit's received input
        static.append(float(params))

    def table(name: str) -> Table:
        return tuple(tuple(float(v) for v in row) for row in rows[name])

    return ActionCosts(
        forward=table("forward"), backward=table("backward"), activation_bytes=table("sent"), saved_bytes=table("saved"),
        static_bytes=tuple(static), checkpoint_bytes=table("checkpoint"), latency=cost_model.latency,
        bandwidth=cost_model.bandwidth,
    )
