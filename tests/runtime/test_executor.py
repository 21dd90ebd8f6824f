"""The executor on real gloo process groups, without Lightning's loop.

Microbatches of one step have different sequence lengths: nothing is sized from the first one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks, owned_units, shard_module
from lightning_pipe.runtime import PipelineExecutor, PointToPoint, StepWork
from lightning_pipe.schedules import merge_split_backwards, resolve_schedule
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD

LENGTHS = [3, 11, 6, 8]  # one sequence length per microbatch
BOUNDARIES = (0, 1, 4)  # 2 stages: block 0 | blocks 1-3


def _microbatches(lengths: list[int] = LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32, (2, t + 1), generator=generator) for t in lengths]


class _CountingPointToPoint(PointToPoint):
    """Counts receives posted before their consumer asked (:meth:`PointToPoint.post_receive` alone)."""

    early = 0
    early_headers = 0
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

    def post_header_receive(self, *args, **kwargs):
        self.early_headers += 1
        return super().post_header_receive(*args, **kwargs)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(layers=4).double()


class _Float32RegionBlock(nn.Module):
    """A residual MLP whose second layer the model runs in float32 under autocast."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        # as models write it: on a later stage the blocks before it run on meta, where torch refuses
        # an autocast context (model/_torch_compat.meta_autocast_disabled)
        with torch.autocast(x.device.type, enabled=False):
            return x + self.down(h.float())


def _float32_region_model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    model.blocks = nn.ModuleList([_Float32RegionBlock(16) for _ in range(4)])
    return model


MODELS = {"tinygpt": _model, "float32-regions": _float32_region_model}


class _RecordingExecutor(PipelineExecutor):
    """Records every backward it runs: ``(stage, microbatch, full)``."""

    def _backward(self, stage: int, mb: int, full: bool) -> None:
        self.backwards.append((stage, mb, full))
        super()._backward(stage, mb, full)


def _worker(
    rank: int, world: int, init_file: str, out_dir: str, schedule: str, lengths: list[int] = LENGTHS,
    model_name: str = "tinygpt", autocast: bool = False, steps: int = 1, describe: bool = False,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = MODELS[model_name]()
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
        work = StepWork(
            "training_step", [(mb, 0) for mb in _microbatches(lengths)], [1.0] * len(lengths), same_shapes=same,
            describe_shapes=describe,
        )
        early, early_headers = [], []  # receives and describing headers posted early, per step
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # as bf16-mixed's train_step_context
                outcome = executor.run(program, spans, work)
            early.append(p2p.early - sum(early))
            early_headers.append(p2p.early_headers - sum(early_headers))
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save(
            {"grads": grads, "losses": outcome.losses, "early": early[0], "early_per_step": early,
             "early_headers_per_step": early_headers,
             "backwards": executor.backwards,
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


def _autocast_reference(lengths: list[int]) -> dict[str, torch.Tensor]:
    """Lightning's bf16-mixed in one process: each microbatch's forward under autocast, its backward
    outside (Lightning's loop leaves the training step's context before it)."""
    reference = _float32_region_model()
    reference.log = lambda *args, **kwargs: None
    for mb in _microbatches(lengths):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference.training_step(mb, 0)
        loss.backward()
    return {n: p.grad for n, p in reference.named_parameters()}


def _assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("lengths", [LENGTHS, [7] * 4], ids=["own-lengths", "same-shapes-received-early"])
def test_variable_length_microbatches_match_single_process(tmp_path, lengths):
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path), "1f1b", lengths), nprocs=2, join=True,
        start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # the first stage receives every gradient early; the second every activation but the first
    assert [parts[0]["early"], parts[1]["early"]] == ([4, 3] if len(set(lengths)) == 1 else [4, 0])

    expected, losses = _reference(lengths)
    _assert_same_gradients(parts[0]["grads"] | parts[1]["grads"], expected)
    assert sorted(parts[1]["losses"]) == list(range(len(lengths)))
    torch.testing.assert_close(torch.stack([parts[1]["losses"][i] for i in range(4)]), losses)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_step_like_the_last_posts_its_first_activation_receives_at_its_start(tmp_path, schedule):
    """A second step of the same program and shapes posts, at its start, the receive of each stage's first
    activations from another rank (in the first step only the later microbatches' are posted early): every
    activation and gradient crossing ranks is then received early, and two steps' gradients are twice one's."""
    lengths = [7] * 4
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path), schedule, lengths, "tinygpt", False, 2), nprocs=2,
        join=True, start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    program = resolve_schedule(schedule).build(2, 4)
    for rank, part in enumerate(parts):
        crossing = 0  # forwards and backwards whose input another rank sends
        for action in program.actions[rank]:
            if action.type.value == "F" and action.stage > 0:
                crossing += program.rank_of(action.stage - 1) != rank
            elif action.type.value in ("B", "I") and action.stage < program.num_stages - 1:
                crossing += program.rank_of(action.stage + 1) != rank
        first, second = part["early_per_step"]
        firsts = len({a.stage for a in program.actions[rank] if a.type.value == "F" and a.stage > 0
                      and program.rank_of(a.stage - 1) != rank})
        assert second == crossing and first == crossing - firsts, (rank, first, second, crossing)
    expected, _ = _reference(lengths)
    _assert_same_gradients(parts[0]["grads"] | parts[1]["grads"], {n: 2 * g for n, g in expected.items()})


def test_activations_described_by_headers_have_the_headers_received_early(tmp_path):
    """Microbatches of their own lengths (activations preceded by a header of their shapes): the header of
    every activation after a stage's first is posted when the one before arrived, and in a second step the
    first's at the step's start; gradients of two steps are twice one step's."""
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path), "1f1b", LENGTHS, "tinygpt", False, 2, True),
        nprocs=2, join=True, start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert parts[0]["early_headers_per_step"] == [0, 0]  # the first stage receives no activations
    assert parts[1]["early_headers_per_step"] == [3, 4]
    expected, _ = _reference(LENGTHS)
    _assert_same_gradients(parts[0]["grads"] | parts[1]["grads"], {n: 2 * g for n, g in expected.items()})


def test_a_program_with_merged_pairs_runs_each_b_whole_and_each_i_split(tmp_path):
    """ZB-V on 2 ranks with some pairs merged into one B (``merge_split_backwards``): every B runs one
    full backward, every I the input-gradient pass only. Gradients equal one process's."""
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path), "zbv+merged", LENGTHS), nprocs=2, join=True,
        start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    kinds = set()
    for part in parts:
        backwards = [(kind == "B", stage, mb) for kind, stage, mb in part["actions"] if kind in ("B", "I")]
        assert [(full, stage, mb) for stage, mb, full in part["backwards"]] == backwards
        kinds |= {kind for kind, _, _ in part["actions"]}
    assert {"B", "I", "W"} <= kinds  # both paths ran
    _assert_same_gradients(parts[0]["grads"] | parts[1]["grads"], _reference(LENGTHS)[0])


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_backward_runs_outside_the_steps_autocast(tmp_path, schedule):
    """Under bf16 autocast (the strategy runs the step, backward included, in the precision plugin's
    context) every backward runs as Lightning's does, outside it: a block's float32 region keeps its
    weight gradients at float32 precision (autocast inside the engine would compute them in bf16)."""
    mp.start_processes(
        _worker, args=(2, str(tmp_path / "init"), str(tmp_path), schedule, LENGTHS, "float32-regions", True),
        nprocs=2, join=True, start_method=START_METHOD,
    )
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    got, expected = parts[0]["grads"] | parts[1]["grads"], _autocast_reference(LENGTHS)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
