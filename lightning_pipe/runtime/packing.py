"""Packing: a batch of padded sequences becomes microbatches of whole sequences back to back, no padding.

:class:`Packer` reads a transformers-style batch (a mapping with ``input_ids`` ``[B, T]``, optional
``attention_mask`` ``[B, T]`` of right padding, ``labels`` ``[B, T]``, optional ``position_ids``),
takes each sample's real tokens, and puts whole sequences into microbatches (bins): by a token
budget (``max_tokens``, first-fit decreasing, as many microbatches as needed) or into the
strategy's ``num_microbatches`` bins of near-equal tokens (longest first, into the lightest bin).
Each microbatch is one row ``[1, n]``:

* every per-token item (a tensor whose first two dimensions are ``[B, T]``) holds the real tokens
  of its sequences, concatenated;
* ``position_ids`` restart at 0 for each sequence (or are the batch's own, packed like the rest);
* ``attention_mask`` is None: there is no padding, and transformers then builds its per-sequence
  mask from the packed ``position_ids``; models calling ``F.scaled_dot_product_attention`` without
  a mask get attention within each sequence from :class:`~lightning_pipe.model.attention.PackedAttention`,
  entered around every real block call (and its recomputation) by :func:`packed_block_wrapper`;
* ``labels`` (``shift_labels=True``, transformers' convention of labels shifted inside the model):
  the first label of each sequence becomes ``ignore_index``, so that the last token of a sequence
  does not learn to predict the next sequence's first token. That label is never a target in the
  unpacked batch either, so the counted targets, and hence a token-averaged loss, stay exact.

Nothing here assumes the model is fit for packing: :func:`packing_difference` runs the first stage
on a packed microbatch and on each of its sequences as the unpacked batch holds them, and the
strategy refuses the model when they differ (positions from ``arange`` inside the model, attention
across sequences), naming what to change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_pipe.model.attention import KeyValueStore, PackedAttention, SlicedAttention
from lightning_pipe.runtime.side_runs import relative_tolerance

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LABELS = "labels"
POSITION_IDS = "position_ids"


@dataclass(frozen=True)
class Packer:
    """How the strategy packs a batch's sequences into microbatches (``ElasticPipelineStrategy(packing=...)``).

    Args:
        max_tokens: token budget of one microbatch: sequences go first-fit decreasing into as many
            microbatches as needed (their number changes from batch to batch). None: the
            strategy's ``num_microbatches`` microbatches of near-equal tokens.
        shift_labels: the model shifts ``labels`` itself (transformers' causal LMs, a step computing
            ``cross_entropy(logits[:, :-1], labels[:, 1:])``): the first label of each packed
            sequence is set to ``ignore_index``. False: labels are already aligned with their
            positions and are packed unchanged.
        ignore_index: the label the loss ignores.
        attention_backend: force the packed attention kernel (``"masked_sdpa"``, ``"flash_attn"``,
            ``"varlen_attn"``); None: chosen per device (``model/attention.py``).
        slicing: cut sequences longer than ``max_tokens`` into slices of near-equal length that run
            as consecutive microbatches, each attending to the keys and values of the earlier ones
            (sequence slicing; schedule ``"1f1b"`` only, run as sliced 1F1B). Each microbatch then
            carries ``shift_labels`` (its targets, aligned with its positions), which transformers'
            loss uses as given: the model must honour it (checked: the counted targets of the step
            must equal the batch's). See docs/long_sequences.md.
        chunk_cost: with ``slicing``, make the microbatches InfiniPipe's workload-balanced chunks
            (Algorithm 1, ``planning/chunking.py``) under this cost of a chunk (a
            ``planning.cost_model.LinearCost``: seconds as a function of tokens and of
            ``sum((c + s)^2 - c^2)``; ``chunk_time_model(cost_model)`` gives it): the
            longest sequence in the fewest slices of equal time whose first fits ``max_tokens``, longer
            sequences cut by the same mesh, tails packed with short sequences (hybrid chunks). None:
            slices of equal length, tails alone.
    """

    max_tokens: int | None = None
    shift_labels: bool = True
    ignore_index: int = -100
    attention_backend: str | None = None
    slicing: bool = False
    chunk_cost: Any = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"`Packer(max_tokens={self.max_tokens})`: the token budget must be at least 1.")
        if self.slicing and (self.max_tokens is None or not self.shift_labels):
            raise ValueError(
                "`Packer(slicing=True)` cuts sequences longer than `max_tokens`: give `max_tokens`, and keep "
                "`shift_labels=True` (slices get their targets as `shift_labels`)."
            )
        if self.chunk_cost is not None and not self.slicing:
            raise ValueError("`Packer(chunk_cost=...)` makes InfiniPipe's chunks of packed and sliced sequences: "
                             "it needs `slicing=True` (and `max_tokens`).")

    def plan(self, batch: Any, num_microbatches: int, chunker: Chunker | None = None) -> PackingPlan:
        """Plan the packed microbatches of ``batch`` (identical on every rank for the same batch).

        ``chunker`` (with ``slicing``): given the sequence lengths, the pieces of each microbatch and
        the microbatches of each scheduled group (the strategy passes Algorithm 1's when
        ``chunk_cost`` is set; ``runtime`` does not import ``planning``).

        Raises:
            ValueError: the batch does not follow the convention (the message says what it holds and
                what is expected), or a sequence is longer than ``max_tokens``.
        """
        lengths, per_token = _read_batch(batch)
        if self.slicing:
            return _sliced_plan(self, lengths, per_token, batch, chunker)
        if self.max_tokens is not None:
            too_long = [(i, n) for i, n in enumerate(lengths) if n > self.max_tokens]
            if too_long:
                raise ValueError(
                    f"`Packer(max_tokens={self.max_tokens})`: sequences {too_long[:5]} (sample, tokens) are longer than "
                    f"one microbatch may hold: cut them into slices (`Packer(max_tokens={self.max_tokens}, slicing=True)`, "
                    f"schedule '1f1b'), raise `max_tokens` to at least {max(n for _, n in too_long)}, or truncate them."
                )
            groups = pack_by_budget(lengths, self.max_tokens)
        else:
            groups = pack_balanced(lengths, num_microbatches)
        pieces = tuple(tuple((i, 0, lengths[i]) for i in group) for group in groups)
        return PackingPlan(len(lengths), tuple(lengths), pieces, tuple(per_token), self, (1,) * len(pieces))


Chunker = Callable[[list[int]], tuple[Any, ...]]
"""``lengths -> (pieces per microbatch, microbatches per scheduled group[, groups per pipeline])``."""


def planned_chunker(packer: Packer, chunks: Any) -> Chunker:
    """The ``chunker`` that runs a plan's chunks (``PipelinePlan.chunks``: ``pieces``, ``slices``,
    ``sequence_lengths``), refusing a batch whose sequences are not the ones they were made for.

    Raises:
        ValueError: the packer does not slice (chunks may hold slices).
    """
    if not packer.slicing:
        raise ValueError(
            "The plan gives the batch's microbatches as chunks (`PipelinePlan.chunks`), which may hold slices: use "
            "`packing=Packer(max_tokens=..., slicing=True)`."
        )

    def chunker(lengths: list[int]) -> tuple[Any, ...]:
        if tuple(lengths) != tuple(chunks.sequence_lengths):
            raise ValueError(
                f"The plan's chunks were made for sequences of {list(chunks.sequence_lengths)[:8]} tokens, but this "
                f"batch holds {list(lengths)[:8]}: propose chunks for the batch that runs (in `on_train_batch_start`)."
            )
        return chunks.pieces, chunks.slices, getattr(chunks, "pipelines", None)

    return chunker


def _sliced_plan(
    packer: Packer, lengths: list[int], per_token: list[Any], batch: Mapping, chunker: Chunker | None
) -> PackingPlan:
    """Sequences longer than the budget in near-equal slices (longest first, consecutive microbatches),
    then the others packed first-fit decreasing; or Algorithm 1's chunks with ``chunk_cost``."""
    budget = packer.max_tokens
    assert budget is not None
    targets = None
    if LABELS in batch:
        labels = batch[LABELS]
        targets = int(sum(int((labels[i, 1:n] != packer.ignore_index).sum()) for i, n in enumerate(lengths)))
    if chunker is not None:
        pieces, slices, *pipelines = chunker(lengths)
        return PackingPlan(
            len(lengths), tuple(lengths), pieces, tuple(per_token), packer, slices, targets, (pipelines or [None])[0]
        )
    long = sorted((i for i, n in enumerate(lengths) if n > budget), key=lambda i: (-lengths[i], i))
    pieces: list[tuple[tuple[int, int, int], ...]] = []
    slices: list[int] = []
    for i in long:
        count = -(-lengths[i] // budget)
        bounds = [round(k * lengths[i] / count) for k in range(count + 1)]
        pieces += [((i, a, b - a),) for a, b in zip(bounds, bounds[1:])]
        slices.append(count)
    short = [n if n <= budget else 0 for n in lengths]
    for group in pack_by_budget(short, budget):
        pieces.append(tuple((i, 0, lengths[i]) for i in group))
        slices.append(1)
    return PackingPlan(len(lengths), tuple(lengths), tuple(pieces), tuple(per_token), packer, tuple(slices), targets)


def pack_by_budget(lengths: Sequence[int], max_tokens: int) -> list[tuple[int, ...]]:
    """First-fit decreasing: sequences, longest first, into the first microbatch with room.

    Returns:
        per microbatch, its samples in batch order (microbatches in the order they were opened).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        if lengths[i] == 0:
            continue
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [tuple(sorted(b)) for b in bins]


def pack_balanced(lengths: Sequence[int], num_microbatches: int) -> list[tuple[int, ...]]:
    """Longest first into the microbatch with the fewest tokens (ties: the first): ``num_microbatches``
    microbatches of near-equal tokens (fewer when there are fewer sequences)."""
    count = min(num_microbatches, sum(1 for n in lengths if n > 0))
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] == 0:
            continue
        b = min(range(count), key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += lengths[i]
    return [tuple(sorted(b)) for b in bins]


@dataclass(frozen=True)
class PackingPlan:
    """How one batch is packed into microbatches (plain data; read like a ``MicrobatchPlan``).

    Attributes:
        batch_size: samples (sequences) in the batch.
        sequence_lengths: real tokens of each sample.
        pieces: per microbatch, its pieces ``(sample, start, length)``: whole sequences (start 0, all
            tokens), or one slice of a sliced sequence.
        per_token: the batch's keys whose tensors are ``[B, T, ...]`` (packed token by token).
        packer: the settings that made the plan.
        slices: microbatches per scheduled group, in order: a sliced sequence's slices form one group
            (backward last slice first, ``schedules/families/sliced_1f1b.py``), others groups of one.
        targets: with slicing, the targets the unsliced batch counts (labels shifted inside the
            model), which the step's loss calls must count too.
        pipelines: scheduled groups per consecutive 1F1B pipeline (a plan's grouped chunks,
            ``planning/grouping.py``); None: one pipeline.
    """

    batch_size: int
    sequence_lengths: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    per_token: tuple[Any, ...]
    packer: Packer = field(default_factory=Packer)
    slices: tuple[int, ...] = ()
    targets: int | None = None
    pipelines: tuple[int, ...] | None = None

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        """Per microbatch, the samples it holds (a piece of each)."""
        return tuple(tuple(i for i, _, _ in group) for group in self.pieces)

    @property
    def is_sliced(self) -> bool:
        """Whether some sequence is cut into slices or the step runs several pipelines (sliced 1F1B)."""
        return any(count > 1 for count in self.slices) or self.pipelines is not None

    def slice_of(self, microbatch: int) -> tuple[int, int, int] | None:
        """``(sample, slice index, context)`` when ``microbatch`` starts with a slice of a sliced sequence
        (alone, or its tail followed by packed whole sequences)."""
        group = self.pieces[microbatch]
        sample, start, length = group[0]
        if length == self.sequence_lengths[sample]:
            return None
        index = sum(1 for other in self.pieces[:microbatch] if other[0][0] == sample)
        return sample, index, start

    @property
    def num_microbatches(self) -> int:
        """Microbatches (packed rows) in this plan."""
        return len(self.sequences)

    @property
    def sizes(self) -> list[int]:
        """Sequences in each microbatch."""
        return [len(group) for group in self.sequences]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each packed row."""
        return tuple(sum(n for _, _, n in group) for group in self.pieces)

    @property
    def weights(self) -> tuple[float, ...]:
        """Each microbatch's share of the batch's sequences (evaluation logs; training weights by
        counted targets, ``runtime/loss_weights.py``)."""
        return tuple(len(group) / self.batch_size for group in self.sequences)

    def cu_seqlens(self, microbatch: int) -> Tensor:
        """``[0, n_0, n_0 + n_1, ...]``: where each piece of ``microbatch`` starts in its row (int32)."""
        return torch.tensor(self.cu_seqlens_of(microbatch), dtype=torch.int32)

    def cu_seqlens_of(self, microbatch: int) -> list[int]:
        """Cumulative lengths of the pieces of ``microbatch``."""
        bounds = [0]
        for _, _, n in self.pieces[microbatch]:
            bounds.append(bounds[-1] + n)
        return bounds

    def split(self, batch: Mapping) -> list[dict]:
        """The packed microbatches of ``batch`` (the batch this plan was made for)."""
        return [self._pack(batch, mb) for mb in range(self.num_microbatches)]

    def _pack(self, batch: Mapping, mb: int) -> dict:
        group = self.pieces[mb]
        out: dict[Any, Any] = {}
        for key, value in batch.items():
            if key in self.per_token:
                out[key] = torch.cat([value[i, a : a + n] for i, a, n in group]).unsqueeze(0)
            elif key == ATTENTION_MASK:
                out[key] = None
            else:
                out[key] = value
        device = batch[INPUT_IDS].device
        if POSITION_IDS not in self.per_token:
            out[POSITION_IDS] = torch.cat([torch.arange(a, a + n, device=device) for _, a, n in group]).unsqueeze(0)
        if LABELS in out and self.packer.shift_labels:
            labels = out[LABELS].clone()
            starts = self.cu_seqlens_of(mb)[:-1]
            labels[0, starts] = self.packer.ignore_index
            out[LABELS] = labels
            if self.packer.slicing:  # each token's own target (the next token of its sequence, even across slices)
                full = batch[LABELS]
                ignore = torch.full((1,), self.packer.ignore_index, dtype=full.dtype, device=full.device)
                out["shift_labels"] = torch.cat(
                    [torch.cat([full[i, a + 1 : min(a + n + 1, self.sequence_lengths[i])],
                                ignore[: max(0, a + n + 1 - self.sequence_lengths[i])]]) for i, a, n in group]
                ).unsqueeze(0)
        return type(batch)(out) if type(batch) is not dict and _rebuildable(batch) else out

    def unpacked(self, batch: Mapping, sample: int) -> Any:
        """Sample ``sample`` of ``batch`` alone, as the unpacked batch holds it (a batch of one, padded)."""
        out = {}
        for key, value in batch.items():
            out[key] = value[sample : sample + 1] if isinstance(value, Tensor) and value.dim() > 0 else value
        return type(batch)(out) if type(batch) is not dict and _rebuildable(batch) else out


def _rebuildable(batch: Mapping) -> bool:
    try:
        type(batch)({})
    except TypeError:
        return False
    return True


def _read_batch(batch: Any) -> tuple[list[int], list[Any]]:
    """Real tokens per sample, and the keys of per-token items; refuses what does not follow the convention."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get(INPUT_IDS), Tensor) or batch[INPUT_IDS].dim() != 2:
        held = (
            {k: tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for k, v in batch.items()}
            if isinstance(batch, Mapping) else type(batch).__name__
        )
        raise ValueError(
            f"Packing reads transformers-style batches: a mapping with 'input_ids' [B, T] (and 'attention_mask' "
            f"[B, T] of right padding, 'labels' [B, T], optionally 'position_ids'); this batch holds {held}. Return "
            "such a dict from the dataloader, or turn `packing` off."
        )
    ids = batch[INPUT_IDS]
    B, T = ids.shape
    mask = batch.get(ATTENTION_MASK)
    if mask is None:
        lengths = [T] * B
    else:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != (B, T):
            raise ValueError(f"Packing: batch['attention_mask'] must be [B, T] = {(B, T)} like 'input_ids', got {mask!r:.80}.")
        real = mask.bool()
        lengths = real.sum(1).tolist()
        positions = torch.arange(T, device=mask.device)
        right_padded = (real == (positions[None, :] < real.sum(1, keepdim=True))).all()
        if not bool(right_padded):
            rows = [i for i in range(B) if not bool((real[i] == (positions < lengths[i])).all())]
            raise ValueError(
                f"Packing needs right padding (each row's real tokens first, then padding), but rows {rows[:5]} of "
                "batch['attention_mask'] are not: pad on the right (`tokenizer.padding_side = 'right'`)."
            )
    per_token = []
    for key, value in batch.items():
        if key == ATTENTION_MASK or not isinstance(value, Tensor) or value.dim() == 0:
            continue
        if value.dim() >= 2 and tuple(value.shape[:2]) == (B, T):
            per_token.append(key)
        elif value.shape[0] == B:
            raise ValueError(
                f"Packing: batch[{key!r}] has shape {tuple(value.shape)}, a per-sample value without a token dimension "
                f"[B, T] = {(B, T)}, which a packed row of several sequences cannot carry. Keep per-token tensors "
                "only in packed batches, or turn `packing` off."
            )
    return [int(n) for n in lengths], per_token


def packed_block_wrapper(
    plan: PackingPlan, inner: Callable[[int, int], Any] | None, store: KeyValueStore | None = None
) -> Callable[[int, int], Any]:
    """The executor's ``block_wrapper`` for a packed step: every real block call of microbatch
    ``mb`` (and its recomputation under a memory plan's ``inner`` wrapper) runs under
    :class:`PackedAttention` with that microbatch's ``cu_seqlens``, or, for a slice of a sliced
    sequence, under :class:`SlicedAttention` with the step's key/value ``store``."""

    def for_stage(stage: int, mb: int):
        cu = plan.cu_seqlens(mb)
        wrapped = inner(stage, mb) if inner is not None else None
        sliced = plan.slice_of(mb) if store is not None else None

        def run(index: int, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            def packed_forward(*a: Any, **k: Any) -> Any:
                if sliced is not None:
                    sample, position, context = sliced
                    mode = SlicedAttention(store, sample, position, context, index, cu)
                else:
                    mode = PackedAttention(cu, backend=plan.packer.attention_backend)
                with mode:
                    return forward(*a, **k)

            if wrapped is not None:
                return wrapped(index, packed_forward, args, kwargs)
            return packed_forward(*args, **kwargs)

        return run

    return for_stage


# --- the first-batch check ---------------------------------------------------------------------


def check_microbatch(plan: PackingPlan) -> int | None:
    """The microbatch the first-batch check runs on: the one packing the most whole sequences (None
    when no microbatch packs two, so that nothing about packing can be seen yet)."""
    whole = [
        mb for mb in range(plan.num_microbatches)
        if all(n == plan.sequence_lengths[i] for i, _, n in plan.pieces[mb])  # slices: slicing_difference
    ]
    if not whole:
        return None
    best = max(whole, key=lambda mb: (plan.sizes[mb], -mb))
    return best if plan.sizes[best] >= 2 else None


def packing_difference(
    run_stage: Callable[[Any, Callable | None], list[Tensor]],
    batch: Mapping,
    plan: PackingPlan,
    microbatch: int,
) -> str | None:
    """Compare the first stage's output on a packed microbatch with its sequences run unpacked.

    Args:
        run_stage: runs the first stage of the user's step on a microbatch with a block wrapper
            (or None) and returns the stage's output tensors (no gradients).
        batch: the unpacked batch.
        plan: its packing plan.
        microbatch: which packed microbatch to compare.

    Returns:
        None when every sequence's output tokens agree (to the dtype's rounding); otherwise what
        differs, for the refusal message.
    """
    group = plan.sequences[microbatch]
    bounds = plan.cu_seqlens_of(microbatch)
    packed = run_stage(plan.split(batch)[microbatch], packed_block_wrapper(plan, None)(0, microbatch))
    total = bounds[-1]
    worst = (0.0, None)
    compared = False
    for position, sample in enumerate(group):
        alone = run_stage(plan.unpacked(batch, sample), None)
        n = plan.sequence_lengths[sample]
        for index, (p, u) in enumerate(zip(packed, alone)):
            if p.dim() < 2 or tuple(p.shape[:2]) != (1, total) or u.dim() < 2 or u.shape[0] != 1 or u.shape[1] < n:
                continue
            compared = True
            got = p[0, bounds[position] : bounds[position + 1]].double()
            want = u[0, :n].double()
            scale = max(float(want.abs().max()), 1e-30)
            error = float((got - want).abs().max()) / scale
            if error > worst[0]:
                worst = (error, (sample, position, index))
    if not compared:
        return (
            "the first stage's output has no token dimension [1, T, ...] to compare (shapes "
            f"{[tuple(t.shape) for t in packed]})"
        )
    tolerance = relative_tolerance(packed[0].dtype)
    if worst[0] <= tolerance:
        return None
    sample, position, index = worst[1]
    return (
        f"sequence {sample} (packed at position {position} of microbatch {microbatch}, after "
        f"{bounds[position]} tokens of other sequences) gets a first-stage output (tensor {index}) that differs from "
        f"its unpacked output by {worst[0]:.2e} (relative; allowed {tolerance:.0e})"
    )


def slicing_difference(
    run_stage: Callable[[Any, Callable | None], list[Tensor]], batch: Mapping, plan: PackingPlan
) -> str | None:
    """Compare the first stage's output on the slices of the plan's first sliced sequence (run in
    order, each attending to the earlier ones' keys and values) with that sequence run whole.

    Returns:
        None when they agree (to the dtype's rounding), else what differs; None too when nothing is sliced.
    """
    start = 0
    for count in plan.slices:
        if count > 1:
            break
        start += count
    else:
        return None
    microbatches = range(start, start + count)
    sample = plan.pieces[start][0][0]
    rows = plan.split(batch)
    store = KeyValueStore()
    wrappers = packed_block_wrapper(plan, None, store)
    sliced = [run_stage(rows[mb], wrappers(0, mb)) for mb in microbatches]
    alone = run_stage(plan.unpacked(batch, sample), None)
    n = plan.sequence_lengths[sample]
    worst, where = 0.0, None
    for index, whole in enumerate(alone):
        parts = [outputs[index] for outputs in sliced if index < len(outputs)]
        if whole.dim() < 2 or len(parts) != count or any(p.dim() < 2 or p.shape[0] != 1 for p in parts):
            continue
        own = [plan.pieces[mb][0][2] for mb in microbatches]  # the slice is each row's first piece
        got = torch.cat([p[0, :n_own] for p, n_own in zip(parts, own)]).double()
        if got.shape[0] != n:
            continue
        want = whole[0, :n].double()
        scale = max(float(want.abs().max()), 1e-30)
        error = float((got - want).abs().max()) / scale
        if error > worst:
            worst, where = error, index
    if where is None and worst == 0.0 and not any(w.dim() >= 2 for w in alone):
        return f"the first stage's output has no token dimension to compare (shapes {[tuple(t.shape) for t in alone]})"
    tolerance = relative_tolerance(alone[0].dtype)
    if worst <= tolerance:
        return None
    return (
        f"sequence {sample}, cut into {count} slices, gets a first-stage output (tensor {where}) that differs from its "
        f"unsliced output by {worst:.2e} (relative; allowed {tolerance:.0e})"
    )


REFUSAL = (
    "Packing would change this model's result: {what}. Packing puts several sequences in one row with "
    "`position_ids` restarting at 0 for each and no `attention_mask`; the model must take its positions from "
    "the batch (`position_ids`, e.g. `self.model(**batch)` or `position_ids=batch['position_ids']` for "
    "transformers models; not `torch.arange(T)` inside `forward`) and restrict attention to each sequence "
    "(transformers' attention with the packed `position_ids`, or `F.scaled_dot_product_attention(..., "
    "is_causal=True)` without a mask, which lightning-pipe restricts). Change the model so, or turn `packing` off."
)
