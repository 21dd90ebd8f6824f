"""SPipe's program run on 2 gloo processes: forwards and backwards of a stage on different ranks,
backward stages split in two, checkpoints (input and RNG state) sent ahead, parameters in host shared
memory updated by the rank owning each stage's backward with the per-stage host optimizers of
``runtime/optimizer_offload.py`` (each stage steps on a thread once its gradients are final);
parameters after two steps equal a one-process run (float64)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from examples.gpt.model import GPT
from lightning_pipe.runtime import PointToPoint
from lightning_pipe.runtime.optimizer_offload import StageOptimizers
from lightning_pipe.runtime.spipe import SPipeStages, owned_parameters, share_parameters
from lightning_pipe.runtime.split_executor import SplitPlacementExecutor
from lightning_pipe.schedules import ActionType, spipe, validate

STEPS, MICROBATCHES, LR = 2, 4, 0.5
_FORKED: dict = {}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, block_size=32, n_layer=8, n_head=2, n_embd=16).double()


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 32, (8, 11), generator=generator) for _ in range(STEPS)]


def _stages(model: GPT, num_stages: int) -> SPipeStages:
    def embed(batch):
        tokens = batch[:, :-1]
        return model.drop(model.wte(tokens) + model.wpe(torch.arange(tokens.size(1))))

    def head_loss(hidden, batch):
        logits = model.lm_head(model.ln_f(hidden))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    return SPipeStages(embed, model.blocks, head_loss, num_stages)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, program = _FORKED["model"], _FORKED["program"]
        stages = _stages(model, program.num_stages)
        executor = SplitPlacementExecutor(stages, PointToPoint(), list(range(world)), rank, torch.device("cpu"))
        embedding, head = [model.wte, model.wpe], [model.ln_f, model.lm_head]
        owned = owned_parameters(program, stages, rank, embedding, head)
        mine = [q for q in range(program.num_stages) if program.backward_rank(q, 0) == rank]
        optimizers = StageOptimizers(
            torch.optim.SGD(model.parameters(), lr=LR),
            {q: [p for m in stages.stage_modules(q, embedding, head) for p in m.parameters()] for q in mine},
        )
        stepped = set()
        for batch in _batches():
            optimizers.start_step(MICROBATCHES)
            executor.run(program, list(batch.chunk(MICROBATCHES)), [1.0 / MICROBATCHES] * MICROBATCHES)
            dist.barrier()  # every forward of this step has read the parameters
            optimizers.finish()  # copies the updated weights into the shared parameters, in place
            stepped |= {q for q, record in optimizers.records.items() if record.stepped}
            dist.barrier()
        optimizers.close()
        owned_names = {n for n, p in model.named_parameters() if any(p is q for q in owned)}
        torch.save({"stepped": stepped, "mine": set(mine), "owned": owned_names}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_spipe_two_ranks_shared_parameters_match_one_process(tmp_path):
    model = share_parameters(_model())
    program = validate(spipe(2, MICROBATCHES, stages_per_rank=2, backward_split=2))
    assert any(a.type is ActionType.SEND_C for a in program.actions[0])  # checkpoints do cross ranks
    _FORKED.update(model=model, program=program)
    try:
        mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    finally:
        _FORKED.clear()
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # each parameter is owned by one rank, which alone computed its gradient
    assert parts[0]["owned"].isdisjoint(parts[1]["owned"])
    assert parts[0]["owned"] | parts[1]["owned"] == {n for n, _ in model.named_parameters()}
    for part in parts:
        assert part["stepped"] == part["mine"]  # every stage stepped on the rank of its backward
    reference = _model()
    reference.log = lambda *args, **kwargs: None
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for batch in _batches():
        optimizer.zero_grad()
        reference.training_step(batch, 0).backward()
        optimizer.step()
    # the parent's module shares its parameters' memory with the ranks: it holds the trained values
    for (name, param), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param.detach(), expected.detach(), atol=1e-10, rtol=0, msg=name)


def test_a_shipped_checkpoint_without_recompute_is_refused_before_running():
    program = spipe(2, 2, stages_per_rank=1, backward_split=2, recompute_in_backward=True)
    stages = SPipeStages(lambda batch: batch, [torch.nn.Identity()] * 4, lambda hidden, batch: hidden.sum(), program.num_stages)
    executor = SplitPlacementExecutor(stages, PointToPoint(), [0, 1], 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="no RECOMPUTE"):
        executor.run(program, [torch.zeros(1), torch.zeros(1)], [1.0, 1.0])
