"""When to repartition: migrate only when the predicted gain pays for the migration, with margin.

The planner proposes, for the coming batch, the best partition (the *candidate*). Moving to it costs
a migration (seconds, :mod:`.migration`) once; it gains ``current - candidate`` seconds on every step
for as long as batches look alike. :func:`decide_repartition` estimates that gain over a horizon of
``horizon_steps`` steps:

- steps whose batch is already known (the lookahead, ``coming``) count with their own predictions;
- the rest of the horizon is extrapolated with the mean gain the candidate would have had on the
  ``recent`` steps (both partitions evaluated on the batches just trained), because batches are
  drawn from the same distribution and the recent past is the best forecast of the next steps.

It migrates when ``gain > migration_seconds * (1 + margin)``. The recent window is what keeps the
trigger from oscillating: a batch that favours another partition only when it is unusual (one long
batch among short ones) raises the gain of one step, not of the whole horizon. Without a recent
window the coming steps' mean is extrapolated instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

TRIGGER_MODES = ("auto", "always", "interval", "never")


@dataclass(frozen=True)
class TriggerConfig:
    """How the repartition trigger decides.

    Attributes:
        mode: ``"auto"`` (gain against migration cost), ``"always"`` (every step the candidate
            differs; for tests), ``"interval"`` (every ``interval`` steps when it differs) or
            ``"never"`` (static partition, except when memory forces a change).
        margin: in ``"auto"``, the gain must exceed the migration seconds by this fraction.
        horizon_steps: in ``"auto"``, the number of steps a gain is assumed to last.
        interval: in ``"interval"``, steps between migrations.
    """

    mode: str = "auto"
    margin: float = 0.25
    horizon_steps: int = 16
    interval: int = 50

    def __post_init__(self) -> None:
        if self.mode not in TRIGGER_MODES:
            raise ValueError(f"`mode` must be one of {', '.join(TRIGGER_MODES)}, got {self.mode!r}.")
        if self.margin < 0:
            raise ValueError(f"`margin` must be >= 0, got {self.margin}.")
        if self.horizon_steps < 1:
            raise ValueError(f"`horizon_steps` must be >= 1, got {self.horizon_steps}.")
        if self.interval < 1:
            raise ValueError(f"`interval` must be >= 1, got {self.interval}.")


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of one step under the partition in use and under the candidate.

    Attributes:
        current_seconds: step seconds with the partition in use.
        candidate_seconds: step seconds with the candidate partition.
    """

    current_seconds: float
    candidate_seconds: float

    @property
    def gain(self) -> float:
        """Seconds the candidate saves on this step (negative when it is slower)."""
        return self.current_seconds - self.candidate_seconds


@dataclass(frozen=True)
class TriggerDecision:
    """Whether to migrate, and why.

    Attributes:
        migrate: True to move to the candidate partition before the coming step.
        reason: one line for logs.
        predicted_gain_seconds: gain over the horizon (``"auto"``), else the coming steps' gain.
        migration_seconds: the migration cost the decision used.
    """

    migrate: bool
    reason: str
    predicted_gain_seconds: float
    migration_seconds: float


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def predicted_gain(coming: Sequence[StepPrediction], recent: Sequence[StepPrediction], horizon_steps: int) -> float:
    """Seconds the candidate saves over ``horizon_steps`` steps (see the module docstring)."""
    known = [p.gain for p in coming[:horizon_steps]]
    forecast = _mean([p.gain for p in recent]) if recent else _mean(known)
    return sum(known) + (horizon_steps - len(known)) * forecast


def decide_repartition(
    config: TriggerConfig,
    step: int,
    migration_seconds: float,
    coming: Sequence[StepPrediction],
    recent: Sequence[StepPrediction] = (),
    *,
    candidate_differs: bool = True,
    current_fits: bool = True,
) -> TriggerDecision:
    """Decide whether to migrate to the candidate partition before the coming step.

    Pure: the same inputs give the same decision on every rank.

    Args:
        config: the trigger settings.
        step: index of the coming optimizer step (used by ``"interval"``).
        migration_seconds: predicted (calibrated) seconds of the migration.
        coming: predictions for the steps whose batches are known, the coming step first.
        recent: predictions of both partitions on the batches of the last steps.
        candidate_differs: False when the candidate equals the partition in use.
        current_fits: False when the partition in use would exceed memory on the coming step; the
            migration is then forced whatever the mode.

    Returns:
        The :class:`TriggerDecision`.

    Raises:
        ValueError: if ``coming`` is empty or ``migration_seconds`` is negative.
    """
    if not coming:
        raise ValueError("`coming` is empty: pass the prediction of at least the coming step.")
    if migration_seconds < 0:
        raise ValueError(f"`migration_seconds` must be >= 0, got {migration_seconds}.")
    next_gain = sum(p.gain for p in coming)

    def decision(migrate: bool, reason: str, gain: float = next_gain) -> TriggerDecision:
        return TriggerDecision(migrate, reason, gain, migration_seconds)

    if not candidate_differs:
        return decision(False, "the best partition is the one in use")
    if not current_fits:
        return decision(True, "the partition in use does not fit memory for the coming step")
    if config.mode == "never":
        return decision(False, "mode 'never'")
    if config.mode == "always":
        return decision(True, "mode 'always'")
    if config.mode == "interval":
        due = step % config.interval == 0
        return decision(
            due, f"mode 'interval': step {step} {'is' if due else 'is not'} a multiple of {config.interval}"
        )
    gain = predicted_gain(coming, recent, config.horizon_steps)
    needed = migration_seconds * (1.0 + config.margin)
    if gain > needed and gain > 0:
        return decision(True, f"gain {gain:.4g} s over {config.horizon_steps} steps > cost {needed:.4g} s", gain)
    return decision(False, f"gain {gain:.4g} s over {config.horizon_steps} steps <= cost {needed:.4g} s", gain)


@dataclass
class ResidenceHorizon:
    """Steps a reconfiguration is paid over: at most ``limit``, and no more than layouts have lasted.

    Charging a reconfiguration over ``limit`` steps assumes the new layout stays that long. When
    batches alternate (a short one, then a long one), each switch lasts one step and the planner,
    still dividing by ``limit``, pays a full reconfiguration every step for a gain of one: it
    thrashes and ends slower than never switching. The horizon used is therefore the mean length of
    the recent runs of one layout, the run in progress counted at its length so far (it grows back to
    ``limit`` while a layout holds). Plain data: checkpointed by its owner.

    Attributes:
        limit: the longest horizon (the planner's setting).
        recent: how many finished runs the mean looks at.
        runs: lengths of the finished runs, oldest first.
        current: steps of the run in progress.
    """

    limit: float
    recent: int = 8
    runs: list[int] = field(default_factory=list)
    current: int = 0

    def steps(self) -> float:
        """The horizon for the next decision (``limit`` before any switch)."""
        if not self.runs:
            return float(self.limit)
        lengths = [*self.runs[-self.recent :], self.current]
        return float(min(self.limit, max(1.0, sum(lengths) / len(lengths))))

    def record(self, switched: bool) -> None:
        """One step ran; ``switched``: on a layout other than the step before's."""
        if switched and self.current:
            self.runs = [*self.runs[-(self.recent - 1) :], self.current]
            self.current = 0
        self.current += 1
