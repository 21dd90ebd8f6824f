"""Optimizer offload (SPipe) on one process: same parameters, early per-stage steps, exact rollback."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pipe.runtime.optimizer_offload import StageOptimizers


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _stages(model: nn.Sequential) -> dict[int, list[nn.Parameter]]:
    return {0: list(model[0].parameters()), 1: list(model[2].parameters()) + list(model[4].parameters())}


INPUTS = [torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _train(offload: bool, steps: int = 3, scale: float | None = None, poison_step: int | None = None):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    stages = StageOptimizers(optimizer, _stages(model)) if offload else None
    skipped = []
    for step in range(steps):
        if stages is not None:
            stages.start_step(len(INPUTS), loss_scale=scale)
        for index, x in enumerate(INPUTS):
            loss = model(x).pow(2).sum() * (scale or 1.0)
            if step == poison_step and index == len(INPUTS) - 1:
                loss = loss + model[0].weight.sum() * float("inf")  # overflow in stage 0's gradient only
            loss.backward()
        if stages is not None:
            skipped.append(stages.finish())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, stages, skipped


def test_offloaded_steps_give_the_same_parameters_and_state_lives_on_the_host():
    expected, _, _, _ = _train(offload=False)
    actual, optimizer, stages, skipped = _train(offload=True)
    for a, e in zip(actual.parameters(), expected.parameters()):
        assert torch.equal(a, e)  # the same arithmetic, in the same dtype (float64 masters)
    assert skipped == [False] * 3
    assert not optimizer.state  # the user's optimizer holds nothing for offloaded parameters
    host = stages.host_optimizer(1)
    assert all(state["exp_avg"].device.type == "cpu" for state in host.state.values()) and len(host.state) == 4
    assert host.param_groups[0]["lr"] == 0.1 * 0.5**2  # the scheduler's learning rate reached the host optimizer
    stages.close()


def test_a_stage_steps_as_soon_as_its_gradients_are_final():
    """Stage 1's last gradient arrives during the last backward, before stage 0's: its step starts first."""
    model = _model()
    stages = StageOptimizers(torch.optim.AdamW(model.parameters(), lr=0.1), _stages(model))
    stages.start_step(len(INPUTS))
    for x in INPUTS:
        model(x).pow(2).sum().backward()
    launched = {stage: record.launched for stage, record in stages.records.items()}
    stages.finish()
    assert launched[1] < launched[0]  # both launched from inside backward, stage 1 first
    assert stages.records[1].started < stages.records[0].finished
    stages.close()


def test_an_overflow_in_one_stage_undoes_every_stage_exactly():
    """With a loss scale, a non-finite gradient in stage 0 skips the whole step: stage 1, which stepped
    with finite gradients, is restored bit for bit (weights, Adam moments, step counts)."""
    scale = 1024.0
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    stages = StageOptimizers(optimizer, _stages(model))

    def run_step(poison: bool) -> bool:
        stages.start_step(len(INPUTS), loss_scale=scale)
        for index, x in enumerate(INPUTS):
            loss = model(x).pow(2).sum() * scale
            if poison and index == len(INPUTS) - 1:
                loss = loss + model[0].weight.sum() * float("inf")
            loss.backward()
        return stages.finish()

    def snapshot():
        state = {
            s: [{k: v.clone() for k, v in stages.host_optimizer(s).state[m].items()} for m in stages.masters(s)]
            for s in stages.stages
        }
        return [p.detach().clone() for p in model.parameters()], {s: [m.clone() for m in stages.masters(s)] for s in stages.stages}, state

    assert run_step(poison=False) is False
    before = snapshot()
    assert run_step(poison=True) is True
    assert stages.records[0].found_inf and not stages.records[1].found_inf
    after = snapshot()
    for a, b in zip(after[0], before[0]):
        assert torch.equal(a, b)
    for s in stages.stages:
        for a, b in zip(after[1][s], before[1][s]):
            assert torch.equal(a, b)
        for a, b in zip(after[2][s], before[2][s]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run_step(poison=False) is False  # training goes on
    assert not torch.equal(next(model.parameters()), before[0][0])
    stages.close()
