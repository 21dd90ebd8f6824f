"""Memory mechanisms applied to each real block call, per (stage, microbatch): the block wrappers of memory plans.

A block runs in one of four modes (``planning.memory_model.BLOCK_MODES``):

* ``"none"``: as written; autograd keeps what it keeps.
* ``"full"``: ``torch.utils.checkpoint`` (``use_reentrant=False``, RNG state preserved so dropout
  draws the same masks): only the block's inputs are kept, the block is re-run in backward.
* ``"keep_attention"``: selective checkpointing (``create_selective_checkpoint_contexts``): the
  outputs of scaled-dot-product / flash attention are kept, everything else is recomputed
  (HelixPipe's recomputation without attention; attention dominates long-sequence compute, the rest
  is cheap to redo). If a kept attention op drew random numbers (attention dropout), later random
  ops of the block are kept too: re-running them from the block's starting RNG state without the
  attention's draws would give different masks. Selective checkpointing allows one backward pass
  per region, so it cannot serve split-backward (zero-bubble ``I``/``W``) schedules.
* ``"offload"``: saved activations go to host memory until backward (``offload.py``).

Independently, position-wise MLP submodules (a child named ``mlp``, ``feed_forward``, ``ffn``, or
names given by the user) can run in sequence chunks (HelixPipe's chunked MLP): the input is split
along dimension -2 (the sequence for ``[B, T, C]``; any non-feature dimension is exact for a
position-wise module), each chunk runs alone, the outputs are concatenated. The working memory of
the MLP's hidden layer shrinks to one chunk's; saved bytes do not change.

All of it is exact: same outputs, same gradients as the plain block (up to the order of floating
point sums inside chunked matrix products, far below 1e-10 in float64).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_pipe.model.stage_runner import BlockWrapper
from lightning_pipe.runtime.memory_accounting import AFTER_BLOCKS, BEFORE_BLOCKS, Holder, SavedActivationCounter
from lightning_pipe.runtime.offload import ActivationOffloader
from lightning_pipe.runtime._torch_compat import op_argument_names, tree_flatten

NONE, FULL, KEEP_ATTENTION, OFFLOAD = "none", "full", "keep_attention", "offload"
BLOCK_MODES = (NONE, FULL, KEEP_ATTENTION, OFFLOAD)
DEFAULT_MLP_NAMES = ("mlp", "feed_forward", "ffn")

_ATTENTION_OP_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def attention_ops(extra: Iterable[Any] = ()) -> frozenset:
    """ATen attention kernels whose outputs ``"keep_attention"`` keeps, plus ``extra`` op overloads
    (for example ``torch.ops.flash_attn._flash_attn_forward.default``)."""
    ops = set(extra)
    for name in _ATTENTION_OP_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


def _draws_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call consumed random numbers (a seeded op, with a non-zero dropout if it has one)."""
    if torch.Tag.nondeterministic_seeded not in getattr(op, "tags", ()):
        return False
    names = op_argument_names(op)
    if "dropout_p" in names:
        position = names.index("dropout_p")
        value = kwargs.get("dropout_p", args[position] if position < len(args) else 0.0)
        return float(value) > 0.0
    return True


def keep_attention_policy(
    ops: frozenset, counter: SavedActivationCounter | None = None, holder: Holder | None = None
) -> Callable:
    """Selective-checkpoint policy: keep attention outputs (and random ops after a random attention op).

    Args:
        ops: the attention op overloads to keep.
        counter: counts the kept outputs (they are held by the checkpoint, not by saved-tensor hooks).
        holder: lives as long as the checkpoint's saved state; the count is released with it.
    """
    state = {"random_kept": False}

    def policy(ctx, op, *args, **kwargs):
        keep = op in ops or (state["random_kept"] and _draws_random(op, args, kwargs))
        if not keep:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if _draws_random(op, args, kwargs):
            state["random_kept"] = True
        if counter is not None and holder is not None:
            counter.hold([t for t in tree_flatten(ctx.op_output)[0] if isinstance(t, Tensor)], holder)
        return CheckpointPolicy.MUST_SAVE

    return policy


def find_mlps(block: nn.Module, names: Sequence[str] = DEFAULT_MLP_NAMES) -> list[nn.Module]:
    """Outermost submodules of ``block`` whose attribute name is in ``names``."""
    found: list[tuple[str, nn.Module]] = []
    for path, module in block.named_modules():
        if path and path.split(".")[-1] in names and not any(path.startswith(p + ".") for p, _ in found):
            found.append((path, module))
    return [m for _, m in found]


