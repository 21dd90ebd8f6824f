"""Attention restricted to each sequence of a packed row (``cu_seqlens``), for models that call SDPA.

A packed microbatch is one row ``[1, T]`` holding several sequences back to back; ``cu_seqlens``
(``[0, n_0, n_0 + n_1, ..., T]``) says where each starts. A model whose attention calls
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on that row would let every token see
the tokens of the sequences packed before it. :class:`PackedAttention` is a torch-function mode,
entered around each real block call of a packed microbatch, that turns such calls (no ``attn_mask``
given, query length ``T``) into attention within each sequence:

* ``"masked_sdpa"`` (CPU, and the fallback everywhere): the same SDPA with a block-diagonal mask
  built from ``cu_seqlens`` (causal inside each block when the call was causal). FlexAttention has
  no backward on CPU in torch 2.13 and ``varlen_attn`` has no CPU kernel;
* ``"flash_attn"`` (CUDA, half precision, flash-attn installed: the ``cuda`` extra):
  ``flash_attn_varlen_func`` on the ``[T, H, D]`` layout, no mask materialised;
* ``"varlen_attn"`` (CUDA, half precision, no dropout): ``torch.nn.attention.varlen.varlen_attn``.

Calls that pass their own ``attn_mask`` are left alone: transformers builds a block-diagonal mask
itself from packed ``position_ids`` (``masking_utils.find_packed_sequence_indices``). Whether a
model's result is unchanged by packing is not assumed from any of this: the strategy checks it on
the first packed batch (``runtime/packing.py``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

MASKED_SDPA = "masked_sdpa"
FLASH_ATTN = "flash_attn"
VARLEN_ATTN = "varlen_attn"
_HALF = (torch.float16, torch.bfloat16)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def select_attention_backend(device: torch.device, dtype: torch.dtype, dropout_p: float = 0.0) -> str:
    """The kernel packed attention runs with on ``device`` for ``dtype`` (see the module docstring).

    Returns:
        ``"flash_attn"``, ``"varlen_attn"`` or ``"masked_sdpa"``.
    """
    if device.type != "cuda" or dtype not in _HALF:
        return MASKED_SDPA
    if importlib.util.find_spec("flash_attn") is not None:
        return FLASH_ATTN
    if dropout_p == 0.0 and _has_varlen_attn():
        return VARLEN_ATTN
    return MASKED_SDPA


def _has_varlen_attn() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def block_diagonal_mask(cu_seqlens: Tensor, causal: bool, device: torch.device | None = None) -> Tensor:
    """``[T, T]`` boolean mask, True where a query may attend a key: same sequence (and not later
    when ``causal``)."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    total = int(bounds[-1])
    positions = torch.arange(total, device=bounds.device)
    sequence = torch.bucketize(positions, bounds[1:], right=True)  # [T]: which sequence each token is in
    mask = sequence[:, None] == sequence[None, :]
    if causal:
        mask &= positions[None, :] <= positions[:, None]
    return mask


def varlen_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    causal: bool,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str | None = None,
) -> Tensor:
    """Attention of a packed row within each of its sequences.

    Args:
        query: ``[1, H, T, D]`` (SDPA's layout; the packed row is the only batch entry).
        key: ``[1, H_kv, T, D]``.
        value: ``[1, H_kv, T, D_v]``.
        cu_seqlens: ``[num_sequences + 1]`` cumulative lengths, ending at ``T``.
        max_seqlen: the longest sequence (flash kernels size their work by it).
        causal: each token sees only itself and the earlier tokens of its sequence.
        dropout_p, scale, enable_gqa: as for ``F.scaled_dot_product_attention``.
        backend: force one of :func:`select_attention_backend`'s answers; None: choose.

    Returns:
        ``[1, H, T, D_v]``.
    """
    backend = backend or select_attention_backend(query.device, query.dtype, dropout_p)
    if backend == MASKED_SDPA:
        mask = block_diagonal_mask(cu_seqlens, causal, query.device)
        return _ORIGINAL_SDPA(
            query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale, enable_gqa=enable_gqa
        )
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    if backend == FLASH_ATTN:
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, softmax_scale=scale, causal=causal
        )
    elif backend == VARLEN_ATTN:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(
            q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale,
            window_size=(-1, 0) if causal else (-1, -1), enable_gqa=k.shape[1] != q.shape[1],
        )
    else:
        raise ValueError(f"Unknown packed attention backend {backend!r}: use {MASKED_SDPA!r}, {FLASH_ATTN!r} or {VARLEN_ATTN!r}.")
    return out.transpose(0, 1).unsqueeze(0)


