"""Packing trains exactly: a batch's sequences packed into microbatches without padding, attention within
each sequence, positions restarting, equals one device on the padded batch (float64).

The project's GPT example (``F.scaled_dot_product_attention(is_causal=True)``: restricted per sequence
by ``PackedAttention``) and transformers' Llama (which builds its per-sequence mask from the packed
``position_ids``), with every schedule family, a token budget that changes the number of
microbatches from batch to batch, recompute, and accumulation. Models packing would change
(absolute positions from ``arange``) are refused on the first batch with what to change.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt.model import GPT
from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.planning.chunking import chunk_pieces
from lightning_pipe.planning.cost_model import LinearCost
from lightning_pipe.runtime.packing import Packer
from tests.helpers.packed_batches import padded_lm_batches
from tests.helpers.training import SEED, START_METHOD, assert_same_parameters, fit, reference_batches

STEPS = 3
HF_ATOL = 1e-7  # transformers' loss is float32 even in a float64 model (see test_real_models.py)


def _gpt():
    return GPT(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=16).double()


def _pipeline(schedule="1f1b", microbatches=3, packing=True, **kwargs):
    return ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=microbatches, schedule=schedule, start_method=START_METHOD,
        packing=packing, **kwargs,
    )


def _parity(make, batches, strategy, atol=1e-10, steps=STEPS, **kwargs):
    pipelined = fit(make, batches, strategy, devices=2, steps=steps, **kwargs)
    kwargs.pop("callbacks", None)  # planners; accumulation applies to the reference too
    reference = fit(make, reference_batches(batches, 1), steps=steps, **kwargs)
    assert_same_parameters(pipelined, reference, atol=atol)
    L.seed_everything(SEED, verbose=False)
    initial = make()
    assert any(not torch.equal(a, b) for a, b in zip(reference.parameters(), initial.parameters()))  # it did train


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv"])
def test_gpt_example_packed_parity(schedule):
    """Four microbatches of near-equal tokens from eight sequences of 2 to 16 tokens."""
    batches = padded_lm_batches(STEPS, batch_size=8, max_len=16)
    _parity(_gpt, batches, _pipeline(schedule, microbatches=4))


def test_token_budget_changes_the_microbatches_per_batch():
    batches = padded_lm_batches(STEPS, batch_size=8, max_len=16, seed=5)
    packer = Packer(max_tokens=24)
    counts = [packer.plan(b, 4).num_microbatches for b in batches]
    assert len(set(counts)) > 1, counts  # the schedule runs a different number of microbatches per batch
    _parity(_gpt, batches, _pipeline("zb_h1", packing=packer))


def test_packing_with_recompute_and_accumulation():
    """Recomputed blocks attend per sequence again in backward; gradients of two batches accumulate."""
    batches = padded_lm_batches(2 * STEPS, batch_size=6, max_len=12, seed=7)
    _parity(_gpt, batches, _pipeline(recompute="full"), steps=STEPS, accumulate_grad_batches=2)


class LlamaOnBatch(L.LightningModule):
    """transformers' Llama trained as ``self.model(**batch).loss``, the usual way with dict batches."""

    def __init__(self) -> None:
        super().__init__()
        from tests.helpers.hf_models import build_causal_lm

        self.model = build_causal_lm("llama", layers=4)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_transformers_llama_packed_parity(schedule):
    pytest.importorskip("transformers")
    batches = padded_lm_batches(STEPS, batch_size=8, max_len=16, seed=3)
    _parity(lambda: LlamaOnBatch().double(), batches, _pipeline(schedule, microbatches=4), atol=HF_ATOL)