def _chunked(forward: Callable, chunk_size: int) -> Callable:
    def run(x: Any, *args: Any, **kwargs: Any) -> Any:
        extra = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, Tensor)]
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-2] <= chunk_size or extra:
            return forward(x, *args, **kwargs)
        outputs = [forward(piece, *args, **kwargs) for piece in x.split(chunk_size, dim=-2)]
        return torch.cat(outputs, dim=-2)

    return run


@contextlib.contextmanager
def chunked_mlps(modules: Sequence[nn.Module], chunk_size: int | None):
    """While active, ``modules`` run their input in chunks of ``chunk_size`` along dimension -2."""
    if not chunk_size or not modules:
        yield
        return
    saved = []
    for module in modules:
        saved.append(module.__dict__.get("forward"))
        module.forward = _chunked(module.forward, chunk_size)
    try:
        yield
    finally:
        for module, previous in zip(modules, saved):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous


class MemoryRuntime:
    """Builds the block wrappers of a memory plan and accounts what they keep, on one rank.

    Args:
        blocks: the model's block stack (index = block index).
        device: where activations live (for offload).
        rank: pipeline rank (for messages).
        mlp_names: attribute names of position-wise MLP submodules to chunk.
        keep_ops: extra op overloads whose outputs ``"keep_attention"`` keeps.
        budget_bytes: accounted bytes allowed (static + saved activations); None: no limit.
        enforce: raise when the accounted bytes exceed ``budget_bytes``.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        rank: int = 0,
        mlp_names: Sequence[str] = DEFAULT_MLP_NAMES,
        keep_ops: Iterable[Any] = (),
        budget_bytes: int | None = None,
        enforce: bool = True,
    ) -> None:
        self.counter = SavedActivationCounter(rank, budget_bytes, enforce)
        self.offloader = ActivationOffloader(device, self.counter.is_activation, self.counter)
        self.mlps = [find_mlps(block, mlp_names) for block in blocks]
        self.attention_ops = attention_ops(keep_ops)

    @contextlib.contextmanager
    def step(self, parameters: Iterable[Tensor], static_bytes: int = 0):
        """Account one step: saved-tensor hooks on, parameters excluded, static bytes charged."""
        self.counter.start_step(parameters, static_bytes)
        self.offloader.start_step()
        with self.counter.hooks():
            yield self.counter.step

    def wrapper(
        self,
        stage: int,
        microbatch: int,
        first_block: int,
        modes: Sequence[str],
        mlp_chunk_size: int | None = None,
    ) -> BlockWrapper:
        """The wrapper for ``stage``'s block calls for ``microbatch``.

        Args:
            stage: the stage.
            microbatch: the microbatch.
            first_block: the stage's first block index.
            modes: per block of the stage (by position), one of ``BLOCK_MODES``.
            mlp_chunk_size: chunk size for MLPs, or None.

        Raises:
            ValueError: for an unknown mode.
        """
        unknown = set(modes) - set(BLOCK_MODES)
        if unknown:
            raise ValueError(f"Unknown block modes {sorted(unknown)}; use one of {list(BLOCK_MODES)}.")
        self.counter.set_position(stage, microbatch, BEFORE_BLOCKS)
        last = first_block + len(modes) - 1

        def wrap(index: int, forward: Callable, args: tuple, kwargs: dict) -> Any:
            mode = modes[index - first_block]
            try:
                with self.counter.position(stage, microbatch, index):
                    return self.call_block(stage, microbatch, index, mode, forward, args, kwargs, mlp_chunk_size)
            finally:
                if index == last:
                    self.counter.set_position(stage, microbatch, AFTER_BLOCKS)

        return wrap

    def call_block(
        self, stage: int, microbatch: int, index: int, mode: str, forward: Callable, args: tuple, kwargs: dict,
        mlp_chunk_size: int | None = None,
    ) -> Any:
        """Run ``forward(*args, **kwargs)`` (block ``index``) in ``mode``."""
        mlps = self.mlps[index] if index < len(self.mlps) else []

        def run(_holder: Any, *inner_args: Any, **inner_kwargs: Any) -> Any:
            with chunked_mlps(mlps, mlp_chunk_size):
                return forward(*inner_args, **inner_kwargs)

        if mode == NONE or not torch.is_grad_enabled():
            return run(None, *args, **kwargs)
        if mode == OFFLOAD:
            with self.offloader.hooks(stage, microbatch, index):
                return run(None, *args, **kwargs)
        # The holder rides along as a non-tensor argument: the checkpoint keeps it exactly as long
        # as it keeps its inputs, so what the policy holds is counted for that long.
        holder = Holder(self.counter)
        context_fn = None
        if mode == KEEP_ATTENTION:
            policy = keep_attention_policy(self.attention_ops, self.counter, holder)
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
        if context_fn is not None:
            options["context_fn"] = context_fn
        return checkpoint(run, holder, *args, **options, **kwargs)
