"""Each microbatch at its own length: padded batches are cut to each microbatch's real tokens.

Parity in float64 against one device on the whole padded batch (transformers Llama and GPT-2,
right and left padding, samples grouped by length), and the check that refuses to cut where the
model's result depends on the padding (positions numbered over the padded length, a mean over
every position) and runs those uncut, still exact.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, reference_batches

pytest.importorskip("transformers")
from tests.helpers.hf_models import HFCausalLM  # noqa: E402

STEPS = 3
HF_ATOL = 1e-7  # transformers' loss is float32 inside a float64 model (tests/strategies/test_real_models.py)


class RecordMicrobatches(L.Callback):
    """Global rank 0 writes, per step, the length each microbatch ran at and the checks' verdicts."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        if trainer.global_rank == 0:
            plan = strategy.split_batch(batch, train=True).plan
            verdicts = {str(k): [v.exact, v.reason] for k, v in strategy.trim_verdicts.items()}
            with open(self.path, "a") as f:
                f.write(json.dumps({"lengths": plan.lengths, "order": plan.order, "verdicts": verdicts}) + "\n")
        if trainer.global_rank == trainer.world_size - 1:  # the last stage probes the blocks before it
            with open(f"{self.path}.probes", "a") as f:
                f.write(f"{strategy.runner.probes}\n")


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def padded_batches(
    lengths: list[list[int]], side: str = "right", positions: bool = False, label_first: bool = True, vocab: int = 64
) -> list[dict]:
    """One batch per list of real lengths, padded to its longest on ``side``; optionally with
    ``position_ids`` counting from each sample's first real token, and the first token unlabelled."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for real in lengths:
        T = max(real)
        mask = torch.zeros(len(real), T, dtype=torch.long)
        for i, n in enumerate(real):
            if side == "right":
                mask[i, :n] = 1
            else:
                mask[i, T - n :] = 1
        ids = torch.randint(1, vocab, (len(real), T), generator=generator).masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        if not label_first:
            labels[torch.arange(len(real)), mask.argmax(dim=1)] = -100
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if positions:
            batch["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
        batches.append(batch)
    return batches


LENGTHS = [[12, 3, 5, 2, 9, 4, 2, 7], [6, 14, 2, 3, 3, 8, 5, 2], [4, 4, 11, 2, 6, 3, 9, 2]]


def _strategy(schedule="1f1b", stages=2, **kwargs) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=stages, num_microbatches=4, schedule=schedule, start_method=START_METHOD, **kwargs
    )


def _parity(make, batches, strategy, path, atol, devices=2):
    steps = len(batches)
    pipelined = fit(make, batches, strategy, devices=devices, steps=steps, callbacks=[RecordMicrobatches(path)])
    reference = fit(make, reference_batches(batches, 1), steps=steps)
    assert_same_parameters(pipelined, reference, atol=atol)
    return _records(path)


@pytest.mark.parametrize(("family", "schedule"), [("llama", "1f1b"), ("gpt2", "zbv")])
def test_right_padding_is_cut_per_microbatch_and_exact(tmp_path, family, schedule):
    records = _parity(
        lambda: HFCausalLM(family, layers=4).double(), padded_batches(LENGTHS), _strategy(schedule),
        tmp_path / "mb.jsonl", HF_ATOL,
    )
    first = records[0]
    assert all(v[0] for v in first["verdicts"].values()) and len(first["verdicts"]) == 1
    # grouped by length, longest first (12 9 7 5 4 3 2 2), sized 1, 1, 2, 4 so that the two longest do
    # not run together (padded positions 12 + 9 + 14 + 16, plus the heaviest once more for the second
    # stage: 67, where even pairs give 24 + 14 + 8 + 4 + 24 = 74): microbatches at 12, 9, 7 and 4 positions
    assert first["lengths"] == [None, 9, 7, 4]
    assert first["order"] == [0, 4, 7, 2, 5, 1, 3, 6]


def test_without_grouping_each_microbatch_keeps_its_longest(tmp_path):
    records = _parity(
        lambda: HFCausalLM("llama", layers=4).double(), padded_batches(LENGTHS),
        _strategy(group_by_length=False), tmp_path / "mb.jsonl", HF_ATOL,
    )
    assert records[0]["order"] is None and records[0]["lengths"] == [None, 5, 9, 7]


def test_left_padding_with_positions_from_the_batch_is_cut(tmp_path):
    """transformers shifts labels inside the model: with left padding the last pad's logit predicts
    the first real token, which a cut microbatch no longer has (the check sees that too). Unlabelled
    first tokens and positions from the batch make cutting exact."""
    records = _parity(
        lambda: HFCausalLM("llama", layers=4, positions=True).double(),
        padded_batches(LENGTHS, "left", positions=True, label_first=False),
        _strategy(), tmp_path / "mb.jsonl", HF_ATOL,
    )
    assert all(v[0] for v in records[0]["verdicts"].values()) and records[0]["lengths"] == [None, 9, 7, 4]


def test_left_padding_with_positions_from_arange_is_detected_and_runs_uncut(tmp_path):
    """Llama numbers positions 0..T-1 over the padded length when the batch gives none: cutting the
    left padding would move every real token's position. The check sees it; training stays exact."""
    records = _parity(
        lambda: HFCausalLM("llama", layers=4).double(), padded_batches(LENGTHS, "left"), _strategy(),
        tmp_path / "mb.jsonl", HF_ATOL,
    )
    (exact, reason), = records[0]["verdicts"].values()
    assert not exact and "differs at the real tokens" in reason
    assert all(r["lengths"] == [None] * 4 and r["order"] is None for r in records)


