"""HelixPipe (``schedule="helix"``) and SPipe (``schedule="spipe"``) through ``Trainer``: an unchanged
LightningModule trains on 2 gloo processes to the parameters of one device (float64, AdamW), with its
``self.log`` calls replayed, token-averaged losses weighted, gradients clipped and accumulated."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from examples.gpt.model import GPT
from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.hf_models import lm_batches
from tests.helpers.loop import loader, rank_files, run, started_outside
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches, token_batches

SPIPE = {"name": "spipe", "stages_per_rank": 1, "backward_split": 2}  # 2 ranks x 1 x 2 = 4 stages of one block


def _gpt() -> GPT:
    return GPT(vocab_size=32, block_size=32, n_layer=4, n_head=2, n_embd=16, learning_rate=0.01).double()


def _strategy(schedule, **kwargs) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, start_method=START_METHOD, **kwargs
    )


class _RealParameters(Callback):
    """Writes, in every process, the names of the parameters it holds (not on the meta device)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_end(self, trainer, pl_module) -> None:
        names = [n for n, p in pl_module.named_parameters() if not p.is_meta]
        (self.directory / f"rank{trainer.global_rank}.txt").write_text("\n".join(names))


@pytest.mark.parametrize("schedule", ["helix", SPIPE], ids=["helix", "spipe"])
def test_gpt_trains_as_on_one_device(tmp_path, schedule):
    """AdamW, global-norm clipping, two batches accumulated per step, a token-mean loss over padded batches
    (weighted by counted targets), a validation run; the logged losses are one device's. helix keeps on
    each rank only the parameters of its sub-block units and runs its MLPs in chunks; spipe keeps every
    parameter, in shared memory."""
    batches = lm_batches(4, 8, [12, 9], vocab=32, padding="variable")  # microbatches count different targets
    val = lm_batches(1, 8, [7], vocab=32, padding="variable", seed=5)
    kwargs = dict(steps=2, gradient_clip_val=0.05, accumulate_grad_batches=2, val_batches=val, val_check_interval=2)
    (tmp_path / "held").mkdir()
    chunked = {"mlp_chunk_size": 4} if schedule == "helix" else {}  # HelixPipe's chunked MLP: lengths 12 and 9
    pipelined = fit(
        _gpt, batches, _strategy(schedule, **chunked), devices=2, log_dir=tmp_path / "pipe",
        callbacks=[_RealParameters(tmp_path / "held")], **kwargs,
    )
    reference = fit(_gpt, batches, log_dir=tmp_path / "one", **kwargs)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    assert not torch.equal(reference.lm_head.weight, _gpt().lm_head.weight)
    for name in ("train_loss", "val_loss"):
        got, want = logged(tmp_path / "pipe", name), logged(tmp_path / "one", name)
        assert len(got) == len(want) >= 1
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-10, rtol=0)
    held = [set(text.split()) for _, text in sorted(rank_files(tmp_path / "held").items())]
    everything = {n for n, _ in reference.named_parameters()}
    if schedule == "helix":  # block l's pre-attention on rank l mod 2, its post-attention on the next rank
        assert held[0] | held[1] == everything and not held[0] & held[1]
        assert {"wte.weight", "lm_head.weight", "blocks.0.attn.c_attn.weight", "blocks.1.mlp.c_fc.weight"} <= held[0]
        assert {"blocks.1.attn.c_attn.weight", "blocks.0.attn.c_proj.weight", "blocks.0.mlp.c_fc.weight"} <= held[1]
    else:
        assert held == [everything, everything]


@pytest.mark.parametrize("schedule", ["helix", SPIPE], ids=["helix", "spipe"])
def test_transformers_llama_with_padding_trains_as_on_one_device(schedule):
    """transformers' Llama (rotary, grouped-query attention, a causal mask with padding, two lengths) cut at
    its attention call (helix) or in whole blocks (spipe), with transformers' own loss.

    1e-7, as for every schedule in test_real_models.py: Llama computes its loss and RMSNorm in float32
    even in a float64 model, so two correct runs of different microbatch shapes round apart by ~2e-9
    (1F1B alike); a wrong token weighting is off by ~1e-2."""
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import HFCausalLM, lm_batches

    batches = lm_batches(2, 8, [10, 7], padding="variable")
    make = lambda: HFCausalLM("llama", layers=4).double()  # noqa: E731
    pipelined = fit(make, batches, _strategy(schedule), devices=2, steps=2)
    reference = fit(make, batches, steps=2)
    assert_same_parameters(pipelined, reference, atol=1e-7)