class ArangeGPT(L.LightningModule):
    """Positions from ``arange`` inside ``forward``: packing would give the second sequence of a row
    the positions after the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, 16), nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 64), batch["labels"][:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _gpt2():
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import HFCausalLM

    return HFCausalLM("gpt2", layers=4).double()  # passes no position_ids: GPT-2 counts positions along the row


@pytest.mark.parametrize("make", [lambda: ArangeGPT().double(), _gpt2], ids=["arange-positions", "gpt2-without-position-ids"])
def test_models_packing_would_change_are_refused_on_the_first_batch(make):
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=12)
    with pytest.raises(Exception, match=r"Packing would change this model's result: sequence \d+ \(packed at position 1.*"
                       r"differs from its unpacked output.*`position_ids`.*not `torch.arange\(T\)`"):
        fit(make, batches, _pipeline(), devices=2, steps=STEPS)


def test_sample_weights_are_refused_with_packing():
    with pytest.raises(ValueError, match=r"`loss_weights='samples'` cannot weight them"):
        ElasticPipelineStrategy(packing=True, loss_weights="samples")


# --- sequence slicing ---------------------------------------------------------------------------


def _slicing(**kwargs):
    return _pipeline(packing=Packer(max_tokens=8, slicing=True), **kwargs)


def test_gpt_example_sliced_parity():
    """Sequences of up to 20 tokens in slices of at most 8: each slice attends to the earlier slices'
    keys and values, backwards last slice first with their key/value gradients (sliced 1F1B)."""
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20)
    assert all(Packer(max_tokens=8, slicing=True).plan(b, 3).is_sliced for b in batches)
    _parity(_gpt, batches, _slicing())


def test_gpt_example_sliced_with_recompute_parity():
    """Recomputed blocks reuse the stored keys and values of earlier slices and store nothing again."""
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20, seed=2)
    _parity(_gpt, batches, _slicing(recompute="full"))


def test_transformers_llama_sliced_parity():
    """Rotary positions continue across slices from `position_ids`; transformers' loss takes the
    slices' `shift_labels`."""
    pytest.importorskip("transformers")
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20, seed=3)
    _parity(lambda: LlamaOnBatch().double(), batches, _slicing(), atol=HF_ATOL)


def test_slicing_refuses_a_model_that_drops_targets_at_slice_boundaries():
    """The GPT example shifts `labels` itself unless given `shift_labels`: a model that ignores them
    loses each slice's last target; the step's counted targets say so before any update."""

    class IgnoresShiftLabels(GPT):
        def training_step(self, batch, batch_idx):
            return super().training_step({k: v for k, v in batch.items() if k != "shift_labels"}, batch_idx)

    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20)
    make = lambda: IgnoresShiftLabels(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=16).double()  # noqa: E731
    with pytest.raises(Exception, match=r"the step's loss counted \d+ targets in the sliced microbatches, but the batch has \d+"):
        fit(make, batches, _slicing(), devices=2, steps=STEPS)


def test_slicing_refuses_positions_that_restart_per_slice():
    """Every sequence longer than a slice, so no microbatch packs two: the sliced-vs-whole check refuses."""
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20, min_len=9)
    with pytest.raises(Exception, match=r"Packing would change this model's result: sequence \d+, cut into \d slices"):
        fit(lambda: ArangeGPT().double(), batches, _pipeline(packing=Packer(max_tokens=8, slicing=True), microbatches=3),
            devices=2, steps=STEPS)


def test_slicing_needs_1f1b():
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20)
    with pytest.raises(Exception, match=r"schedule 'zbv' cannot run them. Use `schedule='1f1b'`"):
        fit(_gpt, batches, _slicing(schedule="zbv"), devices=2, steps=STEPS)


def test_packing_with_elastic_repartition():
    """The planner prices packed rows by their sequences' lengths (strategy costs read the packing plan)."""
    from lightning_pipe.callbacks import ElasticRepartition

    batches = padded_lm_batches(STEPS, batch_size=8, max_len=16, seed=9)
    _parity(_gpt, batches, _pipeline(microbatches=4), callbacks=[ElasticRepartition(trigger="always")])


# --- workload-balanced chunks (InfiniPipe Algorithm 1) in the runtime -----------------------------

CHUNK_COST = LinearCost(per_token=1.0, per_squared_length=0.05)  # attention's quadratic term matters at these lengths


def _chunks(**kwargs):
    return _pipeline(packing=Packer(max_tokens=12, slicing=True, chunk_cost=CHUNK_COST), **kwargs)


