"""Turn the strategy's ``partition`` argument into stage boundaries over blocks."""

from __future__ import annotations

from torch import nn

from lightning_pipe.model.units import UnitLayout
from lightning_pipe.planning.memory_model import format_size
from lightning_pipe.planning.boundaries import balanced_partition, uniform_partition


def unit_parameter_counts(module: nn.Module, layout: UnitLayout, in_bytes: bool = False) -> list[int]:
    """Number of parameter elements (or bytes) of every unit (pre, blocks..., post)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    size = (lambda p: p.numel() * p.element_size()) if in_bytes else (lambda p: p.numel())
    return [sum(size(params[n]) for n in names if n in params) for names in layout.unit_names]


def initial_partition(spec: str | list[int], module: nn.Module, layout: UnitLayout, num_stages: int) -> tuple[int, ...]:
    """Block boundaries ``[0, ..., num_blocks]`` for ``partition=spec``.

    Raises:
        ValueError: more stages than blocks, or an explicit list that does not fit the model.
    """
    num_blocks = layout.num_blocks
    if num_stages > num_blocks:
        raise ValueError(
            f"The pipeline has {num_stages} stages but `{layout.stack.path}` has only {num_blocks} blocks: every "
            "stage needs at least one block. Lower `pipeline_parallel_size` (or the schedule's stages per rank)."
        )
    if isinstance(spec, (list, tuple)):
        if len(spec) != num_stages or any(n < 1 for n in spec) or sum(spec) != num_blocks:
            raise ValueError(
                f"`partition={list(spec)}` must list the number of blocks of each of the {num_stages} stages, "
                f"each at least 1, summing to {num_blocks}."
            )
        boundaries = [0]
        for count in spec:
            boundaries.append(boundaries[-1] + count)
        return tuple(boundaries)
    if spec == "uniform":
        return tuple(uniform_partition(num_blocks, num_stages))
    counts = unit_parameter_counts(module, layout)
    return tuple(balanced_partition(counts[1:-1], num_stages, first_weight=counts[0], last_weight=counts[-1]))


def check_budget_holds_stages(module: nn.Module, layout: UnitLayout, boundaries: tuple[int, ...], budget: int) -> None:
    """Refuse a memory budget that cannot hold some stage's parameters and their gradients.

    That is a lower bound on any plan's peak (optimizer state and activations come on top, and no
    recompute or activation offload lowers it), so it can be checked before any process starts.

    Raises:
        ValueError: naming the stage, what it needs, and what to change.
    """
    unit_bytes = unit_parameter_counts(module, layout, in_bytes=True)
    last = len(boundaries) - 2
    for stage in range(last + 1):
        first_unit = 0 if stage == 0 else boundaries[stage] + 1
        end_unit = layout.num_units if stage == last else boundaries[stage + 1] + 1
        needed = 2 * sum(unit_bytes[first_unit:end_unit])
        if needed > budget:
            raise ValueError(
                f"`memory_budget={format_size(budget)}` cannot fit: stage {stage} (blocks {boundaries[stage]}.."
                f"{boundaries[stage + 1] - 1}) alone needs {format_size(needed)} for its parameters and gradients, "
                "before optimizer state and activations. Raise `memory_budget`, or use more pipeline stages."
            )
