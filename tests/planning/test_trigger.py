import pytest

from lightning_pipe.planning import StepPrediction, TriggerConfig, decide_repartition, predicted_gain
from lightning_pipe.planning.trigger import ResidenceHorizon


def test_auto_migrates_only_when_gain_pays_for_migration_with_margin():
    config = TriggerConfig(mode="auto", margin=0.25, horizon_steps=4)
    coming = [StepPrediction(1.0, 0.9)]  # 0.1 s per step, 0.4 s over the horizon
    assert decide_repartition(config, 0, 0.3, coming).migrate  # 0.4 > 0.375
    decision = decide_repartition(config, 0, 0.33, coming)  # 0.4 <= 0.4125
    assert not decision.migrate and "<= cost" in decision.reason
    assert decision.predicted_gain_seconds == pytest.approx(0.4)


def test_known_steps_count_as_given_and_recent_steps_forecast_the_rest():
    coming = [StepPrediction(2.0, 1.0), StepPrediction(1.0, 1.0)]
    recent = [StepPrediction(1.0, 1.1), StepPrediction(1.0, 1.1)]
    assert predicted_gain(coming, recent, horizon_steps=5) == pytest.approx(1.0 + 0.0 - 3 * 0.1)
    assert predicted_gain(coming, (), horizon_steps=5) == pytest.approx(1.0 + 3 * 0.5)


def simulate_alternating(config, recent_window, steps=60, migration_seconds=0.3):
    """Short and long batches alternate; A suits short ones, B long ones, by 0.1 s each way."""
    seconds = {("A", "short"): 1.0, ("B", "short"): 1.1, ("A", "long"): 2.0, ("B", "long"): 1.9}
    kinds = ["short" if i % 2 == 0 else "long" for i in range(steps)]
    best = {"short": "A", "long": "B"}
    current, migrations = "A", 0
    for step, kind in enumerate(kinds):
        candidate = best[kind]
        past = kinds[max(0, step - recent_window) : step] if recent_window else []
        decision = decide_repartition(
            config,
            step,
            migration_seconds,
            [StepPrediction(seconds[(current, kind)], seconds[(candidate, kind)])],
            [StepPrediction(seconds[(current, k)], seconds[(candidate, k)]) for k in past],
            candidate_differs=candidate != current,
        )
        if decision.migrate:
            current, migrations = candidate, migrations + 1
    return migrations


def test_auto_does_not_oscillate_on_alternating_batches():
    config = TriggerConfig(mode="auto", margin=0.25, horizon_steps=16)
    assert simulate_alternating(config, recent_window=4) == 0
    # What the recent window prevents: extrapolating one step's gain over the horizon flips every step.
    assert simulate_alternating(config, recent_window=0) == 59  # every step but the first


def test_auto_follows_a_lasting_shift_once():
    config = TriggerConfig(mode="auto", margin=0.25, horizon_steps=16)
    current, migrations, history = "A", 0, []
    for step in range(40):
        kind = "short" if step < 10 else "long"  # the workload changes for good at step 10
        seconds = {("A", "short"): 1.0, ("B", "short"): 1.1, ("A", "long"): 2.0, ("B", "long"): 1.9}
        candidate = "A" if kind == "short" else "B"
        recent = [StepPrediction(seconds[(current, k)], seconds[(candidate, k)]) for k in history[-4:]]
        now = StepPrediction(seconds[(current, kind)], seconds[(candidate, kind)])
        if decide_repartition(config, step, 0.3, [now], recent, candidate_differs=candidate != current).migrate:
            current, migrations = candidate, migrations + 1
        history.append(kind)
    assert (current, migrations) == ("B", 1)


def test_modes_and_forced_migration():
    coming = [StepPrediction(1.0, 1.5)]  # the candidate is slower
    assert decide_repartition(TriggerConfig(mode="always"), 3, 10.0, coming).migrate
    assert not decide_repartition(TriggerConfig(mode="never"), 3, 0.0, [StepPrediction(2.0, 1.0)]).migrate
    interval = TriggerConfig(mode="interval", interval=5)
    assert [decide_repartition(interval, s, 1.0, coming).migrate for s in range(6)] == [1, 0, 0, 0, 0, 1]
    forced = decide_repartition(TriggerConfig(mode="never"), 3, 99.0, coming, current_fits=False)
    assert forced.migrate and "does not fit memory" in forced.reason
    same = decide_repartition(TriggerConfig(mode="always"), 3, 0.0, coming, candidate_differs=False)
    assert not same.migrate


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="`mode` must be one of auto, always, interval, never"):
        TriggerConfig(mode="sometimes")
    with pytest.raises(ValueError, match="`horizon_steps` must be >= 1"):
        TriggerConfig(horizon_steps=0)
    with pytest.raises(ValueError, match="`coming` is empty"):
        decide_repartition(TriggerConfig(), 0, 1.0, [])
    with pytest.raises(ValueError, match="`migration_seconds` must be >= 0"):
        decide_repartition(TriggerConfig(), 0, -1.0, [StepPrediction(1.0, 1.0)])


def test_the_residence_horizon_follows_how_long_layouts_last():
    horizon = ResidenceHorizon(16)
    assert horizon.steps() == 16.0  # no switch seen yet: the planner's setting
    for _ in range(6):  # a switch every step: each layout lasted one step
        horizon.record(True)
    assert horizon.steps() == 1.0  # a reconfiguration is now paid by the one step it buys
    for _ in range(40):  # one layout holds: the horizon grows back, never beyond the setting
        horizon.record(False)
    assert 1.0 < horizon.steps() <= 16.0 and horizon.steps() > 5.0
    assert ResidenceHorizon(4, runs=[30], current=30).steps() == 4.0