@pytest.mark.parametrize("recompute", [None, "full"])
def test_gpt_example_workload_balanced_chunks_parity(recompute):
    """Slices of equal time (the first longest), tails packed with short sequences into hybrid chunks:
    the tail's tokens see its earlier slices, the packed sequences only themselves."""
    batches = padded_lm_batches(STEPS, batch_size=8, max_len=24, seed=1)
    plans = [chunk_pieces(b["attention_mask"].sum(1).tolist(), CHUNK_COST, 12) for b in batches]
    hybrid = [g for pieces, _ in plans for g in pieces if len(g) > 1 and g[0][1] > 0]
    assert hybrid, "the batches should give hybrid chunks"
    _parity(_gpt, batches, _chunks(recompute=recompute))


def test_transformers_llama_workload_balanced_chunks_parity():
    pytest.importorskip("transformers")
    batches = padded_lm_batches(STEPS, batch_size=8, max_len=24, seed=1)
    _parity(lambda: LlamaOnBatch().double(), batches, _chunks(), atol=HF_ATOL)


def test_sliced_parity_on_four_stages():
    """Sliced 1F1B with a deeper pipeline: three extra warm-up forwards per rank, slices of three sequences."""
    batches = padded_lm_batches(STEPS, batch_size=6, max_len=20)
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=4, start_method=START_METHOD, packing=Packer(max_tokens=8, slicing=True)
    )
    pipelined = fit(_gpt, batches, strategy, devices=4, steps=STEPS)
    reference = fit(_gpt, reference_batches(batches, 1), steps=STEPS)
    assert_same_parameters(pipelined, reference, atol=1e-10)


@pytest.mark.parametrize("packing", [True, Packer(max_tokens=8, slicing=True)], ids=["packing", "slicing"])
def test_validation_logs_the_token_mean_of_one_device(packing):
    from torch.utils.data import DataLoader

    from tests.helpers.training import BatchDataset

    batches = padded_lm_batches(2, batch_size=6, max_len=20, seed=4)
    L.seed_everything(SEED, verbose=False)
    model = _gpt()
    options = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, precision="64-true")
    pipelined = L.Trainer(devices=2, strategy=_pipeline(packing=packing), **options).validate(
        model, DataLoader(BatchDataset(batches), batch_size=None), verbose=False
    )
    single = L.Trainer(devices=1, **options).validate(model, DataLoader(BatchDataset(batches), batch_size=None), verbose=False)
    assert pipelined[0]["val_loss"] == pytest.approx(single[0]["val_loss"], abs=1e-10, rel=0)


# --- adaptive checkpointing per (stage, chunk) ----------------------------------------------------


