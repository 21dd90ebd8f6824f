"""HelixPipe's family in the simulator: the helix placement and the paper's Table 2 (bubble, memory).

The formulas are the paper's (shared/papers/helixpipe-attention-parallel-pp, §4.5, Table 2): idle time
per stage ``3(p-1)(t_pre+t_post)`` for naive FILO, ``6(p-1)(...)`` two-fold, ``8(p-1)(...)`` two-fold
with recomputation without attention, independent of ``t_attn``, ``L`` and ``m``; stashed activations
``4bshmL/p`` on every stage, against 1F1B's ``16(p-i)bshL/p``.
"""

from __future__ import annotations

import pytest

from lightning_pipe.schedules import ActionCosts, ActionType, ScheduleError, simulate, validate
from lightning_pipe.schedules.action_rules import check_executable
from lightning_pipe.schedules.families.helix import helix, helix_stage_costs
from lightning_pipe.schedules.families.one_f_one_b import one_f_one_b


def _costs(num_ranks, layers_per_rank, m, parts, *, unit_backward=2.0, scale=1.0):
    """Forward per stage from the part times; backward 2x (units ``unit_backward`` x, 3 when the
    backward includes recomputation); ``scale`` makes one microbatch stand for a fold pair."""
    forward = [scale * t for t in helix_stage_costs(num_ranks, layers_per_rank, *parts)]
    backward = [t * (2.0 if s % 2 else unit_backward) for s, t in enumerate(forward)]
    return ActionCosts(
        forward=tuple(tuple(t for _ in range(m)) for t in forward),
        backward=tuple(tuple(t for _ in range(m)) for t in backward),
    )


def _idle(program, costs):
    result = simulate(validate(program), costs)
    return result.idle


def test_helix_placement_and_parameter_layout():
    p, layers_per_rank, m, folds = 4, 2, 8, 2
    program = validate(helix(p, m, layers_per_rank=layers_per_rank, folds=folds))
    layers = p * layers_per_rank
    assert program.num_stages == 2 * layers + 1
    for rank, actions in enumerate(program.actions):
        for a in actions:
            if a.type is not ActionType.FORWARD:
                continue
            layer, attention = divmod(a.stage, 2)
            offset = (a.microbatch % (p * folds)) // folds  # folds of one data offset share it
            expected = (layer + offset + 1) % p if attention else layer % p
            assert rank == expected, a
    # parameterised stages (units): L/p per rank, rank 0 holding pre(0) and post(L-1) besides
    units = [program.stage_to_rank[s] for s in range(0, program.num_stages, 2)]
    assert [units.count(r) for r in range(p)] == [layers_per_rank + 1] + [layers_per_rank] * (p - 1)
    assert units[0] == units[-1] == 0  # embedding and head on the same rank


@pytest.mark.parametrize(
    ("p", "layers_per_rank", "m", "parts"),
    [(4, 2, 4, (1, 3, 2)), (4, 1, 8, (1, 3, 2)), (2, 2, 4, (2, 1, 3)), (8, 2, 8, (1, 10, 1)), (4, 4, 4, (1, 0.5, 1))],
)
def test_naive_filo_bubble_is_3_and_with_recomputation_4_times_p_minus_1(p, layers_per_rank, m, parts):
    t_pre, _, t_post = parts
    naive = _idle(helix(p, m, layers_per_rank=layers_per_rank, folds=1, recompute=False), _costs(p, layers_per_rank, m, parts))
    assert naive == pytest.approx([3 * (p - 1) * (t_pre + t_post)] * p)
    recomputed = _idle(
        helix(p, m, layers_per_rank=layers_per_rank, folds=1, recompute_in_backward=True),
        _costs(p, layers_per_rank, m, parts, unit_backward=3.0),
    )
    assert recomputed == pytest.approx([4 * (p - 1) * (t_pre + t_post)] * p)


