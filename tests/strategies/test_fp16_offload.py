"""``precision="16-mixed"`` (float16 autocast + GradScaler) with optimizer offload, on 2 real ranks.

Lightning turns ``Trainer(accelerator="cpu", precision="16-mixed")`` into bf16-mixed, so both the
pipelined runs and the one-process references pass ``MixedPrecision("16-mixed", "cpu", scaler)``
explicitly: float16 autocast on CPU with ``torch.amp.GradScaler("cpu")``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_pipe import ElasticPipelineStrategy
from tests.helpers.models import TinyGPT
from tests.helpers.training import START_METHOD, fit, reference_batches, token_batches

INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2  # small, so a few steps exercise growth and the tracker's reset by an overflow


def _fp16(scaler_device: str = "cpu") -> MixedPrecision:
    scaler = torch.amp.GradScaler(scaler_device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def _strategy(num_microbatches: int) -> ElasticPipelineStrategy:
    return ElasticPipelineStrategy(
        pipeline_parallel_size=2, num_microbatches=num_microbatches, partition="uniform", start_method=START_METHOD,
        optimizer_offload=True,
    )


class PoisonedGPT(TinyGPT):
    """TinyGPT whose ``head.weight`` gradient is +inf at one optimizer step (the last stage's only).

    The hook is attached at batch start to the real parameter (on ranks where ``head`` is on the meta
    device nothing is attached), so exactly one rank of the pipeline sees the overflow.
    """

    def __init__(self, poison_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.poison_step = poison_step
        self._handle = None

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.trainer.global_step == self.poison_step and self.head.weight.device.type != "meta":
            self._handle = self.head.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class RecordSteps(L.Callback):
    """Per rank and step: the scaler's state, the rank's real parameters and host optimizer state."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        memory = getattr(strategy, "memory", None)
        row = {
            "scaler": dict(trainer.precision_plugin.state_dict()),
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.device.type != "meta"},
        }
        if memory is not None and memory.stage_optimizers is not None:
            offload = memory.stage_optimizers
            row["overflow"] = memory.last_overflow
            row["found_inf"] = {s: r.found_inf for s, r in memory.last_stage_steps.items()}
            row["host"] = {
                s: {"masters": [m.clone() for m in offload.masters(s)], "state": copy.deepcopy(offload.host_optimizer(s).state_dict())}
                for s in offload.stages
            }
            row["user_state"] = len(trainer.optimizers[0].state)
        self.rows.append(row)
        torch.save(self.rows, self.directory / f"rank{trainer.global_rank}.pt")


def _rows(directory: Path) -> dict[int, list[dict]]:
    return {int(f.stem[4:]): torch.load(f, weights_only=False) for f in sorted(directory.glob("rank*.pt"))}


def _assert_close_parameters(actual: torch.nn.Module, expected: torch.nn.Module, rtol: float, atol: float) -> None:
    got, want = dict(actual.named_parameters()), dict(expected.named_parameters())
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def _assert_equal_state(a, b) -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal_state(x, y)
    else:
        assert a == b


# Tolerances (measured with TinyGPT + SGD, 5 steps, parameters up to 4 in size):
# * one microbatch: the pipeline runs the reference's float16 ops on the same data in the same order
#   (only split across two ranks), so the results agree to float32 rounding: max |diff| 1.1e-11.
# * four microbatches: float16 matmuls now round one sample at a time and weight gradients are summed
#   over microbatches in float32, a different order than the one batch of the reference. Measured
#   max |diff| 2.1e-6; the reference's own float16-vs-float32 difference is 3.1e-6, so the pipeline
#   is as close to the reference as float16 autocast is to float32. atol 1e-5 (~3x that) with rtol
#   1e-3 (2 float16 roundoffs, 2**-11 each) accepts this and rejects a wrong scale (a factor of 2 in
#   a gradient moves SGD parameters by ~1e-2).
TOLERANCES = {1: (0.0, 1e-9), 4: (1e-3, 1e-5)}


