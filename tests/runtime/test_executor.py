"""The executor on real gloo process groups, without Lightning's loop.

Microbatches of one step have different sequence lengths: nothing is sized from the first one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks, owned_units, shard_module
from lightning_pipe.runtime import PipelineExecutor, PointToPoint, StepWork
from lightning_pipe.schedules import merge_split_backwards, resolve_schedule
from tests.helpers.models import TinyGPT

LENGTHS = [3, 11, 6, 8]  # one sequence length per microbatch
BOUNDARIES = (0, 1, 4)  # 2 stages: block 0 | blocks 1-3


def _microbatches(lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (2, t + 1), generator=generator) for t in lengths]


class _CountingPointToPoint(PointToPoint):
    """Counts receives posted before their consumer asked (:meth:`PointToPoint.post_receive` alone)."""

    early = 0
    asked = False

    def receive(self, *args, **kwargs):
        self.asked = True
        try:
            return super().receive(*args, **kwargs)
        finally:
            self.asked = False

    def post_receive(self, *args, **kwargs):
        self.early += not self.asked
        return super().post_receive(*args, **kwargs)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(layers=4).double()


class _RecordingExecutor(PipelineExecutor):
    """Records every backward it runs: ``(stage, microbatch, full)``."""

    def _backward(self, stage: int, mb: int, full: bool) -> None:
        self.backwards.append((stage, mb, full))
        super()._backward(stage, mb, full)


def _worker(rank: int, world: int, init_file: str, out_dir: str, schedule: str, lengths: list[int] = LENGTHS) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _model()
        model.log = lambda *args, **kwargs: None  # no trainer attached
        stack = find_blocks(model)
        family, _, merged = schedule.partition("+")
        program = resolve_schedule(family).build(world, len(LENGTHS))
        program = merge_split_backwards(program) if merged else program
        stages = program.stages_of(rank)
        boundaries = BOUNDARIES if program.num_stages == 2 else tuple(range(program.num_stages + 1))  # 1 block a stage
        shard_module(model, analyze_units(model, stack), owned_units(boundaries, stages), torch.device("cpu"))
        spans = {s: StageSpan(s, boundaries[s], boundaries[s + 1], stack.num_blocks) for s in stages}
        p2p = _CountingPointToPoint()
        executor = _RecordingExecutor(StageRunner(model, stack), p2p, list(range(world)), rank, torch.device("cpu"))
        executor.backwards = []
        same = len(set(lengths)) == 1
        work = StepWork("training_step", [(mb, 0) for mb in _microbatches(lengths)], [1.0] * len(lengths), same_shapes=same)
        outcome = executor.run(program, spans, work)
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save(
            {"grads": grads, "losses": outcome.losses, "early": p2p.early, "backwards": executor.backwards,
             "actions": [(a.type.value, a.stage, a.microbatch) for a in program.actions[rank]]},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def _reference(lengths: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Gradients and per-microbatch losses of the same microbatches in one process."""
    reference = _model()
    reference.log = lambda *args, **kwargs: None
    losses = torch.stack([reference.training_step(mb, 0) for mb in _microbatches(lengths)])
    losses.sum().backward()
    return {n: p.grad for n, p in reference.named_parameters()}, losses.detach()


def _assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("lengths", [LENGTHS, [7] * 4], ids=["own-lengths", "same-shapes-received-early"])
def test_variable_length_microbatches_match_single_process(tmp_path, lengths):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), "1f1b", lengths), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # the first stage receives every gradient early; the second every activation but the first
    assert [parts[0]["early"], parts[1]["early"]] == ([4, 3] if len(set(lengths)) == 1 else [4, 0])

    expected, losses = _reference(lengths)
    _assert_same_gradients(parts[0]["grads"] | parts[1]["grads"], expected)
    assert sorted(parts[1]["losses"]) == list(range(len(lengths)))
    torch.testing.assert_close(torch.stack([parts[1]["losses"][i] for i in range(4)]), losses)


def test_a_program_with_merged_pairs_runs_each_b_whole_and_each_i_split(tmp_path):
    """ZB-V on 2 ranks with some pairs merged into one B (``merge_split_backwards``): every B runs one
    full backward, every I the input-gradient pass only. Gradients equal one process's."""
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), "zbv+merged", LENGTHS), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    kinds = set()
    for part in parts:
        backwards = [(kind == "B", stage, mb) for kind, stage, mb in part["actions"] if kind in ("B", "I")]
        assert [(full, stage, mb) for stage, mb, full in part["backwards"]] == backwards
        kinds |= {kind for kind, _, _ in part["actions"]}
    assert {"B", "I", "W"} <= kinds  # both paths ran
    _assert_same_gradients(parts[0]["grads"] | parts[1]["grads"], _reference(LENGTHS)[0])