@pytest.mark.parametrize(("p", "layers_per_rank", "m", "parts"), [(4, 2, 8, (1, 3, 2)), (2, 2, 4, (2, 1, 3)), (8, 4, 16, (1, 3, 2))])
def test_two_fold_bubbles_6_and_8_times_p_minus_1(p, layers_per_rank, m, parts):
    """The paper's two-fold accounting runs a fold pair as one: naive FILO over m/2 microbatches of
    twice the cost. Running the two folds as separate actions (the family's program) never idles more."""
    t_pre, _, t_post = parts
    pair = dict(layers_per_rank=layers_per_rank, folds=1)
    two_fold = _idle(helix(p, m // 2, recompute=False, **pair), _costs(p, layers_per_rank, m // 2, parts, scale=2.0))
    assert two_fold == pytest.approx([6 * (p - 1) * (t_pre + t_post)] * p)
    with_recompute = _idle(
        helix(p, m // 2, recompute_in_backward=True, **pair), _costs(p, layers_per_rank, m // 2, parts, unit_backward=3.0, scale=2.0)
    )
    assert with_recompute == pytest.approx([8 * (p - 1) * (t_pre + t_post)] * p)
    per_fold = _idle(
        helix(p, m, layers_per_rank=layers_per_rank, folds=2, recompute=False), _costs(p, layers_per_rank, m, parts)
    )
    assert all(3 * (p - 1) * (t_pre + t_post) <= idle <= 6 * (p - 1) * (t_pre + t_post) + 1e-9 for idle in per_fold)


@pytest.mark.parametrize(("p", "layers_per_rank", "m", "folds"), [(4, 2, 8, 2), (2, 2, 4, 2), (4, 1, 4, 1)])
def test_stashed_activations_are_4bshmL_over_p_on_every_stage(p, layers_per_rank, m, folds):
    """Recomputation without attention: attention keeps its input and output (2bsh), a unit its inputs
    (2bsh; the embedding side of pre(0) and post(L-1) bsh each). Units in bsh, b*s*h = 1."""
    program = validate(helix(p, m, layers_per_rank=layers_per_rank, folds=folds))
    last = program.num_stages - 1

    def table(value):
        return tuple(tuple(float(value(s)) for _ in range(m)) for s in range(program.num_stages))

    def checkpoint(s):
        return 0 if s % 2 else (1 if s in (0, last) else 2)

    costs = ActionCosts(
        forward=table(lambda s: 1),
        backward=table(lambda s: 2),
        saved_bytes=table(lambda s: 2 if s % 2 else checkpoint(s)),
        checkpoint_bytes=table(checkpoint),
    )
    layers = p * layers_per_rank
    assert simulate(program, costs).peak_memory == pytest.approx([4 * m * layers / p] * p)
    # 1F1B on the same model: 16 bsh per layer, L/p layers per stage, p - i microbatches at stage i
    baseline = simulate(one_f_one_b(p, m), ActionCosts.uniform(p, m, saved_bytes=16 * layers / p))
    assert baseline.peak_memory == pytest.approx([16 * (p - i) * layers / p for i in range(p)])


def test_sizes_that_do_not_fit_and_the_runtime_refusal():
    with pytest.raises(ValueError, match="multiple of num_ranks \\* folds"):
        helix(4, 6, folds=2)
    with pytest.raises(ValueError, match="folds"):
        helix(4, 8, folds=0)
    with pytest.raises(ValueError, match="split placement"):
        check_executable(helix(2, 4, folds=1, recompute=False))  # no simulated-only kind, but split placement


def test_validator_catches_a_misplaced_attention():
    program = helix(2, 4, folds=1, recompute=False)
    rows = [list(r) for r in program.actions]
    moved = next(a for a in rows[0] if a.type is ActionType.FORWARD and a.stage == 1)  # an attention forward
    rows[0].remove(moved)
    rows[1].insert(0, moved)
    import dataclasses

    broken = dataclasses.replace(program, actions=tuple(tuple(r) for r in rows))
    with pytest.raises(ScheduleError, match="places it on rank 0"):
        validate(broken)


def test_simulated_7b_benchmark_ordering_and_trend():
    """benchmarks/simulated_helix.py: at long sequences HelixPipe beats ZB-H1, which beats 1F1B, and its
    gain grows with the sequence length (the paper: +26% at 128k on 8 stages)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "simulated_helix.py"
    spec = importlib.util.spec_from_file_location("simulated_helix", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gains = []
    for seq in (32768, 131072):
        one = bench.baseline("1f1b", 4, 8, seq, False, 100.0)
        zb = bench.baseline("zb_h1", 4, 8, seq, False, 100.0)
        hx = bench.helix_makespan(4, 8, seq, False, 100.0)
        assert hx < zb < one
        gains.append(zb / hx)
    assert gains[1] > gains[0]