_ORIGINAL_SDPA = F.scaled_dot_product_attention


class PackedAttention(TorchFunctionMode):
    """Within this context, SDPA calls over a packed row attend within each sequence only.

    A call is rewritten when it passes no ``attn_mask``, its query is ``[1, H, T, D]`` with ``T``
    the packed row's length, and it runs on a real device (meta twins keep their shapes anyway).

    Args:
        cu_seqlens: ``[num_sequences + 1]`` cumulative lengths of the packed row.
        backend: force a backend (tests); None: :func:`select_attention_backend` per call.

    Attributes:
        calls: how many SDPA calls were rewritten, per backend (what the tests and the monitor read).
    """

    def __init__(self, cu_seqlens: Tensor, backend: str | None = None) -> None:
        super().__init__()
        self.cu_seqlens = cu_seqlens
        self.total = int(cu_seqlens[-1])
        self.max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        self.backend = backend
        self.calls: dict[str, int] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _ORIGINAL_SDPA:
            bound = dict(zip(_SDPA_ARGS, args))
            bound.update(kwargs)
            query = bound["query"]
            if (
                bound.get("attn_mask") is None
                and query.device.type != "meta"
                and query.dim() == 4
                and query.shape[0] == 1
                and query.shape[-2] == self.total
                and len(self.cu_seqlens) > 2  # one sequence: nothing to restrict
            ):
                dropout_p = float(bound.get("dropout_p", 0.0))
                backend = self.backend or select_attention_backend(query.device, query.dtype, dropout_p)
                self.calls[backend] = self.calls.get(backend, 0) + 1
                return varlen_attention(
                    query, bound["key"], bound["value"], self.cu_seqlens, self.max_seqlen,
                    causal=bool(bound.get("is_causal", False)), dropout_p=dropout_p, scale=bound.get("scale"),
                    enable_gqa=bool(bound.get("enable_gqa", False)), backend=backend,
                )
        return func(*args, **kwargs)


class KeyValueStore:
    """Keys and values of the slices of sliced sequences, for one step on one rank.

    Entry ``(sample, block, call)`` holds, per slice index, the slice's own ``k, v`` (autograd
    tensors of its forward: the roots its backward differentiates with the gradients the later
    slices left) and their detached copies that later slices attend to (leaves requiring grad, whose
    ``.grad`` collects those gradients).
    """

    def __init__(self) -> None:
        self.entries: dict[tuple[int, int, int], dict[int, tuple[Tensor, Tensor, Tensor, Tensor]]] = {}

    def pop_roots(self, sample: int, index: int, blocks: range) -> tuple[list[Tensor], list[Tensor]]:
        """The extra backward roots of slice ``index`` of ``sample`` on ``blocks``: its ``k, v`` and the
        gradients later slices accumulated into them (those no later slice used are skipped); the
        slice's entries are dropped."""
        roots, grads = [], []
        for (s, block, _), slots in self.entries.items():
            if s != sample or block not in blocks or index not in slots:
                continue
            k, v, k_leaf, v_leaf = slots.pop(index)
            for tensor, leaf in ((k, k_leaf), (v, v_leaf)):
                if leaf.grad is not None and tensor.requires_grad:
                    roots.append(tensor)
                    grads.append(leaf.grad)
        return roots, grads


def _lower_right_causal(queries: int, keys: int, device: torch.device) -> Tensor:
    """``[queries, keys]``: query ``t`` sees keys up to ``keys - queries + t`` (the slice's own position)."""
    offset = keys - queries
    return torch.arange(keys, device=device)[None, :] <= (torch.arange(queries, device=device)[:, None] + offset)


