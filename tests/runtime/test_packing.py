"""Packing a batch of padded sequences into microbatches: bins, the packed rows, what is refused."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.runtime.packing import Packer, check_microbatch, pack_balanced, pack_by_budget, packing_difference
from tests.helpers.packed_batches import padded_lm_batches


def test_first_fit_decreasing_by_token_budget():
    lengths = [5, 9, 2, 7, 3, 1]
    groups = pack_by_budget(lengths, 10)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum(lengths[i] for i in g) <= 10 for g in groups)
    assert groups == [(1, 5), (3, 4), (0, 2)]  # 9 then 7, 5 open bins; 3 joins 7, 2 joins 5, 1 joins 9


def test_balanced_bins_hold_near_equal_tokens():
    lengths = [12, 3, 8, 7, 5, 1, 4]
    groups = pack_balanced(lengths, 3)
    loads = sorted(sum(lengths[i] for i in g) for g in groups)
    assert loads == [12, 13, 15]  # longest first into the lightest: 12 | 8+4+1 | 7+5, then 3 joins the first
    assert pack_balanced([4, 2], 5) == [(0,), (1,)]  # fewer sequences than microbatches


def test_packed_rows_hold_each_sequence_with_its_own_positions_and_no_cross_sequence_target():
    batch = padded_lm_batches(1, batch_size=5, max_len=9, seed=3)[0]
    lengths = batch["attention_mask"].sum(1).tolist()
    plan = Packer().plan(batch, num_microbatches=2)
    rows = plan.split(batch)
    assert plan.num_microbatches == 2 and sorted(i for g in plan.sequences for i in g) == list(range(5))
    for group, row in zip(plan.sequences, rows):
        assert row["attention_mask"] is None
        assert row["input_ids"].shape == (1, sum(lengths[i] for i in group))
        start = 0
        for i in group:
            n = lengths[i]
            assert torch.equal(row["input_ids"][0, start : start + n], batch["input_ids"][i, :n])
            assert torch.equal(row["position_ids"][0, start : start + n], torch.arange(n))
            assert row["labels"][0, start] == -100  # never a target unpacked either
            assert torch.equal(row["labels"][0, start + 1 : start + n], batch["labels"][i, 1:n])
            start += n
    # counted targets (labels shifted inside the model) are the unpacked batch's
    unpacked = (batch["labels"][:, 1:] != -100).sum()
    packed = sum((row["labels"][:, 1:] != -100).sum() for row in rows)
    assert packed == unpacked
    assert plan.lengths == tuple(row["input_ids"].shape[1] for row in rows)
    assert sum(plan.weights) == pytest.approx(1.0)


def test_labels_already_aligned_are_packed_unchanged():
    batch = padded_lm_batches(1, batch_size=3, max_len=6, seed=1)[0]
    row = Packer(shift_labels=False).plan(batch, 1).split(batch)[0]
    assert (row["labels"] != -100).sum() == batch["attention_mask"].sum()


@pytest.mark.parametrize(
    ("batch", "packer", "message"),
    [
        (torch.zeros(2, 5, dtype=torch.long), Packer(), r"transformers-style batches.*'input_ids' \[B, T\]"),
        (
            {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])},
            Packer(), r"right padding.*rows \[0\].*padding_side = 'right'",
        ),
        (
            {"input_ids": torch.ones(2, 4, dtype=torch.long), "label": torch.tensor([0, 1])},
            Packer(), r"batch\['label'\] has shape \(2,\), a per-sample value",
        ),
        ({"input_ids": torch.ones(2, 7, dtype=torch.long)}, Packer(max_tokens=5), r"\(0, 7\).*slicing=True.*raise `max_tokens` to at least 7"),
    ],
    ids=["not-a-dict", "left-padding", "per-sample-tensor", "longer-than-budget"],
)
def test_batches_packing_cannot_carry_are_refused(batch, packer, message):
    with pytest.raises(ValueError, match=message):
        packer.plan(batch, 2)


def _positions_model(use_batch_positions: bool):
    """First stage of a toy model: embeddings plus positions, from the batch or from arange."""
    emb = torch.nn.Embedding(64, 4).double()
    pos = torch.nn.Embedding(16, 4).double()

    def run_stage(mb, wrapper):
        ids = mb["input_ids"]
        p = mb["position_ids"] if use_batch_positions and "position_ids" in mb else torch.arange(ids.shape[1])[None]
        return [emb(ids) + pos(p)]

    return run_stage


@pytest.mark.parametrize("use_batch_positions", [True, False])
def test_the_check_compares_packed_with_unpacked_outputs(use_batch_positions):
    batch = padded_lm_batches(1, batch_size=4, max_len=6, seed=2)[0]
    plan = Packer().plan(batch, 2)
    mb = check_microbatch(plan)
    assert mb is not None and plan.sizes[mb] >= 2
    with torch.no_grad():
        difference = packing_difference(_positions_model(use_batch_positions), batch, plan, mb)
    if use_batch_positions:
        assert difference is None
    else:
        assert "differs from its unpacked output" in difference


def test_nothing_to_check_while_no_microbatch_packs_two_sequences():
    batch = padded_lm_batches(1, batch_size=2, max_len=6)[0]
    assert check_microbatch(Packer().plan(batch, 2)) is None


def test_slicing_cuts_long_sequences_into_consecutive_slices_with_their_targets():
    batch = padded_lm_batches(1, batch_size=4, max_len=10, seed=4)[0]
    lengths = batch["attention_mask"].sum(1).tolist()
    plan = Packer(max_tokens=4, slicing=True).plan(batch, 2)
    rows = plan.split(batch)
    assert plan.is_sliced and sum(plan.slices) == plan.num_microbatches
    assert all(n <= 4 for n in plan.lengths)
    # every sequence's tokens once, in order; slices get positions from their context
    for sample, n in enumerate(lengths):
        got = [(mb, a, m) for mb, group in enumerate(plan.pieces) for i, a, m in group if i == sample]
        assert sum(m for _, _, m in got) == n
        for mb, a, m in got:
            if m < n:
                assert plan.slice_of(mb)[0] == sample and plan.slice_of(mb)[2] == a
                assert torch.equal(rows[mb]["position_ids"][0], torch.arange(a, a + m))
                assert torch.equal(rows[mb]["input_ids"][0], batch["input_ids"][sample, a : a + m])
    # targets: each token's next token of its own sequence, across slice boundaries
    counted = sum(int((row["shift_labels"] != -100).sum()) for row in rows)
    assert counted == plan.targets == int(sum((batch["labels"][i, 1:n] != -100).sum() for i, n in enumerate(lengths)))


def test_slicing_needs_a_budget():
    with pytest.raises(ValueError, match=r"`Packer\(slicing=True\)` cuts sequences longer than `max_tokens`: give `max_tokens`"):
        Packer(slicing=True)


# --- what chunks keep beyond an unpacked memory profile (planning/chunk_memory.py) ---------------


def _saved_bytes(run):
    """Bytes of the distinct storages autograd saves while ``run`` executes (as the strategy's counter)."""
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return sum(seen.values()), out


@pytest.mark.parametrize("rows, context, packed", [(12, 0, ()), (12, 20, ()), (8, 16, (5, 3)), (0, 0, (9, 7, 4))])
def test_chunk_memory_matches_what_a_block_saves_and_stores(rows, context, packed):
    """The GPT example's block (float64, CPU: masked SDPA): the bytes a slice with ``context`` tokens
    before it (followed by ``packed`` whole sequences), or a packed row, saves beyond the same block on
    one unpacked row, and what the key/value store keeps (the projection's storage; the gradients of
    the slice's keys and values once a later slice's backward ran), are chunk_memory's numbers."""
    from examples.gpt.model import GPT
    from lightning_pipe.model.attention import KeyValueStore, PackedAttention, SlicedAttention
    from lightning_pipe.planning.chunk_memory import chunk_memory

    torch.manual_seed(0)
    hidden = 16
    block = GPT(vocab_size=64, block_size=128, n_layer=1, n_head=2, n_embd=hidden).double().blocks[0]
    total = rows + sum(packed)
    cu = torch.tensor([0, *torch.tensor([rows, *packed] if rows else list(packed)).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randn(1, total, hidden, dtype=torch.double, requires_grad=True)
    store = KeyValueStore()
    if rows:  # slice 1 of sequence 0 (slice 0: the context), then a later slice 2 that attends to both
        sequence_length = context + rows + 4
        pieces = [(0, context, rows)] + [(1 + i, 0, n) for i, n in enumerate(packed)]
        lengths = [sequence_length, *packed]
        if context:
            with SlicedAttention(store, 0, 0, 0, 0):
                block(torch.randn(1, context, hidden, dtype=torch.double, requires_grad=True))
        index = 1 if context else 0
        mode = SlicedAttention(store, 0, index, context, 0, cu if packed else None)
    else:
        pieces, lengths = [(i, 0, n) for i, n in enumerate(packed)], list(packed)
        mode = PackedAttention(cu, backend="masked_sdpa")
    with mode:
        chunked, _ = _saved_bytes(lambda: block(x))
    plain, _ = _saved_bytes(lambda: block(x))
    expected = chunk_memory([pieces], lengths, hidden, element_bytes=8)
    assert chunked - plain == expected.attention[0]
    if not rows:
        assert expected.kept[0] == 0
        return
    k, v, k_leaf, v_leaf = store.entries[(0, 0, 0)][index]
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()  # views of one projection output
    with SlicedAttention(store, 0, index + 1, context + rows, 0):  # a later slice: its backward fills the leaves' grads
        later = block(torch.randn(1, 4, hidden, dtype=torch.double, requires_grad=True))
    later.sum().backward()
    gradients = k_leaf.grad.untyped_storage().nbytes() + v_leaf.grad.untyped_storage().nbytes()
    assert k.untyped_storage().nbytes() + gradients == expected.kept[0]


def test_a_plans_chunks_run_only_on_their_batch_and_need_slicing():
    from lightning_pipe.planning.chunking import PlannedChunks, chunk_batch
    from lightning_pipe.planning.cost_model import LinearCost
    from lightning_pipe.runtime.packing import planned_chunker

    batch = padded_lm_batches(1, batch_size=6, max_len=20, seed=2)[0]
    lengths = batch["attention_mask"].sum(1).tolist()
    chunks = PlannedChunks.from_plan(chunk_batch(lengths, 3, LinearCost(per_token=1.0, per_squared_length=0.05)), lengths)
    packer = Packer(max_tokens=20, slicing=True)
    plan = packer.plan(batch, 3, planned_chunker(packer, chunks))
    assert plan.pieces == chunks.pieces and plan.slices == chunks.slices
    other = padded_lm_batches(1, batch_size=6, max_len=20, seed=3)[0]
    with pytest.raises(ValueError, match="The plan's chunks were made for sequences of"):
        packer.plan(other, 3, planned_chunker(packer, chunks))
    with pytest.raises(ValueError, match=r"use `packing=Packer\(max_tokens=..., slicing=True\)`"):
        planned_chunker(Packer(max_tokens=20), chunks)