@pytest.mark.parametrize(("writer", "reader"), [("helix", SPIPE), (SPIPE, "helix")], ids=["helix-to-spipe", "spipe-to-helix"])
def test_sharded_checkpoint_resumes_exactly(tmp_path, writer, reader):
    """A sharded checkpoint written at step 2 (helix: every rank the whole state; spipe: the module once,
    each optimizer entry by its owner) resumes under the other family to one device's step 4."""
    batches = lm_batches(2, 8, [12, 9], vocab=32, padding="variable")  # one epoch = two steps
    saved = tmp_path / "saved"
    run(_gpt, batches, _strategy(writer), devices=2, max_steps=2, callbacks=[ModelCheckpoint(saved, every_n_train_steps=2)])
    path = saved / "epoch=0-step=2.ckpt"
    assert path.is_dir()  # sharded (the default)
    resumed, _, _ = run(_gpt, batches, _strategy(reader), devices=2, max_steps=4, ckpt_path=str(path))
    reference, _, _ = run(_gpt, batches, max_steps=4)
    assert_same_parameters(resumed, reference, atol=1e-10)


def test_what_split_placement_cannot_do_is_refused_before_training():
    """Arguments at construction; the model's sizes and data parallelism in the main process, before any
    rank starts."""
    with pytest.raises(ValueError, match="start_method='fork'"):
        ElasticPipelineStrategy(schedule="spipe")  # popen: each process would hold its own parameters
    with pytest.raises(ValueError, match="does not support `recompute='full'`"):
        ElasticPipelineStrategy(schedule="helix", recompute="full")
    with pytest.raises(ValueError, match="places blocks by its own rule"):
        ElasticPipelineStrategy(schedule="helix", partition=[1, 3])
    with pytest.raises(ValueError, match="unknown \\['layers_per_rank'\\]"):
        ElasticPipelineStrategy(schedule={"name": "helix", "layers_per_rank": 2})
    cases = [
        (dict(n_layer=3), 2, dict(schedule="helix"), "multiple of the pipeline ranks: 3 blocks on 2 ranks"),
        (dict(n_layer=4), 2, dict(schedule="helix", num_microbatches=6), "`num_microbatches=6` is not a multiple"),
        (dict(n_layer=4), 4, dict(schedule=SPIPE, optimizer_offload=True), "does not support data parallelism"),
    ]
    for model_options, devices, strategy_options, message in cases:
        options = dict(vocab_size=32, block_size=32, n_head=2, n_embd=16) | model_options
        strategy = ElasticPipelineStrategy(
            **{"pipeline_parallel_size": 2, "num_microbatches": 4, "start_method": START_METHOD, **strategy_options}
        )
        with pytest.raises(ValueError, match=message):
            fit(lambda: GPT(**options), lm_batches(1, 8, [5], vocab=32), strategy, devices=devices, steps=1)
    from lightning_pipe.callbacks import ElasticRepartition

    # raised at setup on every rank (the callbacks are known there), before any step
    with pytest.raises(Exception, match="planning callbacks \\['ElasticRepartition'\\] cannot change"):
        fit(_gpt, lm_batches(1, 8, [5], vocab=32), _strategy("helix"), devices=2, steps=1, callbacks=[ElasticRepartition()])


def test_spipe_with_its_asynchronous_stage_optimizers_trains_as_on_one_device():
    """``optimizer_offload=True``: each stage's AdamW steps on a host thread of the rank of its backward as
    soon as its gradients are final, while the backward goes on, and writes into the shared parameters."""
    batches = token_batches(3, 8, 12)
    pipelined = fit(_gpt, batches, _strategy(SPIPE, optimizer_offload=True), devices=2, steps=3)
    reference = fit(_gpt, batches, steps=3)
    assert_same_parameters(pipelined, reference, atol=1e-10)


