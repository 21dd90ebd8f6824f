"""The microbatch plan: which samples form each microbatch, and a checked split (no processes)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from lightning_pipe.runtime.microbatch import batch_contents, plan_microbatches, split_batch


def test_samples_in_order_first_microbatches_one_larger():
    plan = plan_microbatches(torch.arange(10).view(10, 1), 4)
    assert plan.sample_ranges == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert plan.sizes == [3, 3, 2, 2] and sum(plan.weights) == pytest.approx(1.0)
    assert plan.lengths == [None] * 4 and plan.windows == (None,) * 4


def test_fewer_samples_than_microbatches_gives_one_microbatch_per_sample():
    plan = plan_microbatches(torch.zeros(2, 3), 4)
    assert plan.num_microbatches == 2 and plan.sizes == [1, 1]


def test_per_sample_strings_are_split_with_the_tensors_and_other_items_given_whole():
    batch = {"ids": torch.arange(8).view(4, 2), "text": ["a", "b", "c", "d"], "names": ["x", "y"], "scale": 0.5}
    parts = split_batch(batch, 2)
    assert parts[0]["text"] == ["a", "b"] and parts[1]["text"] == ["c", "d"]
    assert parts[0]["names"] == ["x", "y"] and parts[1]["scale"] == 0.5
    assert torch.equal(parts[1]["ids"], torch.tensor([[4, 5], [6, 7]]))


def test_inputs_and_targets_of_different_batch_lengths_name_the_batch_numbers():
    with pytest.raises(ValueError, match=r"batch\[0\] \(6, 3\) -> 6 \(dim 0\), batch\[1\] \(5,\) -> 5 \(dim 0\)"):
        plan_microbatches((torch.zeros(6, 3), torch.zeros(5)), 2)


def test_time_major_items_by_mapping_and_hook():
    x, y = torch.arange(24.0).view(3, 8, 1), torch.arange(8)  # [T, B, d], [B]
    for batch_dim in ({0: 1, 1: 0}, lambda path, tensor: 1 if tensor.dim() == 3 else 0):
        parts = split_batch((x, y), 2, batch_dim)
        assert parts[0][0].shape == (3, 4, 1) and torch.equal(parts[1][1], torch.arange(4, 8))
        assert torch.equal(parts[1][0], x[:, 4:])


def test_an_item_given_whole_by_the_mapping():
    weights = torch.ones(3)  # per class, not per sample
    parts = split_batch({"x": torch.zeros(4, 2), "class_weights": weights}, 2, {"class_weights": None})
    assert parts[0]["class_weights"] is weights
    with pytest.raises(ValueError, match=r"batch\['class_weights'\] \(3,\) -> 3"):
        split_batch({"x": torch.zeros(4, 2), "class_weights": weights}, 2)


def test_an_item_without_the_batch_dimension_is_named():
    with pytest.raises(ValueError, match=r"batch\[1\] has shape \(8,\), without a batch dimension 1"):
        plan_microbatches((torch.zeros(3, 8, 2), torch.zeros(8)), 2, 1)


def test_objects_holding_tensors_are_refused():
    class Holder:
        def __init__(self) -> None:
            self.x = torch.zeros(4)

    with pytest.raises(ValueError, match=r"batch\['extra'\] is a Holder holding tensors"):
        plan_microbatches({"x": torch.zeros(4), "extra": Holder()}, 2)


def test_container_types_are_kept():
    Pair = collections.namedtuple("Pair", "x y")

    @dataclasses.dataclass
    class Sample:
        x: torch.Tensor
        tag: str

    parts = split_batch([Pair(torch.zeros(4), torch.ones(4)), Sample(torch.zeros(4, 2), "t")], 2)
    assert isinstance(parts[0][0], Pair) and parts[0][0].y.shape == (2,)
    assert isinstance(parts[1][1], Sample) and parts[1][1].x.shape == (2, 2) and parts[1][1].tag == "t"


def test_zero_dim_tensors_are_given_whole():
    parts = split_batch({"x": torch.zeros(4, 2), "temperature": torch.tensor(2.0)}, 2)
    assert parts[1]["temperature"].item() == 2.0


def test_a_batch_without_tensors_is_refused():
    with pytest.raises(ValueError, match="holds no tensor with a batch dimension"):
        plan_microbatches(["a", "b"], 2)


def test_batch_contents_match_for_a_new_container_of_the_same_tensors_only():
    """A batch moved to the device it is on is a new dict of the same tensors (a split made of the
    peeked batch serves the step); other tensors, other plain values or an in-place change do not match."""
    ids = torch.arange(12).reshape(3, 4)
    batch = {"input_ids": ids, "lengths": [4, 3, 2], "name": "a"}
    contents = batch_contents(batch)
    assert batch_contents(dict(batch)) == contents
    assert batch_contents({**batch, "input_ids": ids.clone()}) != contents
    assert batch_contents({**batch, "lengths": [4, 3, 1]}) != contents
    assert batch_contents([ids, [4, 3, 2], "a"]) != contents
    ids[0, 0] = 7  # a hook masking tokens in place
    assert batch_contents(batch) != contents
