"""Elastic pipeline depth: FlexPipe's Heuristic Bound Search (HBSA, Algorithm 1) and FMOP decision.

Given one batch's estimators (:class:`DepthEstimator`: step time, memory, memory plan and
reconfiguration cost of any :class:`~lightning_pipe.planning.layout.Layout`) and the layout in use,
:func:`decide_depth` returns what the coming step should run on, choosing among FlexPipe's four
outcomes (Sec. 5.2, Eq. 7):

1. ``keep``: the current layout fits (condition A) and no candidate beats it including the
   reconfiguration (condition B);
2. ``memory_plan``: it does not fit, a memory plan (recomputation, offload) makes it fit (C), and
   that is not slower than reconfiguring (D);
3. ``grow`` / 4. ``shrink``: reconfigure to the best candidate (deeper / shallower; ``regroup`` when
   only widths and boundaries change), with its own memory plan when it needs one.

Candidates come from :func:`search_layouts`, Algorithm 1's bounded recursion: with ``N`` the fewest
stages whose aggregate memory holds the batch (lines 3-6, strict ``<``), every stage gets between
``floor(L / N)`` and ``min(floor(L / N) + L % N, n_max)`` blocks and between ``floor(D / N)`` and
``floor(D / N) + D % N`` devices (lines 9-11), blocks and devices taken as prefixes (lines 14-26);
the number of stages is not fixed by the recursion, only by the bounds. :func:`brute_force_layouts`
is the ablation "HBSA w/o BD": every layout of the same depth.

Decisions where the paper is silent (written down in docs/repartitioning.md, section 7):

- The search also runs for ``N - 1`` stages when memory plans are allowed, each candidate charged
  its memory plan's seconds. Table 2 has rows at ``N - 1`` stages with an ``O_plan`` after growing
  (BERT96 at 4096 and 8192 tokens: 4 and 7 stages where ``M_peak`` needs 5 and 8), which Algorithm 1
  as printed cannot produce (it searches only around ``N``), yet its line 37 does return an
  ``O_plan`` with a new layout.
- ``v`` starts at infinity; when ``N`` equals the current depth there is no search (line 8), so B
  holds ("keep"), unless the current layout does not fit: then depths ``N + 1, N + 2, ...`` are
  searched until a layout fits (the paper leaves this case, and ``not A and not C and D``, open).
- An estimator may define ``minimum_stages()`` (the cost-model one: the fewest stages whose
  uniform layout fits per stage); lines 3-6's aggregate count is used otherwise.
- Condition A is checked with the estimator's ``fits`` (per stage for the cost-model estimator,
  the paper's aggregate ``M_peak <= M |S|`` for :class:`AggregateDepthEstimator`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from lightning_pipe.planning.layout import Layout

DEPTH_ACTIONS = ("keep", "memory_plan", "grow", "shrink", "regroup")


@dataclass(frozen=True)
class MemoryPlanCost:
    """A memory plan (FlexPipe's ``O_plan``) for one layout and batch, and what it costs.

    Attributes:
        recompute_bytes: activation bytes recomputed instead of kept (``r``).
        offload_bytes: bytes offloaded to host memory (``s``).
        seconds: extra seconds per step (recomputation plus transfers not hidden).
        recompute_stages: stages whose activations are recomputed (empty for aggregate models).
    """

    recompute_bytes: float = 0.0
    offload_bytes: float = 0.0
    seconds: float = 0.0
    recompute_stages: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        """True when the plan changes nothing."""
        return self.recompute_bytes == 0 and self.offload_bytes == 0 and not self.recompute_stages


NO_MEMORY_PLAN = MemoryPlanCost()


class DepthEstimator(Protocol):
    """Time and memory estimators of one batch, as HBSA's inputs (Algorithm 1's "estimators").

    Attributes:
        num_blocks: blocks of the model (the paper's ``|L|``).
        num_devices: devices (``|D|``).
        device_memory: bytes of one device (``M``).
    """

    num_blocks: int
    num_devices: int
    device_memory: float

    def peak_memory(self) -> float:
        """Aggregate bytes one pipeline replica needs for the batch (``M_peak(L, B, mu)``)."""

    def max_blocks_per_device(self) -> int:
        """Most blocks one device can hold (``n_max^l``)."""

    def step_seconds(self, layout: Layout) -> float:
        """Predicted step seconds of the batch on ``layout`` without a memory plan."""

    def fits(self, layout: Layout) -> bool:
        """True when the batch fits ``layout`` without a memory plan."""

    def memory_plan(self, layout: Layout) -> MemoryPlanCost | None:
        """The plan that makes the batch fit ``layout`` (:data:`NO_MEMORY_PLAN` when it fits), or None."""

    def migration_seconds(self, old: Layout, new: Layout) -> float:
        """Seconds to reconfigure from ``old`` to ``new`` (0 when equal)."""


def minimum_stages(peak_memory: float, device_memory: float, num_devices: int) -> int:
    """Algorithm 1, lines 3-6: the fewest stages ``i`` with ``peak_memory < i * device_memory``.

    Returns ``num_devices`` when no depth holds the batch (a memory plan must then close the gap).
    """
    if not device_memory > 0:
        raise ValueError(f"`device_memory` must be > 0 bytes, got {device_memory}.")
    for stages in range(1, num_devices + 1):
        if peak_memory < stages * device_memory:
            return stages
    return num_devices


@dataclass(frozen=True)
class SearchBounds:
    """Algorithm 1's bounds (lines 9-11) for ``num_stages`` stages.

    Attributes:
        num_stages: ``N_stage``.
        blocks: ``(n_low^l, n_up^l)``, blocks per stage.
        devices: ``(n_low^g, n_up^g)``, devices per stage.
    """

    num_stages: int
    blocks: tuple[int, int]
    devices: tuple[int, int]


def search_bounds(
    num_blocks: int, num_devices: int, num_stages: int, max_blocks_per_device: int, *, tight: bool = False
) -> SearchBounds:
    """The bounds of Algorithm 1 (lines 9-11).

    With ``tight``, the upper bounds are ``ceil(x / N)`` instead of ``floor(x / N) + x % N``: the
    paper's own observation ("keep |s_i| and |g_i| as consistent as possible") taken literally. The
    printed bounds grow with the remainder, and the recursion with them: 24 blocks on 16 devices in 9
    stages allows 2 to 8 blocks and 1 to 8 devices per stage, millions of layouts where ``tight``
    leaves a few thousand (docs/repartitioning.md, section 7).

    Raises:
        ValueError: if ``num_stages`` is not in ``1 .. min(num_blocks, num_devices)``.
    """
    if not 1 <= num_stages <= min(num_blocks, num_devices):
        raise ValueError(
            f"`num_stages` must be in 1..{min(num_blocks, num_devices)} (blocks and devices), got {num_stages}."
        )
    low_blocks, low_devices = num_blocks // num_stages, num_devices // num_stages
    if tight:
        up_blocks = min(-(-num_blocks // num_stages), max_blocks_per_device)
        up_devices = -(-num_devices // num_stages)
    else:
        up_blocks = min(low_blocks + num_blocks % num_stages, max_blocks_per_device)
        up_devices = low_devices + num_devices % num_stages
    return SearchBounds(num_stages, (low_blocks, up_blocks), (low_devices, up_devices))


@dataclass(frozen=True)
class SearchResult:
    """The best layout a search found.

    Attributes:
        layout: the best layout, or None when no candidate was feasible.
        value: its price (``inf`` when none).
        num_candidates: complete layouts priced.
        seconds: wall-clock seconds of the search.
        truncated: True when ``max_candidates`` stopped the search early.
    """

    layout: Layout | None
    value: float
    num_candidates: int
    seconds: float
    truncated: bool = False


def _layout(blocks: list[int], widths: list[int]) -> Layout:
    boundaries = [0]
    for count in blocks:
        boundaries.append(boundaries[-1] + count)
    return Layout(tuple(boundaries), tuple(widths))


def search_layouts(
    num_blocks: int,
    num_devices: int,
    bounds: SearchBounds,
    price: Callable[[Layout], float | None],
    max_candidates: int | None = None,
) -> SearchResult:
    """Algorithm 1's ``Search`` (lines 14-26): the bounded recursion over stage prefixes.

    Args:
        num_blocks: blocks to place (``|L|``).
        num_devices: devices to use (``|D|``).
        bounds: from :func:`search_bounds`.
        price: a layout's value (``T + T_mig``, smaller is better), or None when infeasible.
        max_candidates: stop after pricing this many layouts (None: all). Deep layouts on many
            devices reach hundreds of thousands even with tight bounds (12 stages of 32 blocks on
            16 devices: 245,025); the result then says ``truncated``.

    Returns:
        The first layout of smallest value in the recursion's order (strict ``<``, as line 24).
    """
    started = time.perf_counter()
    low_l, up_l = bounds.blocks
    low_g, up_g = bounds.devices
    best: Layout | None = None
    value = math.inf
    count = 0
    limit = math.inf if max_candidates is None else max_candidates

    def completable(rest_blocks: int, rest_devices: int) -> bool:
        # some number k of further stages holds both remainders within the bounds (else a dead end:
        # skipping it changes nothing but the time, the recursion would reach no layout from it)
        k_low = max(-(-rest_blocks // up_l), -(-rest_devices // up_g))
        k_high = min(rest_blocks // low_l, rest_devices // low_g)
        return k_low <= k_high

    def search(rest_blocks: int, rest_devices: int, blocks: list[int], widths: list[int]) -> None:
        nonlocal best, value, count
        for i in range(low_l, up_l + 1):
            for j in range(low_g, up_g + 1):
                left_l, left_g = rest_blocks - i, rest_devices - j
                if count >= limit:
                    return
                if left_l > up_l and left_g > up_g and completable(left_l, left_g):
                    search(left_l, left_g, [*blocks, i], [*widths, j])
                if low_l <= left_l <= up_l and low_g <= left_g <= up_g and count < limit:
                    candidate = _layout([*blocks, i, left_l], [*widths, j, left_g])
                    count += 1
                    cost = price(candidate)
                    if cost is not None and cost < value:
                        best, value = candidate, cost

    if low_l >= 1 and low_g >= 1:
        if bounds.num_stages == 1:  # the recursion needs two stages; one stage is the whole model
            candidate = Layout((0, num_blocks), (num_devices,))
            count, cost = 1, price(candidate)
            if cost is not None:
                best, value = candidate, cost
        else:
            search(num_blocks, num_devices, [], [])
    return SearchResult(best, value, count, time.perf_counter() - started, count >= limit)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def brute_force_layouts(
    num_blocks: int, num_devices: int, num_stages: int, price: Callable[[Layout], float | None]
) -> SearchResult:
    """Every layout of ``num_stages`` stages ("HBSA w/o BD"): all block and device compositions."""
    started = time.perf_counter()
    best: Layout | None = None
    value = math.inf
    count = 0
    device_splits = list(_compositions(num_devices, num_stages))
    for blocks in _compositions(num_blocks, num_stages):
        for widths in device_splits:
            candidate = _layout(list(blocks), list(widths))
            count += 1
            cost = price(candidate)
            if cost is not None and cost < value:
                best, value = candidate, cost
    return SearchResult(best, value, count, time.perf_counter() - started)


@dataclass(frozen=True)
class DepthDecision:
    """What FMOP decided for the coming step.

    Attributes:
        action: ``"keep"``, ``"memory_plan"``, ``"grow"``, ``"shrink"`` or ``"regroup"``.
        layout: the layout to run the step on.
        memory_plan: the plan to apply on it (:data:`NO_MEMORY_PLAN` for none).
        predicted_seconds: step seconds on ``layout`` including the memory plan and the migration
            (divided by ``migration_horizon``).
        current_seconds: step seconds on the current layout without a plan (``inf`` if it does not fit).
        migration_seconds: predicted reconfiguration seconds (0 unless the layout changes).
        min_stages: ``N_stage`` of Algorithm 1.
        num_candidates: layouts priced by the search.
        reason: one line for logs (conditions A to D).
    """

    action: str
    layout: Layout
    memory_plan: MemoryPlanCost
    predicted_seconds: float
    current_seconds: float
    migration_seconds: float
    min_stages: int
    num_candidates: int
    reason: str


def _action_for(current: Layout, new: Layout) -> str:
    if new.num_stages > current.num_stages:
        return "grow"
    if new.num_stages < current.num_stages:
        return "shrink"
    return "regroup"


def decide_depth(
    estimator: DepthEstimator,
    current: Layout,
    *,
    allow_memory_plan: bool = True,
    search: str = "hbsa",
    deeper: int = 0,
    migration_horizon: int = 1,
    max_candidates: int | None = None,
) -> DepthDecision:
    """FMOP for the coming batch: keep, memory plan, grow or shrink (Algorithm 1, lines 28-37).

    About 85 lines: Algorithm 1's decision in one piece and in the paper's order (depths to search,
    the bounded search per depth, then cases A to D), so that it reads against the paper line by
    line; its closures share the search's running best.

    Args:
        estimator: the coming batch's estimators.
        current: the layout in use (``S' Pi_G'``).
        allow_memory_plan: False for the ablation "Flex w/o M": only layouts that fit as they are.
        search: ``"hbsa"`` (Algorithm 1's bounds), ``"hbsa_tight"`` (``ceil`` upper bounds, see
            :func:`search_bounds`) or ``"brute_force"`` (every layout of the searched depths).
        deeper: also search up to ``N_stage + deeper`` stages (0 is the paper's algorithm; an
            estimator whose ``peak_memory`` is a lower bound, as the cost-model one, needs 1).

    Returns:
        The :class:`DepthDecision`.

    Raises:
        ValueError: if no layout on the estimator's devices holds the batch, even with a plan.
    """
    if search not in ("hbsa", "hbsa_tight", "brute_force"):
        raise ValueError(f"`search` must be 'hbsa', 'hbsa_tight' or 'brute_force', got {search!r}.")
    if migration_horizon < 1:
        raise ValueError(f"`migration_horizon` must be >= 1 steps, got {migration_horizon}.")
    horizon = float(migration_horizon)
    num_blocks, num_devices = estimator.num_blocks, estimator.num_devices
    if current.num_blocks != num_blocks or current.num_devices != num_devices:
        raise ValueError(f"`current` {current.describe()} does not cover {num_blocks} blocks on {num_devices} devices.")
    most = min(num_blocks, num_devices)
    exact = getattr(estimator, "minimum_stages", None)  # per-stage memory, when the estimator knows it
    needed = (
        exact() if exact is not None else minimum_stages(estimator.peak_memory(), estimator.device_memory, num_devices)
    )
    needed = min(needed, most)
    fits_now = estimator.fits(current)
    current_seconds = estimator.step_seconds(current)
    plans: dict[Layout, MemoryPlanCost] = {}

    def price(layout: Layout) -> float | None:
        if estimator.fits(layout):
            plan = NO_MEMORY_PLAN
        elif allow_memory_plan:
            found = estimator.memory_plan(layout)
            if found is None:
                return None
            plan = found
        else:
            return None
        plans[layout] = plan
        return estimator.step_seconds(layout) + plan.seconds + estimator.migration_seconds(current, layout) / horizon

    best: Layout | None = None
    value = math.inf
    count = 0

    def run(depth: int) -> None:
        nonlocal best, value, count
        if search != "brute_force":
            bounds = search_bounds(
                num_blocks, num_devices, depth, estimator.max_blocks_per_device(), tight=search == "hbsa_tight"
            )
            result = search_layouts(num_blocks, num_devices, bounds, price, max_candidates)
        else:
            result = brute_force_layouts(num_blocks, num_devices, depth, price)
        count += result.num_candidates
        if result.layout is not None and result.value < value:
            best, value = result.layout, result.value

    if needed != current.num_stages:
        run(needed)
        if allow_memory_plan and needed - 1 >= 1:
            run(needed - 1)
        for depth in range(needed + 1, min(needed + deeper, most) + 1):
            run(depth)
    if not fits_now and best is None:
        depth = max(needed, current.num_stages + 1)
        while best is None and depth <= most:
            run(depth)
            depth += 1

    def decision(action: str, layout: Layout, plan: MemoryPlanCost, seconds: float, reason: str) -> DepthDecision:
        migration = 0.0 if layout == current else estimator.migration_seconds(current, layout)
        before = current_seconds if fits_now else math.inf
        return DepthDecision(action, layout, plan, seconds, before, migration, needed, count, reason)

    if fits_now:
        if best is None or value >= current_seconds:  # A and B
            return decision("keep", current, NO_MEMORY_PLAN, current_seconds, "A and B: fits, no faster layout")
        return decision(
            _action_for(current, best),
            best,
            plans[best],
            value,
            "A and not B: a faster layout pays its reconfiguration",
        )
    plan = estimator.memory_plan(current) if allow_memory_plan else None
    planned = math.inf if plan is None else current_seconds + plan.seconds
    if plan is not None and (best is None or value >= planned):  # C and D
        return decision("memory_plan", current, plan, planned, "not A, C and D: a memory plan is cheapest")
    if best is None:
        raise ValueError(
            f"No layout of {num_blocks} blocks on {num_devices} devices holds the batch "
            f"(aggregate peak {estimator.peak_memory() / 2**30:.1f} GiB, {estimator.device_memory / 2**30:.1f} GiB "
            f"per device{'' if allow_memory_plan else ', memory plans off'}): use more devices, smaller microbatches, "
            "or allow memory plans."
        )
    reason = (
        "not A, not C: the layout in use cannot hold the batch"
        if plan is None
        else "not A, not D: reconfiguring is cheaper"
    )
    return decision(_action_for(current, best), best, plans[best], value, reason)