class MeanPooledClassifier(L.LightningModule):
    """Averages the hidden states over every position, padding included (a real bug of the model,
    but its result is what one device computes, so the pipeline must compute it too)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=1))
        return nn.functional.cross_entropy(logits, batch["input_ids"][:, 0] % 3)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def test_a_mean_over_padded_positions_is_detected_and_runs_uncut(tmp_path):
    records = _parity(lambda: MeanPooledClassifier().double(), padded_batches(LENGTHS), _strategy(), tmp_path / "mb.jsonl", 1e-10)
    (exact, reason), = records[0]["verdicts"].values()
    assert not exact and "returns" in reason
    assert all(r["lengths"] == [None] * 4 for r in records)


def test_llama_trained_with_a_lookahead_planner_runs_the_planners_cut_and_stays_exact(tmp_path):
    """The planner splits the next padded batch while this one trains; the step then runs that split
    (the same tensors in the container Lightning moved them in), cut to each microbatch's real tokens."""
    from lightning_pipe.callbacks import ElasticRepartition

    steps = len(LENGTHS)
    pipelined = fit(
        lambda: HFCausalLM("llama", layers=4).double(), padded_batches(LENGTHS), _strategy(), devices=2, steps=steps,
        callbacks=[ElasticRepartition(), RecordMicrobatches(tmp_path / "mb.jsonl")],
    )
    reference = fit(lambda: HFCausalLM("llama", layers=4).double(), reference_batches(padded_batches(LENGTHS), 1), steps=steps)
    assert_same_parameters(pipelined, reference, atol=HF_ATOL)
    records = _records(tmp_path / "mb.jsonl")
    assert all(v[0] for v in records[0]["verdicts"].values())
    assert all(r["lengths"][1:] != [None] * 3 for r in records)  # every batch ran cut


def test_a_split_a_planner_made_before_the_verdict_is_not_run(tmp_path):
    """A lookahead planner splits the next batch (cut to its real tokens) while the first batch has
    not been checked yet; the step reuses such splits (the same tensors in a new container), so
    when the check then refuses cutting, they must be made again, uncut."""
    from lightning_pipe.callbacks import ElasticRepartition

    steps = len(LENGTHS)
    pipelined = fit(
        lambda: MeanPooledClassifier().double(), padded_batches(LENGTHS), _strategy(), devices=2, steps=steps,
        callbacks=[ElasticRepartition(), RecordMicrobatches(tmp_path / "mb.jsonl")],
    )
    reference = fit(lambda: MeanPooledClassifier().double(), reference_batches(padded_batches(LENGTHS), 1), steps=steps)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    records = _records(tmp_path / "mb.jsonl")
    assert all(r["lengths"] == [None] * 4 for r in records)


def test_trim_padding_false_keeps_every_microbatch_whole(tmp_path):
    records = _parity(
        lambda: HFCausalLM("llama", layers=4).double(), padded_batches(LENGTHS), _strategy(trim_padding=False),
        tmp_path / "mb.jsonl", HF_ATOL,
    )
    assert all(r["lengths"] == [None] * 4 and not r["verdicts"] for r in records)


def test_four_stages_learn_the_shapes_of_new_lengths_instead_of_probing(tmp_path):
    """Six batches, every microbatch at its own length: later stages predict the shapes of the blocks
    before them from two probes (model/shape_rules.py), activations carry their sizes; exact."""
    lengths = [[3 + (7 * k + 5 * i) % 13 for i in range(8)] for k in range(6)]
    path = tmp_path / "mb.jsonl"
    records = _parity(
        lambda: HFCausalLM("llama", layers=4).double(), padded_batches(lengths), _strategy(stages=4), path,
        HF_ATOL, devices=4,
    )
    distinct = {n for r in records for n in r["lengths"] if n is not None}
    assert len(distinct) >= 6
    probes = [int(line) for line in open(f"{path}.probes")]
    # the last stage runs block 3 and probes blocks 0-2; without rules that is 3 probes per new length
    assert probes[-1] < 3 * len(distinct)
