"""Turn the strategy's ``partition`` argument into stage boundaries over blocks."""

from __future__ import annotations

from torch import nn

from lightning_pipe.model.units import UnitLayout


def uniform_partition(num_blocks: int, num_stages: int) -> list[int]:
    """Boundaries giving every stage ``num_blocks // num_stages`` blocks, earlier stages one more."""
    base, extra = divmod(num_blocks, num_stages)
    boundaries = [0]
    for stage in range(num_stages):
        boundaries.append(boundaries[-1] + base + (1 if stage < extra else 0))
    return boundaries


def balanced_partition(unit_weights: list[int], num_stages: int) -> list[int]:
    """Block boundaries minimizing the heaviest stage (pre counted on the first, post on the last).

    Exact dynamic program over contiguous splits; ties go to the most uniform split.
    """
    pre, blocks, post = unit_weights[0], unit_weights[1:-1], unit_weights[-1]
    n = len(blocks)
    prefix = [0]
    for w in blocks:
        prefix.append(prefix[-1] + w)

    def weight(stage: int, start: int, end: int) -> int:
        extra = (pre if stage == 0 else 0) + (post if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    # best[k][i]: (heaviest stage, spread) for blocks[:i] in k stages; choice[k][i]: start of stage k-1
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                w = weight(k - 1, j, i)
                candidate = (max(best[k - 1][j][0], w), best[k - 1][j][1] + (i - j - n / num_stages) ** 2)
                if candidate < best[k][i]:
                    best[k][i], choice[k][i] = candidate, j
    boundaries = [n]
    for k in range(num_stages, 0, -1):
        boundaries.append(choice[k][boundaries[-1]])
    return boundaries[::-1]


def unit_parameter_counts(module: nn.Module, layout: UnitLayout) -> list[int]:
    """Number of parameter elements of every unit (pre, blocks..., post)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return [sum(params[n].numel() for n in names if n in params) for names in layout.unit_names]


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
    return tuple(balanced_partition(counts, num_stages))