class _HalfwayBudget(L.Callback):
    """On the first batch (before ``MemoryPlanner``): probe, and set the budget halfway between the
    predicted peaks of the batch's chunks with full recompute and with none, so that it binds. Every
    rank computes the same (the probe's records are shared across the pipeline). Records per step the
    plan, the accounted peak and the no-recompute peak of that batch's chunks."""

    def __init__(self, planner, directory) -> None:
        self.planner, self.directory = planner, directory

    def _peak(self, trainer, batch, plan):
        from lightning_pipe.planning.memory_model import predict_memory

        memory = trainer.strategy.memory
        shapes = memory.microbatch_shapes(batch)
        program = memory._program_for_split(batch, None, len(shapes))
        args = (program, trainer.strategy.boundaries, shapes, plan, memory.profile)
        return max(predict_memory(*args, chunks=memory.chunk_memory(batch)).peak_bytes)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_pipe.planning.memory_model import MemoryPlan

        memory = trainer.strategy.memory
        if memory.profile is None:
            memory.measure_profile(batch, (batch_idx,))
            none, full = self._peak(trainer, batch, MemoryPlan()), self._peak(trainer, batch, MemoryPlan.from_options("full"))
            self.budget = (full + 0.5 * (none - full)) / (1 - memory.planning_margin)
            if self.planner is not None:
                self.planner.budget = self.budget
            memory.set_budget(self.budget)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import json

        from lightning_pipe.planning.memory_model import MemoryPlan

        memory, rank = trainer.strategy.memory, trainer.strategy.layout.pipeline_rank
        row = {
            "plan": memory.plan.to_dict()["microbatches"], "chunks": trainer.strategy.split_batch(batch).plan.num_microbatches,
            "accounted": memory.last_step.static_bytes + memory.last_step.peak_saved_bytes,
            "none_peak": self._peak(trainer, batch, MemoryPlan()), "budget": self.budget,
        }
        with open(self.directory / f"rank{rank}.txt", "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("planner", ["MemoryPlanner", "recompute='auto'"])
def test_memory_plans_per_chunk_under_a_binding_budget(tmp_path, planner):
    """InfiniPipe's adaptive checkpointing: per (stage, chunk) recompute/offload from each chunk's own
    length and its slice's stored keys and values, planned for every batch's chunks (sliced 1F1B),
    under a budget below the no-recompute peak, by the MemoryPlanner callback or by
    `recompute='auto'` (which plans every packed batch); parameters equal one device."""
    import json

    from lightning_pipe.callbacks import MemoryPlanner
    from tests.helpers.loop import rank_files

    batches = padded_lm_batches(STEPS, batch_size=8, max_len=24, seed=1)
    if planner == "MemoryPlanner":
        callback = MemoryPlanner(budget="1GiB")  # replaced on the first batch by the halfway budget
        _parity(_gpt, batches, _chunks(), callbacks=[_HalfwayBudget(callback, tmp_path), callback])
    else:
        _parity(_gpt, batches, _chunks(recompute="auto", memory_budget="1GiB"), callbacks=[_HalfwayBudget(None, tmp_path)])
    records = {rank: [json.loads(line) for line in text.splitlines()] for rank, text in rank_files(tmp_path).items()}
    for rows in records.values():
        assert len(rows) == STEPS
        for row in rows:
            assert row["accounted"] <= row["budget"]
        binding = [row for row in rows if row["none_peak"] > row["budget"]]
        assert binding  # at least one batch needs the plan
        for row in binding:
            planned = {key for key, choice in row["plan"].items() if choice["full"] or choice["keep_attention"] or choice["offload"]}
            chunks = {f"{stage},{mb}" for stage in (0, 1) for mb in range(row["chunks"])}
            assert planned and planned != chunks  # some (stage, chunk) pairs recompute, others keep everything
    assert len({json.dumps(row["plan"], sort_keys=True) for row in records[0]}) > 1  # a plan per batch


def test_sliced_chunks_with_optimizer_offload_parity():
    """SPipe's per-stage host optimizers step once a stage's last chunk is back, also when slices run
    their backwards last slice first (AdamW of the GPT example); the weights are the rows' counted
    targets, given up front (the default, counted after the forwards, is refused before training)."""
    with pytest.raises(ValueError, match=r"cannot weight them. Pass `loss_weights=lambda mb: \(mb\['shift_labels'\]"):
        _chunks(optimizer_offload=True)
    batches = padded_lm_batches(STEPS, batch_size=8, max_len=24, seed=1)
    targets = lambda mb: (mb["shift_labels"] != -100).sum()
    _parity(_gpt, batches, _chunks(optimizer_offload=True, loss_weights=targets))


def test_packing_with_data_parallel_equals_ddp():
    """pp=2 x dp=2: each replica packs its own batch (its sequences into its own rows) and averages
    over its own counted targets, as Lightning's DDP on the padded batches does."""
    batches = padded_lm_batches(2 * STEPS, batch_size=6, max_len=16, seed=11)
    strategy = ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=3, start_method=START_METHOD, packing=Packer(max_tokens=20)
    )
    pipelined = fit(_gpt, batches, strategy, devices=4, steps=STEPS)
    ddp = fit(_gpt, batches, "ddp_fork", devices=2, steps=STEPS)
    assert_same_parameters(pipelined, ddp, atol=1e-10)


