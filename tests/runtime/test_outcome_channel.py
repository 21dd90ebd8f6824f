"""The outcome channel: every rank replays exactly the last stage's outcome, pickled only when its schema changes."""

from __future__ import annotations

import math
import pickle

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pipe.model.stage_runner import LogCall
from lightning_pipe.runtime.outcome_channel import OutcomeChannel
from tests.helpers.training import START_METHOD


def _payload(step: int, *, extra: bool = False, metric: bool = False, error: bool = False):
    loss = torch.tensor(1.0 / (step + 3), dtype=torch.float64)
    logs = [
        LogCall("train_loss", torch.tensor(0.1 * step + 1e-9, dtype=torch.float32), {"prog_bar": True, "batch_size": 8}),
        LogCall("bf16", torch.tensor(step / 7, dtype=torch.bfloat16), {"reduce_fx": "mean"}),
        LogCall("plain", step / 3, {}),
        LogCall("nan", torch.tensor(math.nan, dtype=torch.float64), {}),
    ]
    if extra:
        logs.append(LogCall("extra", torch.tensor(float(step)), {}))
    return loss, logs, 0.5 + step, {"metric": step} if metric else {}, ValueError("raised everywhere") if error else None


# (step kind, root, payload builder, whether the receivers post early): root 1 is the last stage;
# the fourth step changes the schema (a new name), so it and the step after it differ in kind
STEPS = [
    ("training_step", 1, lambda: _payload(0), True),  # first of its kind: pickled
    ("training_step", 1, lambda: _payload(1), True),  # same schema: numbers only
    ("training_step", 1, lambda: _payload(2), False),  # numbers only, received without posting
    ("training_step", 1, lambda: _payload(3, extra=True), True),  # a new name: pickled
    ("training_step", 1, lambda: _payload(4, extra=True), True),  # numbers only again
    ("training_step", 1, lambda: _payload(5, extra=True, metric=True), True),  # metric updates: pickled
    ("training_step", 1, lambda: _payload(6, error=True), True),  # an error travels pickled
    ("validation_step", 1, lambda: (None, [LogCall("val", torch.tensor(2.0), {})], 1.0, {}, None), True),
    ("validation_step", 1, lambda: (None, [LogCall("val", torch.tensor(3.0), {})], 1.0, {}, None), True),
    ("training_step", 0, lambda: _payload(7), True),  # another last stage: its own schema, pickled
    ("training_step", 0, lambda: _payload(8), True),
]
PICKLED = [True, False, False, True, False, True, True, True, False, True, False]


def _bits(payload) -> bytes:
    """Everything the strategy reads of a payload, compared bit for bit (dtypes and NaN included)."""
    loss, logs, normalizer, metric_updates, error = payload
    described = [
        (c.name, sorted(c.kwargs.items()), str(c.value.dtype) if torch.is_tensor(c.value) else "float",
         c.value.reshape(1).view(torch.uint8).tolist() if torch.is_tensor(c.value) else repr(c.value))
        for c in logs
    ]
    return pickle.dumps((None if loss is None else loss.item(), described, normalizer, metric_updates, repr(error)))


def _worker(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    channel = OutcomeChannel(dist.new_group(list(range(world)), backend="gloo"))
    seen, pickled = [], []
    for kind, root, build, early in STEPS:
        if early:
            channel.post(kind, root)
        before = channel.pickled
        got = channel.share(kind, root, build() if rank == root else None, operation="the test's outcome")
        seen.append(_bits(got))
        pickled.append(channel.pickled > before)
    torch.save({"seen": seen, "pickled": pickled}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_every_rank_gets_the_last_stages_outcome_bit_for_bit_and_numbers_only_while_its_schema_holds(tmp_path):
    world = 3
    mp.start_processes(
        _worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True, start_method=START_METHOD
    )
    expected = [_bits(build()) for _, _, build, _ in STEPS]
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["seen"] == expected, rank
        assert result["pickled"] == PICKLED, rank