class SlicedAttention(TorchFunctionMode):
    """Within this context, causal SDPA calls of a slice attend to the earlier slices' keys and values too.

    Entered around one real block call of a row whose first piece is slice ``index`` of sequence
    ``sample`` (``context`` tokens before it), optionally followed by whole sequences packed after it
    (a hybrid chunk: the tail slice of a sequence plus short sequences; ``cu_seqlens`` of the row).
    The block's ``c``-th SDPA call (no mask, causal) stores the slice's ``k, v`` in the step's
    :class:`KeyValueStore` and attends with ``q`` over the earlier slices' stored keys and values
    followed by the row's own: the slice's tokens see the context and their slice causally (lower-right
    aligned), the packed sequences only themselves. A recomputation (activation checkpointing) finds
    its entry already stored and reuses the earlier slices' leaves without storing again.

    Args:
        store: the step's keys and values.
        sample: the sliced sequence (its sample in the batch).
        index: which slice of it this is.
        context: tokens of the sequence before this slice.
        block: the block being called.
        cu_seqlens: ``[0, slice length, ..., row length]``; None: the row is the slice alone.
    """

    def __init__(
        self, store: KeyValueStore, sample: int, index: int, context: int, block: int, cu_seqlens: Tensor | None = None
    ) -> None:
        super().__init__()
        self.store, self.sample, self.index, self.context, self.block = store, sample, index, context, block
        self.cu_seqlens = cu_seqlens
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not _ORIGINAL_SDPA:
            return func(*args, **kwargs)
        bound = dict(zip(_SDPA_ARGS, args))
        bound.update(kwargs)
        query, key, value = bound["query"], bound["key"], bound["value"]
        if query.device.type == "meta" or bound.get("attn_mask") is not None:
            return func(*args, **kwargs)
        if not bound.get("is_causal", False) and query.shape[-2] > 1:  # one query: causal or not is the same
            raise ValueError(
                f"Block {self.block}: a slice of a sliced sequence calls `F.scaled_dot_product_attention` without "
                "`is_causal=True`: only causal attention can be cut into slices. Turn `slicing` off for this model."
            )
        rows = query.shape[-2]
        own = rows if self.cu_seqlens is None or len(self.cu_seqlens) <= 2 else int(self.cu_seqlens[1])
        slots = self.store.entries.setdefault((self.sample, self.block, self.calls), {})
        self.calls += 1
        if self.index not in slots:  # first run (a recomputation finds it stored)
            k, v = (key, value) if own == rows else (key[..., :own, :], value[..., :own, :])
            grad = torch.is_grad_enabled()
            slots[self.index] = (
                k, v, k.detach().requires_grad_(grad and k.requires_grad), v.detach().requires_grad_(grad and v.requires_grad)
            )
        missing = [i for i in range(self.index) if i not in slots]
        if missing:
            raise RuntimeError(
                f"Slice {self.index} of sample {self.sample} at block {self.block}: the keys and values of slices "
                f"{missing} are not stored (their forward did not run on this rank before, or was released)."
            )
        keys = torch.cat([slots[i][2] for i in range(self.index)] + [key], dim=-2)
        values = torch.cat([slots[i][3] for i in range(self.index)] + [value], dim=-2)
        context = keys.shape[-2] - rows
        if own == rows:
            mask = _lower_right_causal(rows, keys.shape[-2], query.device)
        else:  # the slice sees the context; the packed sequences after it only themselves
            in_slice = torch.arange(rows, device=query.device) < own
            mask = torch.cat(
                [in_slice[:, None].expand(rows, context), block_diagonal_mask(self.cu_seqlens, True, query.device)], dim=1
            )
        return _ORIGINAL_SDPA(
            query, keys, values, attn_mask=mask, dropout_p=float(bound.get("dropout_p", 0.0)), is_causal=False,
            scale=bound.get("scale"), enable_gqa=bool(bound.get("enable_gqa", False)),
        )
