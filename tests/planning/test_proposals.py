"""The merge rule of plan proposals: deterministic, independent of order, typed plan parts."""

from __future__ import annotations

import itertools

import pytest

from lightning_pipe.planning import MemoryPlan, PipelinePlan, StageMemory
from lightning_pipe.planning.boundaries import uniform_partition
from lightning_pipe.planning.proposals import PlanProposal, merge_proposals
from lightning_pipe.schedules import Schedule, resolve_schedule

RANKS, BLOCKS = 2, 8


def _default(num_stages: int) -> tuple[int, ...]:
    return uniform_partition(BLOCKS, num_stages)


def _current() -> PipelinePlan:
    return PipelinePlan((0, 4, 8), "1f1b", 4)


def test_plan_parts_are_typed():
    plan = PipelinePlan((0, 3, 8), "gpipe", 2, memory={"default": {"full": None}}, microbatch_sizes=[3, 1])
    assert isinstance(plan.schedule, Schedule) and plan.schedule.name == "gpipe"
    assert isinstance(plan.memory, MemoryPlan) and plan.memory.default.full is None
    assert plan.microbatch_sizes == (3, 1)
    assert plan.describe()["microbatch_sizes"] == [3, 1]
    with pytest.raises(ValueError, match="gives 3 microbatches but `num_microbatches=2`"):
        PipelinePlan((0, 4, 8), "1f1b", 2, microbatch_sizes=(1, 1, 1))
    with pytest.raises(ValueError, match="integers >= 1"):
        PipelinePlan((0, 4, 8), "1f1b", 2, microbatch_sizes=(2, 0))
    with pytest.raises(TypeError, match="MemoryPlan or None"):
        PipelinePlan((0, 4, 8), "1f1b", 2, memory=3)


def _proposals():
    seen = []

    def memory_for(draft: PipelinePlan) -> MemoryPlan:
        seen.append(draft)
        return MemoryPlan(StageMemory(full=draft.num_stages))  # depends on the draft it is made for

    return seen, [
        PlanProposal("ScheduleSwitch", schedule="interleaved_1f1b"),
        PlanProposal("ElasticRepartition", boundaries=(0, 5, 8)),  # 2 stages: made for the old family
        PlanProposal("Other", boundaries=(0, 1, 3, 5, 8)),
        PlanProposal("MemoryPlanner", memory=memory_for),
        PlanProposal("Sizer", microbatch_sizes=(2, 1, 1, 4)),
        PlanProposal("Late", microbatch_sizes=(4, 4), priority=-1),
    ]


def test_callback_order_does_not_change_the_merged_plan():
    results = set()
    for order in itertools.permutations(range(6)):
        seen, proposals = _proposals()
        merged = merge_proposals(_current(), [proposals[i] for i in order], RANKS, _default)
        results.add((merged.plan, tuple(sorted(merged.winners.items())), tuple(sorted(merged.overridden))))
        assert len(seen) == 1  # the winning memory function runs once, on the draft
    assert len(results) == 1
    plan, winners, overridden = results.pop()
    assert plan.schedule == resolve_schedule("interleaved_1f1b")
    assert plan.boundaries == (0, 1, 3, 5, 8)  # the proposal with the family's 4 stages
    assert plan.microbatch_sizes == (2, 1, 1, 4) and plan.num_microbatches == 4
    assert plan.memory == MemoryPlan(StageMemory(full=4))  # planned for the merged 4-stage draft
    assert dict(winners) == {"microbatching": "Sizer", "schedule": "ScheduleSwitch", "partition": "Other", "memory": "MemoryPlanner"}
    reasons = {(source, part): reason for source, part, reason in overridden}
    assert "2 stages" in reasons[("ElasticRepartition", "partition")]
    assert "Sizer won" in reasons[("Late", "microbatching")]


def test_schedule_switch_keeps_the_memory_plan():
    """The old bug: a family switch replaced a memory planner's plan with the static one."""
    memory = MemoryPlan(StageMemory(full=1))
    current = PipelinePlan((0, 4, 8), "1f1b", 4, memory=memory)
    merged = merge_proposals(current, [PlanProposal("ScheduleSwitch", schedule="gpipe")], RANKS, _default)
    assert merged.plan.memory == memory and merged.plan.schedule.name == "gpipe"


def test_ties_and_priorities():
    a = PlanProposal("a", boundaries=(0, 2, 8))
    b = PlanProposal("b", boundaries=(0, 6, 8))
    assert merge_proposals(_current(), [b, a], RANKS, _default).plan.boundaries == (0, 2, 8)  # by name
    b_first = PlanProposal("b", boundaries=(0, 6, 8), priority=1)
    assert merge_proposals(_current(), [a, b_first], RANKS, _default).plan.boundaries == (0, 6, 8)


def test_unproposed_parts():
    current = PipelinePlan((0, 4, 8), "1f1b", 2, microbatch_sizes=(3, 1))
    merged = merge_proposals(current, [], RANKS, _default)
    assert merged.plan.microbatch_sizes is None and merged.plan.num_microbatches == 2  # sizes hold one batch
    assert merged.plan.boundaries == (0, 4, 8) and not merged.winners
    switched = merge_proposals(current, [PlanProposal("s", schedule="zbv")], RANKS, _default)
    assert switched.plan.boundaries == _default(4)  # running boundaries do not fit 4 stages


def test_proposal_checks():
    with pytest.raises(ValueError, match="3 microbatch sizes but num_microbatches=2"):
        PlanProposal("x", num_microbatches=2, microbatch_sizes=(1, 1, 1))
    with pytest.raises(TypeError, match="MemoryPlan or a function"):
        PlanProposal("x", memory={"default": {}})
    with pytest.raises(ValueError, match="non-empty name"):
        PlanProposal("")


def test_widths_travel_with_the_partition():
    """Elastic depth: a partition proposal may give stage widths; they stay until a partition without them wins."""
    grow = PlanProposal("depth", boundaries=(0, 8), widths=(2,))
    merged = merge_proposals(_current(), [grow], RANKS, _default)
    assert (merged.plan.boundaries, merged.plan.widths) == ((0, 8), (2,)) and merged.winners == {"partition": "depth"}
    kept = merge_proposals(merged.plan, [PlanProposal("m", num_microbatches=6)], RANKS, _default).plan
    assert (kept.boundaries, kept.widths, kept.num_microbatches) == ((0, 8), (2,), 6)
    back = merge_proposals(merged.plan, [PlanProposal("r", boundaries=(0, 3, 8))], RANKS, _default).plan
    assert (back.boundaries, back.widths) == ((0, 3, 8), None)
    too_wide = PlanProposal("w", boundaries=(0, 4, 8), widths=(2, 1))
    refused = merge_proposals(_current(), [too_wide], RANKS, _default)
    assert refused.plan.widths is None and refused.overridden[0][:2] == ("w", "partition")
    with pytest.raises(ValueError, match="need `boundaries` with one stage per width"):
        PlanProposal("x", boundaries=(0, 8), widths=(1, 1))
    with pytest.raises(ValueError, match="must give every one of the 2 stages"):
        PipelinePlan((0, 4, 8), widths=(2,))
