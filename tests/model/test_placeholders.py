"""Placeholders for values a stage cannot compute: the shape memo gives what a meta run gives (no processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pipe.model.placeholders import PlaceholderCache, PlaceholderMode


def _pre_block_code(weight: torch.Tensor, idx: torch.Tensor) -> list[torch.Tensor]:
    """What a later stage runs before its blocks: an embedding it does not hold, then shape-only work."""
    x = F.embedding(idx, weight)  # placeholder [B, T, C]
    x = F.dropout(x + 1.0, p=0.1)
    return [
        x,
        x[:, :-1],  # slices with different values must not share a memo entry
        x[:, :-2],
        x[1],  # True and 1 are equal keys in a dict, but not equal indices
        x[True],
        x.reshape(-1, x.size(-1)),
        x.split(2, dim=-1)[0],
    ]


def _run(weight: torch.Tensor, idx: torch.Tensor, cache: PlaceholderCache | None) -> tuple[PlaceholderMode, list[torch.Tensor]]:
    mode = PlaceholderMode(torch.device("cpu"), {id(weight): "wte.weight"}, cache=cache)
    with mode:
        return mode, _pre_block_code(weight, idx)


def test_cached_placeholders_match_meta_runs_skip_them_and_share_their_zeros():
    weight = nn.Parameter(torch.empty(50, 8, device="meta"))  # held by another rank
    idx = torch.randint(0, 50, (3, 7))
    _, expected = _run(weight, idx, cache=None)  # no memo: every operation runs on meta

    cache = PlaceholderCache()
    shapes = cache.shapes
    first_mode, first = _run(weight, idx, cache)
    entries = len(shapes)
    second_mode, second = _run(weight, idx, cache)  # a later microbatch of the same shape
    assert entries > 0 and len(shapes) == entries
    for want, got_first, got_second in zip(expected, first, second, strict=True):
        assert got_first.shape == got_second.shape == want.shape and got_second.dtype == want.dtype
        assert not got_second.is_meta and torch.count_nonzero(got_second) == 0
        assert second_mode.sources_of(got_second) == frozenset({("param", "wte.weight")})
    assert first_mode.sources_of(first[0]) == second_mode.sources_of(second[0])
    # ... and their zeros are one buffer's, not an allocation per placeholder
    storages = {t.untyped_storage().data_ptr() for t in first + second}
    assert len(storages) == 1

    # The second run really took its shapes from the memo: a forged entry shows up in its result.
    forged = {key: value for key, value in shapes.items() if key[0] is F.dropout}
    assert len(forged) == 1
    (key, (described, spec)), = forged.items()
    shapes[key] = ([type(described[0])(torch.Size([1, 1, 1]), described[0].dtype)], spec)
    with PlaceholderMode(torch.device("cpu"), {id(weight): "wte.weight"}, cache=cache):
        assert F.dropout(F.embedding(idx, weight) + 1.0, p=0.1).shape == (1, 1, 1)

    longer = torch.randint(0, 50, (3, 9))  # another length: its own entries, its own shapes
    _, other = _run(weight, longer, cache)
    assert other[0].shape == (3, 9, 8) and other[1].shape == (3, 8, 8)


def test_embeddings_of_a_table_held_elsewhere_take_their_shape_without_a_meta_run(monkeypatch):
    """A later stage embeds each microbatch with a table it does not hold: the placeholder's shape is
    the indices' shape and a row, as a meta run gives it, at every length without running on meta."""
    weight = nn.Parameter(torch.empty(50, 8, dtype=torch.float64, device="meta"))
    calls = [
        lambda idx: F.embedding(idx, weight),
        lambda idx: F.embedding(idx, weight, padding_idx=0),
        lambda idx: F.embedding(input=idx, weight=weight),
        lambda idx: nn.functional.embedding(idx, weight, max_norm=1.0),
    ]
    shapes = [(3, 7), (3, 11), (5,), (2, 3, 4)]
    expected = [[tuple(call(torch.randint(0, 50, shape).to("meta")).shape) for shape in shapes] for call in calls]
    monkeypatch.setattr("lightning_pipe.model.placeholders._to_meta", lambda value: (_ for _ in ()).throw(AssertionError))
    for cache in (None, PlaceholderCache()):
        mode = PlaceholderMode(torch.device("cpu"), {id(weight): "wte.weight"}, cache=cache)
        with mode:
            got = [[call(torch.randint(0, 50, shape)) for shape in shapes] for call in calls]
        for want_row, got_row in zip(expected, got, strict=True):
            for want, placeholder in zip(want_row, got_row, strict=True):
                assert tuple(placeholder.shape) == want and placeholder.dtype == torch.float64
                assert not placeholder.is_meta and mode.sources_of(placeholder) == frozenset({("param", "wte.weight")})


def test_placeholder_zeros_are_fresh_tensors_of_one_view_and_tags_stay_apart():
    """Each placeholder is its own tensor object (its own tag), a view of the cache's zeros without a
    base to tag; a larger shape replaces the buffer and the views of the smaller one."""
    cache = PlaceholderCache()
    mode = PlaceholderMode(torch.device("cpu"), {}, cache=cache)
    spec = torch.empty(2, 3, device="meta")
    first = mode.placeholder(spec, frozenset({("block", 0)}))
    second = mode.placeholder(spec, frozenset({("block", 1)}))
    assert first is not second and first._base is None and second._base is None
    assert first.data_ptr() == second.data_ptr() and first.shape == second.shape == (2, 3)
    assert mode.sources_of(first) == frozenset({("block", 0)}) and mode.sources_of(second) == frozenset({("block", 1)})
    larger = mode.placeholder(torch.empty(5, 4, device="meta"), frozenset({("block", 2)}))
    again = mode.placeholder(spec, frozenset({("block", 3)}))
    assert again.data_ptr() == larger.data_ptr() != first.data_ptr()  # one buffer: the larger one
    assert all(torch.count_nonzero(t) == 0 for t in (first, second, larger, again))

