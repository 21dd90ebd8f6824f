"""Cutting padded batches: the real tokens found from the mask or the labels, each microbatch's
window, samples grouped by length, and every padded item cut alike (pure: no processes)."""

from __future__ import annotations

import torch

from lightning_pipe.runtime.microbatch import plan_microbatches

MASK = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0]])


def _batch(mask=MASK, **extra):
    ids = torch.arange(mask.numel()).reshape(mask.shape)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100), **extra}


def test_each_microbatch_keeps_its_longest_real_sample():
    plan = plan_microbatches(_batch(), 2, trim_padding=True)
    assert plan.order is None and plan.windows == (None, (0, 2))
    second = plan.split(_batch())[1]
    assert second["input_ids"].tolist() == [[12, 13], [18, 19]] and second["labels"].tolist() == [[12, -100], [18, 19]]
    assert second["attention_mask"].shape == (2, 2)


def test_grouping_by_length_orders_samples_longest_first_and_cuts_lists_alike():
    batch = _batch(names=["a", "b", "c", "d"])
    plan = plan_microbatches(batch, 2, trim_padding=True, group_by_length=True)
    assert plan.order == (1, 0, 3, 2) and plan.lengths == [None, 2]
    assert [plan.samples(mb) for mb in range(2)] == [[1, 0], [3, 2]]
    first, second = plan.split(batch)
    assert first["names"] == ["b", "a"] and second["names"] == ["d", "c"]
    assert second["input_ids"].tolist() == [[18, 19], [12, 13]]


def test_left_padding_keeps_the_trailing_window():
    plan = plan_microbatches(_batch(MASK.flip(1)), 2, trim_padding=True, group_by_length=True)
    assert plan.windows == (None, (4, 6))
    assert plan.padding.layout[2:] == (True, False)  # left side padded, right not


def test_labels_alone_cut_only_trailing_positions():
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, 8], [-100, 9, -100, -100]])
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "labels": labels}
    plan = plan_microbatches(batch, 3, trim_padding=True)
    assert plan.windows == ((0, 3), None, (0, 2))  # leading -100 may be a prompt: kept


def test_no_marker_or_no_trimming_leaves_the_plan_as_before():
    plain = {"input_ids": torch.ones(4, 6, dtype=torch.long)}
    assert plan_microbatches(plain, 2, trim_padding=True) == plan_microbatches(plain, 2)
    assert plan_microbatches(_batch(), 2, trim_padding=False).padding is None
    full = _batch(torch.ones(4, 6, dtype=torch.long))
    assert plan_microbatches(full, 2, trim_padding=True, group_by_length=True).padding is None


def test_only_items_with_the_padded_length_are_cut():
    batch = _batch(scores=torch.rand(4, 3), pairs=torch.rand(4, 6, 2))
    plan = plan_microbatches(batch, 2, trim_padding=True)
    second = plan.split(batch)[1]
    assert second["scores"].shape == (2, 3) and second["pairs"].shape == (2, 2, 2)


def test_an_empty_sample_does_not_widen_its_microbatch():
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    plan = plan_microbatches(_batch(mask), 1, trim_padding=True)
    assert plan.windows == ((0, 2),)