@pytest.mark.parametrize("num_microbatches", [1, 4])
def test_fp16_offload_matches_one_process_fp16_and_its_loss_scale(tmp_path, num_microbatches):
    """Parameters after 5 steps close to a one-process 16-mixed run; the loss scale identical
    (2**10 grows to 2**12 with growth_interval=2) and kept by Lightning's scaler on every rank."""
    batches = token_batches(5, batch_size=4, lengths=12)
    make = lambda: TinyGPT(optimizer="sgd")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "ref").mkdir()
    pipelined = fit(make, batches, _strategy(num_microbatches), devices=2, steps=5, precision=None,
                    plugins=[_fp16()], callbacks=[RecordSteps(tmp_path / "pipe")])
    reference_plugin = _fp16()
    reference = fit(make, reference_batches(batches, 1), steps=5, precision=None, plugins=[reference_plugin],
                    callbacks=[RecordSteps(tmp_path / "ref")])
    rtol, atol = TOLERANCES[num_microbatches]
    _assert_close_parameters(pipelined, reference, rtol=rtol, atol=atol)
    expected = [row["scaler"] for row in _rows(tmp_path / "ref")[0]]
    assert [s["scale"] for s in expected] == [INIT_SCALE, 2 * INIT_SCALE, 2 * INIT_SCALE, 4 * INIT_SCALE, 4 * INIT_SCALE]
    assert reference_plugin.scaler.get_scale() == 4 * INIT_SCALE
    rows = _rows(tmp_path / "pipe")
    assert sorted(rows) == [0, 1]
    for rank, steps in rows.items():
        assert [row["scaler"] for row in steps] == expected, rank  # scale and growth tracker, every step
        assert all(not row["overflow"] and row["user_state"] == 0 for row in steps)


def test_overflow_on_one_rank_undoes_the_step_on_every_rank(tmp_path):
    """An inf gradient on the last stage at step 2: both ranks' parameters, host master weights and
    optimizer state after step 2 equal those after step 1 bit for bit, the scale halves, training goes
    on, and the result matches a one-process 16-mixed run whose scaler skipped the same step."""
    poison = 2
    batches = token_batches(5, batch_size=4, lengths=12, seed=1)
    make = lambda: PoisonedGPT(poison, optimizer="adamw")
    (tmp_path / "pipe").mkdir()
    (tmp_path / "ref").mkdir()
    pipelined = fit(make, batches, _strategy(1), devices=2, steps=5, precision=None, plugins=[_fp16()],
                    callbacks=[RecordSteps(tmp_path / "pipe")])
    reference = fit(make, reference_batches(batches, 1), steps=5, precision=None, plugins=[_fp16()],
                    callbacks=[RecordSteps(tmp_path / "ref")])
    expected = [row["scaler"] for row in _rows(tmp_path / "ref")[0]]
    # the reference's scaler: grows after steps 0-1, halves at the poisoned step, grows again after 3-4
    assert [s["scale"] for s in expected] == [INIT_SCALE, 2 * INIT_SCALE, INIT_SCALE, INIT_SCALE, 2 * INIT_SCALE]
    rows = _rows(tmp_path / "pipe")
    assert sorted(rows) == [0, 1]
    for rank, steps in rows.items():
        assert [row["scaler"] for row in steps] == expected, rank
        assert [row["overflow"] for row in steps] == [False, False, True, False, False], rank
        before, skipped, after = steps[poison - 1], steps[poison], steps[poison + 1]
        _assert_equal_state(skipped["params"], before["params"])  # exactly as if the step never ran
        _assert_equal_state(skipped["host"], before["host"])
        assert any(not torch.equal(after["params"][n], skipped["params"][n]) for n in after["params"])  # goes on
    # only rank 1 (last stage, holding head.weight) found the inf; rank 0's stage stepped on finite
    # gradients and was undone because rank 1 overflowed
    assert "head.weight" in rows[1][0]["params"] and "head.weight" not in rows[0][0]["params"]
    assert list(rows[0][poison]["found_inf"].values()) == [False]
    assert list(rows[1][poison]["found_inf"].values()) == [True]
    ref_rows = _rows(tmp_path / "ref")[0]
    _assert_equal_state(ref_rows[poison]["params"], ref_rows[poison - 1]["params"])  # the reference skipped it too
    # one microbatch: the same float16 ops as the reference (AdamW amplifies any rounding difference in
    # near-zero gradients to lr-sized updates, so microbatch splitting is compared with SGD above)
    _assert_close_parameters(pipelined, reference, rtol=0.0, atol=1e-6)