class _SlowStepOnRankZero(Callback):
    """Global rank 0 steps its optimizer late: a process reading shared parameters before every owner's
    update is complete (the next forward, the state gathered at the end) would read old values."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_rank == 0:
            time.sleep(0.5)


@pytest.mark.parametrize("schedule", ["helix", SPIPE], ids=["helix", "spipe"])
def test_two_replicas_of_two_ranks_train_as_on_one_device(schedule):
    """4 processes, pp=2 x dp=2: each replica's pipeline runs the program, gradients are averaged over the
    replicas after the pipeline's sum (spipe: one process of the machine steps each shared parameter,
    and every process waits for all updates before reading them again)."""
    batches = token_batches(4, 4, 10)
    pipelined = fit(_gpt, batches, _strategy(schedule), devices=4, steps=2, callbacks=[_SlowStepOnRankZero()])
    reference = fit(_gpt, reference_batches(batches, 2), steps=2)
    assert_same_parameters(pipelined, reference, atol=1e-10)


def test_helix_keeps_the_module_whole_where_a_parameter_would_be_needed_on_two_ranks(monkeypatch, tmp_path):
    """The fallback of a model whose units share a parameter across ranks (forced here: the ranks fork from
    this process): every rank keeps every parameter, gradients are summed over the pipeline, clipping uses
    the whole norm."""
    from lightning_pipe.strategies import split_step

    monkeypatch.setattr(split_step, "helix_holdings", lambda *args: None)
    batches = token_batches(2, 8, 12)
    (tmp_path / "held").mkdir()
    pipelined = fit(
        _gpt, batches, _strategy("helix"), devices=2, steps=2, gradient_clip_val=0.05,
        callbacks=[_RealParameters(tmp_path / "held")],
    )
    reference = fit(_gpt, batches, steps=2, gradient_clip_val=0.05)
    assert_same_parameters(pipelined, reference, atol=1e-10)
    everything = {n for n, _ in reference.named_parameters()}
    assert [set(text.split()) for _, text in sorted(rank_files(tmp_path / "held").items())] == [everything] * 2


def test_helix_predicts_through_the_pipeline_after_training(tmp_path):
    """A script that trains then predicts in the same processes: the helix module, cut and sharded by
    training (each rank holds only its units' parameters), predicts what one device predicts."""
    import subprocess
    import sys

    from tests.helpers import fit_then_predict

    repo = Path(__file__).resolve().parents[2]
    outputs = {}
    for mode in ("pipe", "one"):
        (tmp_path / mode).mkdir()
        if mode == "one":
            # The one-device reference starts no process, so it runs the same script's `main` here:
            # a fresh interpreter would only add Lightning's import (about 6 s on 2 cores).
            fit_then_predict.main(tmp_path / mode, mode)
        else:
            done = subprocess.run(
                [sys.executable, "-m", "tests.helpers.fit_then_predict", str(tmp_path / mode), mode],
                cwd=repo, capture_output=True, text=True, timeout=240, check=False,
            )
            assert done.returncode == 0, done.stderr[-3000:]
        outputs[mode] = torch.load(tmp_path / mode / "predictions.pt")
    not_held = [int(text) for _, text in sorted(rank_files(tmp_path / "pipe" / "held").items())]
    assert len(not_held) == 2 and min(not_held) > 0  # sharded: neither rank holds every parameter
    assert [p.shape for p in outputs["pipe"]] == [p.shape for p in outputs["one"]] == [(4, 7, 32), (4, 11, 32)]
    for got, want in zip(outputs["pipe"], outputs["one"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def _one_then_another_in_place(rank: int, init_file: str, out_dir: str, first: str, second: str) -> None:
    """Processes started outside Lightning: fit under ``first``, then a new Trainer validates the same
    module under ``second``; writes the error the second call raised (or "none")."""
    import lightning as L

    def trainer(schedule: str) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            strategy=ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=4, schedule=schedule),
        )

    with started_outside(rank, init_file):
        model, batches = _gpt(), loader(lm_batches(1, 8, [5], vocab=32))
        trainer(first).fit(model, batches)
        try:
            trainer(second).validate(model, batches)
            error = "none"
        except RuntimeError as raised:
            error = str(raised)
        Path(out_dir, f"rank{rank}.txt").write_text(error)


@pytest.mark.parametrize(("first", "second", "message"), [
    ("helix", "1f1b", "cut by a split placement"),
    ("1f1b", "helix", "sharded by another pipeline"),
])
def test_a_module_cut_by_one_placement_is_refused_by_another_in_the_same_processes(tmp_path, first, second, message):
    """Each rank holds only its own units after a fit; a split placement's cut and a pipeline's stages
    cannot be gathered into each other, so the second Trainer refuses on every rank (instead of running
    on the parameters it does not hold, allocated uninitialized)."""
    import torch.multiprocessing as mp

    arguments = (str(tmp_path / "init"), str(tmp_path), first, second)
    mp.start_processes(_one_then_another_in_place, args=arguments, nprocs=2, join=True, start_method=START_METHOD)
    errors = rank_files(tmp_path)
    assert sorted(errors) == [0, 1] and all(message in error for error in errors.values()), errors
