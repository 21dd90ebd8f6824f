"""HelixPipe's program run on 2 gloo processes with blocks cut at their attention (the GPT example,
a transformers Llama): parameters after two steps equal a one-process run (float64, 1e-10; both
also agree at 1e-14 here, though transformers' loss passes through float32)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from examples.gpt.model import GPT
from lightning_pipe.model import split_block_at_attention
from lightning_pipe.runtime import PointToPoint
from lightning_pipe.runtime.helix import HelixExecutor, HelixParts
from lightning_pipe.schedules import helix, validate

STEPS, MICROBATCHES, LR = 2, 4, 0.5


def _model(family: str):
    torch.manual_seed(0)
    if family == "llama":
        from tests.helpers.hf_models import build_causal_lm

        return build_causal_lm("llama", layers=4).double()
    return GPT(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=16).double()


def _batches(family: str) -> list:
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(1, 32, (8, 13), generator=generator) for _ in range(STEPS)]
    if family == "llama":  # no padding: every microbatch counts the same targets
        return [{"input_ids": t, "labels": t.clone()} for t in tokens]
    return tokens


def _blocks(model):
    return model.model.layers if hasattr(model, "model") else model.blocks


def _loss(model, batch) -> torch.Tensor:
    """One device's loss, the user's own code."""
    if isinstance(batch, dict):
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    model.log = lambda *args, **kwargs: None
    return model.training_step(batch, 0)


def _parts(model) -> HelixParts:
    if hasattr(model, "model"):
        return _llama_parts(model)
    return _gpt_parts(model)


def _llama_parts(lm) -> HelixParts:
    """A transformers LlamaForCausalLM as embedding, decoder layers cut at attention, norm + head + its loss."""
    inner = lm.model

    def embed(batch):
        return inner.embed_tokens(batch["input_ids"])

    def block_kwargs(batch):
        ids = batch["input_ids"]
        positions = torch.arange(ids.size(1))[None].expand_as(ids)
        cos, sin = inner.rotary_emb(torch.zeros(1, dtype=torch.float64), positions)
        return {"position_embeddings": (cos, sin), "attention_mask": None}

    def head_loss(hidden, batch):
        logits = lm.lm_head(inner.norm(hidden))
        return lm.loss_function(logits=logits, labels=batch["labels"], vocab_size=lm.config.vocab_size)

    example = {"input_ids": torch.ones(2, 5, dtype=torch.long)}
    hidden = torch.zeros(2, 5, lm.config.hidden_size, dtype=torch.float64)
    first = split_block_at_attention(inner.layers[0], (hidden,), block_kwargs(example))
    return HelixParts(embed, [first] + [first.rebind(b) for b in inner.layers[1:]], head_loss, block_kwargs)


def _gpt_parts(model: GPT) -> HelixParts:
    """The GPT example as embedding, blocks cut at attention, and head with loss (its own code's ops)."""

    def embed(batch):
        tokens = batch[:, :-1]
        return model.drop(model.wte(tokens) + model.wpe(torch.arange(tokens.size(1))))

    def head_loss(hidden, batch):
        logits = model.lm_head(model.ln_f(hidden))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

    example = torch.zeros(2, 5, model.hparams.n_embd, dtype=torch.float64)
    first = split_block_at_attention(model.blocks[0], (example,))
    return HelixParts(embed, [first] + [first.rebind(b) for b in model.blocks[1:]], head_loss)


_FORKED: dict = {}  # the model and its units, built once before forking (one capture for both ranks)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, parts = _FORKED["model"], _FORKED["parts"]
        executor = HelixExecutor(parts, PointToPoint(), list(range(world)), rank, torch.device("cpu"))
        program = validate(helix(world, MICROBATCHES, layers_per_rank=len(_blocks(model)) // world, folds=2))
        losses = []
        for batch in _FORKED["batches"]:
            model.zero_grad(set_to_none=False)
            if isinstance(batch, dict):
                microbatches = [dict(zip(batch, values)) for values in zip(*(v.chunk(MICROBATCHES) for v in batch.values()))]
            else:
                microbatches = list(batch.chunk(MICROBATCHES))
            losses.append(executor.run(program, microbatches, [1.0 / MICROBATCHES] * MICROBATCHES))
            for param in model.parameters():  # every gradient is computed on exactly one rank
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad)
            with torch.no_grad():
                for param in model.parameters():
                    param -= LR * param.grad
        state = {n: p.detach() for n, p in model.named_parameters()}
        torch.save({"params": state, "losses": losses}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_helix_two_ranks_match_one_process(tmp_path, family):
    if family == "llama":
        pytest.importorskip("transformers")
    atol = 1e-10
    model = _model(family)
    _FORKED.update(model=model, parts=_parts(model), batches=_batches(family))
    try:
        mp.start_processes(
            _worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork"
        )
    finally:
        _FORKED.clear()
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    reference = _model(family)
    expected_losses = []
    for batch in _batches(family):
        reference.zero_grad()
        loss = _loss(reference, batch)
        loss.backward()
        expected_losses.append(loss.detach())
        with torch.no_grad():
            for param in reference.parameters():
                param -= LR * param.grad
    for name, param in reference.named_parameters():
        for part in parts:
            torch.testing.assert_close(part["params"][name], param.detach(), atol=atol, rtol=0)
    # the loss runs on rank 0 (embedding and head share it); the mean of the microbatch losses is the batch's
    for step, expected in enumerate(expected_losses):
        got = parts[0]["losses"][step]
        assert sorted(got) == list(range(MICROBATCHES)) and not parts[1]["losses"][step]
        mean = torch.stack([got[i] for i in range(MICROBATCHES)]).mean()
        torch.testing.assert_close(mean, expected.to(mean.dtype), atol=atol, rtol=0)


def _chunks(batch) -> list:
    if isinstance(batch, dict):
        return [dict(zip(batch, values)) for values in zip(*(v.chunk(MICROBATCHES) for v in batch.values()))]
    return list(batch.chunk(MICROBATCHES))


def _first_samples(batch):
    return _chunks(batch)[0]


def _step_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from lightning_pipe.model import StageRunner, find_blocks
        from lightning_pipe.runtime.helix import StepHelixStages
        from lightning_pipe.runtime.split_executor import SplitPlacementExecutor

        model, units = _FORKED["model"], _FORKED["units"]
        model.log = lambda *args, **kwargs: None  # no trainer attached
        stages = StepHelixStages(StageRunner(model, find_blocks(model)), units)
        executor = SplitPlacementExecutor(stages, PointToPoint(), list(range(world)), rank, torch.device("cpu"))
        program = validate(helix(world, MICROBATCHES, layers_per_rank=len(units) // world, folds=2))
        for batch in _FORKED["batches"]:
            model.zero_grad(set_to_none=False)
            executor.run(program, [(mb, 0) for mb in _chunks(batch)], [1.0 / MICROBATCHES] * MICROBATCHES)
            for param in model.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad)
            with torch.no_grad():
                for param in model.parameters():
                    param -= LR * param.grad
        torch.save({n: p.detach() for n, p in model.named_parameters()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _module(family: str):
    if family == "llama":
        from tests.helpers.hf_models import HFCausalLM

        torch.manual_seed(0)
        return HFCausalLM("llama", layers=4).double()
    return _model("gpt")


def _module_batches(family: str) -> list:
    if family == "llama":
        from tests.helpers.hf_models import lm_batches

        return lm_batches(STEPS, 8, [12], padding="none", seed=1)
    return _batches("gpt")


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_helix_runs_the_unchanged_lightning_module_step(tmp_path, family):
    """No hand-written embedding or head: the module's own training_step runs around the units."""
    if family == "llama":
        pytest.importorskip("transformers")
    from lightning_pipe.model import find_blocks
    from lightning_pipe.runtime.helix import split_stack

    model = _module(family)
    batches = _module_batches(family)
    units = split_stack(model, find_blocks(model), "training_step", (_first_samples(batches[0]), 0))
    _FORKED.update(model=model, units=units, batches=batches)
    try:
        mp.start_processes(_step_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    finally:
        _FORKED.clear()
    reference = _module(family)
    reference.log = lambda *args, **kwargs: None
    for batch in batches:
        reference.zero_grad()
        reference.training_step(batch, 0).backward()
        with torch.no_grad():
            for param in reference.parameters():
                param -= LR * param.grad
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, param in reference.named_parameters():
            torch.testing.assert_close(got[name], param.detach(), atol=1e-10, rtol=0)
