"""Models nobody here wrote, and weights used outside their module, train unchanged and exactly.

transformers' Llama (grouped-query attention, rotary, causal masks built with data-dependent checks)
and GPT-2 (tied embeddings, position embeddings moved to the embeddings' device), Lightning's demo
encoder-decoder, a head that uses the embedding weight directly, free root parameters used at later
units, a head declared before the blocks: parity in float64 against one device, pp=2, ``1f1b`` and
``zbv``, and with the partition changing every step. Steps that stages cannot run exactly are
refused before the first update, never hang.
"""

from __future__ import annotations

import time

import pytest
import torch

from lightning_pipe import ElasticPipelineStrategy
from lightning_pipe.callbacks import ElasticRepartition, ScheduleSwitch
from tests.callbacks.test_elastic_repartition import _attention_heavy_model
from tests.helpers.callbacks import RandomPlans, RecordPlans, RecordSplit, SaveFullState, read_plans, read_splits
from tests.helpers.models import AuxLossGPT, DirectHeadDecoder, GatedGPT, HookedAuxGPT, LoopedStack
from tests.helpers.training import START_METHOD, assert_same_parameters, fit, logged, reference_batches, token_batches

pytest.importorskip("transformers")
from tests.helpers.hf_models import DemoTransformer, HFCausalLM, lm_batches, pair_batches  # noqa: E402

STEPS = 3
# transformers computes its loss in float32 even for a float64 model (`logits.float()` in its loss):
# microbatch losses weighted by their counted tokens (exact in real arithmetic) round differently
# from one device's single float32 mean (HFCausalLM trains with SGD so that this stays rounding-sized).
# A wrong weighting is off by about 1e-2 (the token-averaging test below guards against it).
HF_ATOL = 1e-7


def _pipeline(schedule: str = "1f1b", microbatches: int = 4, **kwargs) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=microbatches, schedule=schedule, start_method=START_METHOD, **kwargs
    )


def _parity(make, batches, strategy, tmp_path=None, steps=STEPS, atol=1e-10, reference_log_dir=None, **kwargs):
    pipelined = fit(make, batches, strategy, devices=2, steps=steps, log_dir=tmp_path, **kwargs)
    kwargs.pop("callbacks", None)  # the planners; accumulation and the like apply to the reference too
    reference = fit(make, reference_batches(batches, 1), steps=steps, log_dir=reference_log_dir, **kwargs)
    assert_same_parameters(pipelined, reference, atol=atol)
    return pipelined, reference


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_causal_lm_parity(tmp_path, family, schedule):
    """Right-padded batches with an attention mask and -100 labels (equal counts per microbatch, see
    the token-averaging test below), sdpa attention; the logged loss equals one device's too."""
    batches = lm_batches(STEPS, batch_size=4, lengths=[9, 6, 12], padding="equal")
    make = lambda: HFCausalLM(family, layers=4).double()  # noqa: E731
    pipelined, reference = _parity(
        make, batches, _pipeline(schedule), tmp_path / "pipe", atol=HF_ATOL, reference_log_dir=tmp_path / "ref"
    )
    assert not torch.equal(reference.model.lm_head.weight, make().model.lm_head.weight)  # it did train
    losses, expected = logged(tmp_path / "pipe", "train_loss"), logged(tmp_path / "ref", "train_loss")
    assert len(losses) == STEPS == len(expected)  # written by rank 0, which replays the last stage's logs
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-6, rtol=0)


def test_llama_eager_attention_and_variable_padding_with_one_microbatch():
    """Each sample has its own padding; one microbatch keeps the loss's token average whole."""
    batches = lm_batches(STEPS, batch_size=3, lengths=[9, 6, 12], padding="variable")
    _parity(lambda: HFCausalLM("llama", layers=4, attn="eager").double(), batches, _pipeline(microbatches=1), atol=HF_ATOL)


def test_llama_token_averaged_loss_with_variable_padding():
    """Microbatches count 8, 7, 6 and 8 tokens: weighted by counted tokens, not samples (sample
    weights end 6e-2 away)."""
    batches = lm_batches(STEPS, batch_size=4, lengths=[9, 6, 12], padding="variable")
    _parity(lambda: HFCausalLM("llama", layers=4).double(), batches, _pipeline(), atol=HF_ATOL)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_lightning_demo_encoder_decoder_parity(schedule):
    """The decoder layers are the blocks; the encoder's output feeds each of them, so every stage
    holds the encoder (shared by all units) and their gradients are summed."""
    batches = pair_batches(STEPS, batch_size=4, lengths=[8, 6, 10])
    _parity(lambda: DemoTransformer(layers=4).double(), batches, _pipeline(schedule))


