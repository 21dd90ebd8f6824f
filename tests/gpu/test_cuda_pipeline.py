"""The pipeline on a CUDA device: 2 ranks sharing one GPU (``ranks_per_device=2``, gloo, activations
staged through host memory) against one CUDA process of the same module on the same data."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import PipelineMonitor
from tests.helpers.callbacks import RandomPlans
from tests.helpers.gpu import DEVICE, max_parameter_difference, record, requires_cuda
from tests.helpers.models import TinyGPT
from tests.helpers.training import fit, logged, reference_batches, token_batches

pytestmark = [pytest.mark.gpu, requires_cuda]

STEPS = 3
BATCHES = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])


def _pipeline(schedule: str = "1f1b", **options) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=4, schedule=schedule, start_method="spawn", ranks_per_device=2, **options
    )


def _pair(tmp_path, make, strategy, precision="64-true", callbacks=()):
    pipelined = fit(
        make, BATCHES, strategy, devices=1, accelerator=DEVICE, steps=STEPS, precision=precision,
        log_dir=tmp_path / "pipe", callbacks=list(callbacks),
    )
    reference = fit(
        make, reference_batches(BATCHES, 1), devices=1, accelerator=DEVICE, steps=STEPS, precision=precision,
        log_dir=tmp_path / "ref",
    )
    return pipelined, reference


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_float64_parity_on_one_gpu(tmp_path, schedule):
    pipelined, reference = _pair(tmp_path, lambda: TinyGPT(layers=4).double(), _pipeline(schedule))
    difference = max_parameter_difference(pipelined, reference)
    record(f"float64 parity {schedule}, max |param diff|", difference)
    assert difference < 1e-10
    assert max_parameter_difference(reference, TinyGPT(layers=4).double()) > 1e-3  # training moved them


def test_float64_parity_with_repartitioning_every_step(tmp_path):
    callbacks = [RandomPlans(["1f1b", "zbv"], seed=3), PipelineMonitor(timeline_every_n_steps=0)]
    pipelined, reference = _pair(tmp_path, lambda: TinyGPT(layers=6).double(), _pipeline(), callbacks=callbacks)
    difference = max_parameter_difference(pipelined, reference)
    record("float64 parity, random partition and schedule every step, max |param diff|", difference)
    assert difference < 1e-10
    assert logged(tmp_path / "pipe", "moved_bytes")[-1] > 0  # units really moved between the ranks


def test_float32_parity_within_rounding(tmp_path):
    """Microbatches change the reduction order of float32 kernels: equal to rounding, stated here.

    SGD with momentum, not AdamW: Adam's first steps move every parameter by about ``lr`` whatever
    its gradient's size, so a gradient that is rounding noise would turn into an ``lr``-sized
    difference and say nothing about the pipeline."""
    make = lambda: TinyGPT(layers=4, optimizer="sgd")
    pipelined, reference = _pair(tmp_path, make, _pipeline(), precision="32-true")
    difference = max_parameter_difference(pipelined, reference)
    record("float32 parity 1f1b, max |param diff| after 3 SGD steps (lr 1e-2, momentum 0.9)", difference)
    assert difference < 1e-5
    losses = logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss")
    torch.testing.assert_close(*losses, rtol=1e-5, atol=1e-5)


def test_bf16_mixed_loss_curve(tmp_path):
    """bf16 autocast: the activation messages carry bfloat16 (dtype headers); losses track one process.
    SGD, so that parameters differ by what bf16 rounding does to the gradients (Adam would make
    rounding-level gradients move by ``lr``)."""
    make = lambda: TinyGPT(layers=4, optimizer="sgd")  # noqa: E731
    pipelined, reference = _pair(tmp_path, make, _pipeline("zbv"), precision="bf16-mixed")
    pipe, ref = logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss")
    worst = max(abs(a - b) / abs(b) for a, b in zip(pipe, ref, strict=True))
    record("bf16-mixed zbv, max relative loss difference per step", worst)
    assert len(pipe) == STEPS and worst < 2e-2
    difference = max_parameter_difference(pipelined, reference)
    record("bf16-mixed zbv, max |param diff| after 3 SGD steps", difference)
    assert difference < 1e-3


def test_activation_offload_and_recompute_are_bit_exact(tmp_path):
    """Saved activations through pinned host buffers on a side stream, and recompute, change nothing."""
    make = lambda: TinyGPT(layers=4).double()
    plain = fit(make, BATCHES, _pipeline(), devices=1, accelerator=DEVICE, steps=STEPS)
    offloaded = fit(make, BATCHES, _pipeline(offload=True), devices=1, accelerator=DEVICE, steps=STEPS)
    recomputed = fit(make, BATCHES, _pipeline(recompute="full", offload=1), devices=1, accelerator=DEVICE, steps=STEPS)
    record("offload vs no offload, max |param diff|", max_parameter_difference(offloaded, plain))
    assert max_parameter_difference(offloaded, plain) == 0.0
    assert max_parameter_difference(recomputed, plain) == 0.0


def test_optimizer_offload_parity(tmp_path):
    """SPipe: host optimizers stepping per stage on a thread while the GPU runs the backward."""
    pipelined, reference = _pair(tmp_path, lambda: TinyGPT(layers=4).double(), _pipeline(optimizer_offload=True))
    difference = max_parameter_difference(pipelined, reference)
    record("optimizer offload float64 parity, max |param diff|", difference)
    assert difference < 1e-10


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_transformers_llama_parity_on_one_gpu(tmp_path, schedule):
    """A config-built transformers Llama (grouped-query attention, rotary, right padding with
    varying counted tokens, -100 labels): masks and rotary tables real on every stage, token-averaged
    loss weighted by counted tokens, float64 (the loss itself is float32 inside transformers)."""
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import HFCausalLM, lm_batches

    batches = lm_batches(STEPS, batch_size=4, lengths=[9, 6, 12], padding="variable")
    make = lambda: HFCausalLM("llama", layers=4).double()  # noqa: E731
    pipelined = fit(make, batches, _pipeline(schedule), devices=1, accelerator=DEVICE, steps=STEPS)
    reference = fit(make, reference_batches(batches, 1), devices=1, accelerator=DEVICE, steps=STEPS)
    difference = max_parameter_difference(pipelined, reference)
    record(f"transformers Llama float64 parity {schedule}, max |param diff|", difference)
    assert difference < 1e-6  # transformers' loss is float32 even in a float64 model (tests/strategies/test_real_models.py)


def test_transformers_llama_bf16_mixed_loss_curve(tmp_path):
    pytest.importorskip("transformers")
    from tests.helpers.hf_models import HFCausalLM, lm_batches

    batches = lm_batches(STEPS, batch_size=4, lengths=[9, 6, 12], padding="variable")
    make = lambda: HFCausalLM("llama", layers=4)  # noqa: E731
    fit(make, batches, _pipeline("1f1b"), devices=1, accelerator=DEVICE, steps=STEPS, precision="bf16-mixed",
        log_dir=tmp_path / "pipe")
    fit(make, reference_batches(batches, 1), devices=1, accelerator=DEVICE, steps=STEPS, precision="bf16-mixed",
        log_dir=tmp_path / "ref")
    pipe, ref = logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss")
    worst = max(abs(a - b) / abs(b) for a, b in zip(pipe, ref, strict=True))
    record("transformers Llama bf16-mixed 1f1b, max relative loss difference per step", worst)
    assert len(pipe) == STEPS and worst < 2e-2