def test_chunks_proposed_in_the_plan_are_what_runs(tmp_path):
    """The chunking is the plan's microbatching part: a planner proposes Algorithm 1's chunks for the
    coming batch (N = 4 slices for the longest; the packer alone, with a budget of 24 tokens, would
    slice nothing), the step runs exactly those (sliced 1F1B), the memory planner plans for them,
    and parameters equal one device."""
    import json

    from lightning_pipe.callbacks import MemoryPlanner
    from lightning_pipe.planning.chunking import PlannedChunks, chunk_batch
    from lightning_pipe.planning.proposals import PlanProposal
    from tests.helpers.loop import rank_files

    class ProposeChunks(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            lengths = batch["attention_mask"].sum(1).tolist()
            self.chunks = PlannedChunks.from_plan(chunk_batch(lengths, 4, CHUNK_COST), lengths)
            trainer.strategy.propose(PlanProposal("ProposeChunks", chunks=self.chunks))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            strategy = trainer.strategy
            row = {
                "ran": [list(map(list, g)) for g in strategy.split_batch(batch).plan.pieces],
                "proposed": [list(map(list, g)) for g in self.chunks.pieces], "sliced": self.chunks.is_sliced,
                "in_plan": strategy.plan.chunks == self.chunks,
                "planned_for": len(strategy.memory.microbatch_shapes(batch)),
            }
            with open(tmp_path / f"rank{strategy.layout.pipeline_rank}.txt", "a") as f:
                f.write(json.dumps(row) + "\n")

    batches = padded_lm_batches(STEPS, batch_size=8, max_len=24, seed=1)
    callbacks = [ProposeChunks(), MemoryPlanner(budget="1GiB")]
    _parity(_gpt, batches, _pipeline(packing=Packer(max_tokens=24, slicing=True)), callbacks=callbacks)
    for text in rank_files(tmp_path).values():
        rows = [json.loads(line) for line in text.splitlines()]
        assert len(rows) == STEPS
        for row in rows:
            assert row["ran"] == row["proposed"] and row["in_plan"] and row["sliced"]
            assert row["planned_for"] == len(row["proposed"])
    assert all(not Packer(max_tokens=24, slicing=True).plan(b, 3).is_sliced for b in batches)


def test_sequence_grouping_runs_consecutive_pipelines_with_their_own_plans(tmp_path):
    """InfiniPipe §3.3.2: `SequenceGrouper` turns every batch into Algorithm 1's chunks grouped into
    consecutive 1F1B pipelines by Eq. 14's dynamic program under a budget between the full- and
    no-recompute peaks, each pipeline with its own per-(stage, chunk) checkpointing plan; the step runs
    the pipelines one after the other within one optimizer step (gradients accumulate across them)
    and parameters equal one device."""
    import json

    from lightning_pipe.callbacks import SequenceGrouper
    from lightning_pipe.planning.gpt import gpt_cost_model
    from tests.helpers.loop import rank_files

    grouper = SequenceGrouper(gpt_cost_model(4, 16, 2, 64), budget=150_000, num_slices=4)  # the example's size

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            strategy, found = trainer.strategy, grouper.results[-1]
            ran = strategy.split_batch(batch).plan
            row = {
                "pipelines": list(ran.pipelines or ()), "planned": list(found.chunks.pipelines or ()),
                "ran": [list(map(list, g)) for g in ran.pieces],
                "proposed": [list(map(list, g)) for g in found.chunks.pieces],
                "memory": found.memory is not None and strategy.plan.memory == found.memory,
                "recomputed": sorted({m for (_, m), c in found.memory.microbatches.items() if not c.is_default}),
                "planning_seconds": found.planning_seconds,
                # the program the step ran: the sliced 1F1B built for these pipelines (one flush between them)
                "program": [
                    list(key[2]) for key in strategy._short_programs
                    if isinstance(key, tuple) and key[:2] == ("sliced", ran.slices) and key[2] == ran.pipelines
                ],
            }
            with open(tmp_path / f"rank{strategy.layout.pipeline_rank}.txt", "a") as f:
                f.write(json.dumps(row) + "\n")

    batches = padded_lm_batches(STEPS, batch_size=8, max_len=24, seed=1)
    _parity(_gpt, batches, _pipeline(packing=Packer(max_tokens=24, slicing=True)), callbacks=[grouper, Record()])
    per_rank = [[json.loads(line) for line in text.splitlines()] for text in rank_files(tmp_path).values()]
    # one rank solved and sent its result (a time-limited MILP may end differently elsewhere)
    assert len(per_rank) == 2 and [r["planning_seconds"] for r in per_rank[0]] == [r["planning_seconds"] for r in per_rank[1]]
    for rows in per_rank:
        assert len(rows) == STEPS
        for row in rows:
            assert len(row["pipelines"]) > 1 and row["pipelines"] == row["planned"]
            assert row["ran"] == row["proposed"] and row["memory"] and row["program"] == [row["pipelines"]]
            assert row["recomputed"] and len(row["recomputed"]) < len(row["ran"])  # some chunks recompute, not all