@pytest.mark.parametrize("family", ["llama", "gpt2", "demo"])
def test_elastic_repartition_every_step_on_models_nobody_here_wrote(tmp_path, family):
    """The partition follows the batch length (a cost model where attention dominates long batches)."""
    steps = 4
    cost_model = tmp_path / "profile.json"
    _attention_heavy_model(num_blocks=6).save(cost_model)
    atol = 1e-10
    if family == "demo":
        batches, make = pair_batches(steps, 4, [4, 40]), lambda: DemoTransformer(layers=6).double()
    else:
        batches = lm_batches(steps, 4, [4, 40], padding="equal")
        make, atol = (lambda: HFCausalLM(family, layers=6).double()), HF_ATOL
    callbacks = [ElasticRepartition(cost_model=cost_model, trigger="always"), RecordPlans(str(tmp_path / "plans.jsonl"))]
    _parity(make, batches, _pipeline(), steps=steps, callbacks=callbacks, atol=atol)
    partitions = [tuple(plan["boundaries"]) for plan in read_plans(tmp_path / "plans.jsonl")]
    assert len(set(partitions)) >= 2, partitions


def test_llama_meta_cost_model_plans_from_the_batch():
    """Without a profile the planner's meta-device probe runs transformers' mask code on the real batch."""
    batches = lm_batches(STEPS, 4, [4, 24, 4], padding="equal")
    _parity(
        lambda: HFCausalLM("llama", layers=4).double(), batches, _pipeline(), atol=HF_ATOL,
        callbacks=[ElasticRepartition(trigger="always")],
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("make", [DirectHeadDecoder, GatedGPT], ids=["head-uses-embedding-weight", "head-declared-first-free-parameters"])
def test_weights_used_outside_their_module_parity(make, schedule):
    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    _parity(lambda: make(layers=4).double(), batches, _pipeline(schedule))


@pytest.mark.parametrize("make", [DirectHeadDecoder, GatedGPT], ids=["head-uses-embedding-weight", "head-declared-first-free-parameters"])
def test_shared_weights_migrate_with_random_plans_inside_accumulation(tmp_path, make):
    """Shared pieces move when the partition and schedule change every batch, with accumulation 2."""
    batches = token_batches(6, batch_size=4, lengths=[5, 7, 9, 11, 13, 15])
    plans = RandomPlans(["1f1b", "zbv", "interleaved_1f1b"])
    _parity(lambda: make(layers=6).double(), batches, _pipeline(), tmp_path, steps=3, accumulate_grad_batches=2,
            callbacks=[plans])
    assert logged(tmp_path, "moved_bytes")[-1] > 0


def test_shared_weight_is_one_entry_in_the_checkpoint_and_loads_into_a_plain_module(tmp_path):
    saved = tmp_path / "full.pt"
    batches = token_batches(STEPS, batch_size=4, lengths=[9, 5, 13])
    make = lambda: DirectHeadDecoder(layers=4).double()  # noqa: E731
    pipelined = fit(make, batches, _pipeline(), devices=2, steps=STEPS, callbacks=[SaveFullState(str(saved))])
    state = torch.load(saved)
    plain = make()
    assert list(state) == list(plain.state_dict())  # the module's own names, each once
    plain.load_state_dict(state)
    assert_same_parameters(plain, pipelined, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (LoopedStack, r"calls the blocks of `blocks` in the order \[0, 1, 2, 3, 0, 1, 2, 3\]: block 0 is called again"),
        (AuxLossGPT, r"the value the step returns is computed from the output of block `blocks.0`"),
        (HookedAuxGPT, r"produced inside block `blocks.0` that is not among its outputs"),
    ],
    ids=["stack-called-twice", "loss-summed-across-blocks", "hook-collects-inside-blocks"],
)
def test_steps_stages_cannot_run_exactly_are_refused_before_the_first_update(make, message):
    start = time.monotonic()
    with pytest.raises(Exception, match=message):
        fit(lambda: make(layers=4).double(), token_batches(2, 4, 7), _pipeline(timeout=__import__("datetime").timedelta(seconds=60)),
            devices=2, steps=2)
    assert time.monotonic() - start < 90  # no rank waits for a peer that refused


def test_llama_under_zero_bubble_planning_measures_the_split_and_stays_exact(tmp_path):
    """``ScheduleSwitch("auto")`` with ZB-H1 as a candidate times the split backward on the real
    stages of a transformers Llama (variable padding, -100 labels) before the first step: the probe
    leaves nothing behind, whichever family it then picks."""
    batches = lm_batches(STEPS, batch_size=4, lengths=[9, 6, 12], padding="variable")
    callbacks = [ScheduleSwitch("auto", candidates=["1f1b", "zb_h1"]), RecordSplit(tmp_path)]
    _parity(lambda: HFCausalLM("llama", layers=4).double(), batches, _pipeline(), callbacks=callbacks, atol=HF_ATOL)
    shares = read_splits(tmp_path, 2)
    assert shares[0] == shares[1] and shares[0][2:] == [0.0, 1.0]  # measured, and alike on both ranks
