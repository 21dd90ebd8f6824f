"""FlexPipe's published configuration table (ATC'25, Table 2) and the estimators that reproduce it.

Table 2 gives, for BERT96 on 8 GPUs and GPT-3.35B on 16 GPUs (80 GB each), the maximum sequence
length ``mu`` of sampled iterations, the aggregate peak memory ``M_peak`` (GB), the chosen layout
(data-parallel width per stage) and the memory plan ``O_plan = (r, s)`` (GB recomputed, offloaded).
Rows are in the table's order and fed to the planner in that order (each row's layout is the next
row's current layout), which is what makes the two GPT rows at ``mu = 2560`` differ (hysteresis).

:func:`table2_estimator` builds the paper's aggregate model
(:class:`~lightning_pipe.planning.depth_estimators.AggregateDepthEstimator`) for a row. What the
paper does not give was chosen as follows (docs/repartitioning.md, section 7): global batch 32
sequences of ``mu`` tokens in 4 microbatches (Fig. 8's ``mu = 2048`` column equals Fig. 9's batch
32), A100 bf16 at 50% of 312 TFLOP/s with the standard ``3 x (24 h^2 T + 4 h mu T)`` FLOPs per block,
NVLink 300 GB/s, a 0.95 s reconfiguration overhead (Sec. 7.2, adding stages to GPT-3.35B), 16
bytes of parameter, gradient and Adam state per parameter, one third of a plan offloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe.planning.depth_estimators import AggregateDepthEstimator

GB = 1e9


@dataclass(frozen=True)
class PaperModel:
    """One of Table 2's models.

    Attributes:
        name: ``"BERT96"`` or ``"GPT-3.35B"``.
        num_blocks: transformer layers.
        hidden: model width.
        num_parameters: parameters.
        num_devices: GPUs it trains on.
    """

    name: str
    num_blocks: int
    hidden: int
    num_parameters: float
    num_devices: int


@dataclass(frozen=True)
class Table2Row:
    """One row of Table 2.

    Attributes:
        model: the model.
        max_length: ``mu``, tokens.
        widths: the published layout (data-parallel width per stage).
        peak_gb: ``M_peak``, GB.
        plan_gb: ``O_plan`` as ``(r, s)``, GB.
    """

    model: PaperModel
    max_length: int
    widths: tuple[int, ...]
    peak_gb: float
    plan_gb: tuple[float, float]


BERT96 = PaperModel("BERT96", 96, 1024, 1.36e9, 8)
GPT_3_35B = PaperModel("GPT-3.35B", 16, 4096, 3.35e9, 16)

TABLE_2 = (
    Table2Row(BERT96, 512, (4, 4), 140, (0, 0)),
    Table2Row(BERT96, 1024, (4, 4), 175, (10, 5)),
    Table2Row(BERT96, 2048, (3, 3, 2), 238, (0, 0)),
    Table2Row(BERT96, 4096, (2, 2, 2, 2), 352, (20, 12)),
    Table2Row(BERT96, 8192, (1, 1, 2, 1, 1, 1, 1), 596, (18, 18)),
    Table2Row(GPT_3_35B, 512, (8, 8), 185, (15, 10)),
    Table2Row(GPT_3_35B, 2048, (4, 4, 4, 4), 315, (0, 0)),
    Table2Row(GPT_3_35B, 2560, (4, 4, 4, 4), 358, (25, 13)),
    Table2Row(GPT_3_35B, 3072, (3, 3, 3, 4, 3), 397, (0, 0)),
    Table2Row(GPT_3_35B, 2560, (3, 3, 3, 4, 3), 358, (0, 0)),
)

DEVICE_MEMORY = 80 * GB
BATCH_SEQUENCES = 32
NUM_MICROBATCHES = 4
DEVICE_FLOPS = 312e12 * 0.5
NVLINK_BYTES_PER_SECOND = 300e9
RECONFIGURATION_SECONDS = 0.95


def table2_estimator(model: PaperModel, max_length: int, peak_gb: float, **overrides: float) -> AggregateDepthEstimator:
    """The aggregate estimator of one Table 2 row (choices in the module docstring).

    Args:
        model: BERT96 or GPT-3.35B.
        max_length: ``mu``.
        peak_gb: ``M_peak`` in GB.
        overrides: fields of :class:`AggregateDepthEstimator` to change.
    """
    h = float(model.hidden)
    tokens = BATCH_SEQUENCES * max_length / NUM_MICROBATCHES  # per microbatch
    block_flops = 3.0 * (24.0 * h * h * tokens + 4.0 * h * max_length * tokens)
    block_parameters = 12.0 * h * h
    options = {
        "num_blocks": model.num_blocks,
        "num_devices": model.num_devices,
        "device_memory": DEVICE_MEMORY,
        "batch_peak_memory": peak_gb * GB,
        "block_seconds": block_flops / DEVICE_FLOPS,
        "num_microbatches": NUM_MICROBATCHES,
        "block_gradient_bytes": 2.0 * block_parameters,
        "block_state_bytes": 14.0 * block_parameters,
        "boundary_seconds": 2.0 * h * tokens / NVLINK_BYTES_PER_SECOND,
        "bandwidth": NVLINK_BYTES_PER_SECOND,
        "reconfiguration_overhead": RECONFIGURATION_SECONDS,
        "static_bytes": 16.0 * model.num_parameters,
    }
    options.update(overrides)
    return AggregateDepthEstimator(**options)
