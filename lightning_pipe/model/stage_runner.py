"""Run one pipeline stage of an unchanged module's own step function, for one microbatch.

The central trick of lightning-pipe (docs/architecture.md): every rank calls the user's own
``training_step`` (or ``validation_step``, ...) for every microbatch of a stage it runs.

* Blocks before the stage do not compute: they return meta tensors of the right shapes, found once
  per input signature by running a meta-device twin of the block, so later code sees the shapes.
* The block just before the stage returns, instead of its meta output, the tensors received from the
  previous stage (leaves that require grad): the stage's inputs.
* The stage's blocks run for real. After its last block, the output is captured and the rest of the
  user's step is cut short (a ``BaseException`` so that user ``except Exception`` blocks let it pass).
  The last stage runs the step to the end and returns its output (the loss).

Blocks are wrapped by an instance-level ``forward`` (the user's class and source are untouched; the
state-dict keys do not change). Non-block code (embeddings, head) runs as is: on a rank that does
not own it, its parameters are meta tensors, so it costs nothing and yields meta tensors. Until the
stage's inputs are injected, real tensors that meet meta tensors in one operation are moved to meta
(a torch-function mode), so user code mixing batch-derived tensors with embeddings keeps working.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_pipe.model.blocks import BlockStack


@dataclass(frozen=True)
class StageSpan:
    """The blocks one stage runs: ``first_block <= i < end_block`` of ``num_blocks``."""

    stage: int
    first_block: int
    end_block: int
    num_blocks: int

    @property
    def is_first(self) -> bool:
        """The stage runs ``pre`` (starts at block 0)."""
        return self.first_block == 0

    @property
    def is_last(self) -> bool:
        """The stage runs ``post`` and the rest of the step (ends at the last block)."""
        return self.end_block == self.num_blocks


@dataclass
class LogCall:
    """One ``self.log`` call made by the user's step, recorded for replay on every rank."""

    name: str
    value: Any
    kwargs: dict[str, Any]


@dataclass
class StageResult:
    """What running a stage for one microbatch produced.

    Attributes:
        inputs: the received tensors injected as the stage's inputs (empty on the first stage).
        outputs: tensor leaves of the stage's last block output (empty on the last stage).
        step_output: what the user's step returned (last stage only).
        logs: ``self.log`` calls made during the step (kept from the last stage only).
    """

    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    step_output: Any = None
    logs: list[LogCall] = field(default_factory=list)


@dataclass(frozen=True)
class _TensorSpec:
    shape: torch.Size
    dtype: torch.dtype


class _StageBoundary(BaseException):
    """Carries the last block's output out of the user's step."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class _MetaPromotion(TorchFunctionMode):
    """While enabled, an operation mixing meta and real tensors runs on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.enabled:
            leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            if any(t.is_meta for t in leaves) and not all(t.is_meta for t in leaves):
                args, kwargs = tree_map(_to_meta, (args, kwargs))
        return func(*args, **kwargs)


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor) and not value.is_meta:
        return value.detach().to("meta")
    return value


def _signature(value: Any) -> Any:
    """Hashable description of a call's arguments: tensor shapes/dtypes and the rest by value."""
    leaves, spec = tree_flatten(value)
    described = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            described.append(("T", tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        else:
            try:
                hash(leaf)
                described.append(leaf)
            except TypeError:
                described.append(repr(leaf))
    return (str(spec), tuple(described))


def _meta_twin(block: nn.Module) -> nn.Module:
    """A copy of ``block`` whose tensors all live on the meta device (allocates nothing)."""
    memo: dict[int, Any] = {}
    for tensor in list(block.parameters()) + list(block.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(
            tensor, nn.Parameter
        ) else meta
    return copy.deepcopy(block, memo)


BlockWrapper = Callable[[int, Callable[..., Any], tuple, dict], Any]
"""``(block_index, forward, args, kwargs) -> output``: runs one real block call, for example under
activation checkpointing or with saved tensors offloaded; must return ``forward(*args, **kwargs)``."""


class _ActiveRun:
    """State of one stage run: which blocks are real, what to inject, what came out."""

    def __init__(
        self,
        span: StageSpan,
        receive: Callable[[list[Tensor]], list[Tensor]] | None,
        wrap_block: BlockWrapper | None,
    ) -> None:
        self.span = span
        self.receive = receive
        self.wrap_block = wrap_block
        self.result = StageResult()
        self.promotion: _MetaPromotion | None = None


class StageRunner:
    """Runs stages of a module's step functions; owns the block wrappers and meta twins.

    Args:
        root: the user's module (unchanged; its blocks get an instance-level ``forward`` wrapper
            that behaves exactly like the original outside :meth:`run`).
        stack: the block stack found in ``root``.
    """

    def __init__(self, root: nn.Module, stack: BlockStack) -> None:
        self.root = root
        self.stack = stack
        self._twins = [_meta_twin(block) for block in stack.blocks]
        self._shape_memo: dict[tuple[int, Any], tuple[list[Any], Any]] = {}  # (block, signature) -> output
        self._active: _ActiveRun | None = None
        self._originals = []
        for index, block in enumerate(stack.blocks):
            original = block.forward
            self._originals.append(original)
            block.forward = self._wrap(index, original)

    def remove(self) -> None:
        """Restore the blocks' own ``forward``."""
        for block in self.stack.blocks:
            block.__dict__.pop("forward", None)

    def _wrap(self, index: int, original: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = self._active
            if run is None:
                return original(*args, **kwargs)
            return self._call_block(run, index, original, args, kwargs)

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return forward

    def _call_block(self, run: _ActiveRun, index: int, original: Callable, args: tuple, kwargs: dict) -> Any:
        span = run.span
        if index < span.first_block:
            output = self._meta_output(index, args, kwargs)
            if index == span.first_block - 1:
                output = self._inject(run, output)
            return output
        if index >= span.end_block:
            raise RuntimeError(
                f"Block {index} ran after stage {span.stage}'s last block {span.end_block - 1} without the stage "
                "being cut short; the block stack must be called in order, once per step."
            )
        _check_real_arguments(index, span, args, kwargs)
        if run.wrap_block is not None:
            output = run.wrap_block(index, original, args, kwargs)
        else:
            output = original(*args, **kwargs)
        if index == span.end_block - 1 and not span.is_last:
            raise _StageBoundary(output)
        return output

    def _meta_output(self, index: int, args: tuple, kwargs: dict) -> Any:
        key = (index, _signature((args, kwargs)))
        memo = self._shape_memo.get(key)
        if memo is None:
            with torch.no_grad():
                output = self._twins[index](*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            leaves, spec = tree_flatten(output)
            memo = ([_TensorSpec(leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)
            self._shape_memo[key] = memo
        described, spec = memo
        leaves = [
            torch.empty(item.shape, dtype=item.dtype, device="meta") if isinstance(item, _TensorSpec) else item
            for item in described
        ]
        return tree_unflatten(leaves, spec)

    def _inject(self, run: _ActiveRun, meta_output: Any) -> Any:
        if run.receive is None:
            raise RuntimeError(f"Stage {run.span.stage} needs its inputs but no receive function was given.")
        leaves, spec = tree_flatten(meta_output)
        metas = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        received = run.receive(metas)
        if len(received) != len(metas):
            raise RuntimeError(
                f"Stage {run.span.stage} expected {len(metas)} tensors from the previous stage, got {len(received)}."
            )
        it = iter(received)
        leaves = [next(it) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        run.result.inputs = list(received)
        if run.promotion is not None:
            run.promotion.enabled = False
        return tree_unflatten(leaves, spec)

    def run(
        self,
        step_name: str,
        step_args: tuple,
        span: StageSpan,
        receive: Callable[[list[Tensor]], list[Tensor]] | None = None,
        wrap_block: BlockWrapper | None = None,
    ) -> StageResult:
        """Run ``root.<step_name>(*step_args)`` as stage ``span`` and return what it produced.

        Args:
            step_name: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
            step_args: the arguments of the step (the microbatch, its index, ...).
            span: the blocks this stage runs.
            receive: given the meta tensors of the previous stage's output (shapes, dtypes), returns
                the real tensors; required unless ``span.is_first``.
            wrap_block: runs each of the stage's block calls (memory plans: recompute, offload).
        """
        if self._active is not None:
            raise RuntimeError("StageRunner.run is not reentrant: a stage is already running.")
        run = _ActiveRun(span, receive, wrap_block)
        self._active = run
        recorded: list[LogCall] = []
        try:
            with self._capture_logs(recorded), self._promotion(run):
                try:
                    run.result.step_output = getattr(self.root, step_name)(*step_args)
                except _StageBoundary as boundary:
                    run.result.outputs = [t for t in tree_flatten(boundary.output)[0] if isinstance(t, Tensor)]
        finally:
            self._active = None
        if span.is_last:
            run.result.logs = recorded
        elif span.num_blocks and not run.result.outputs:
            raise RuntimeError(
                f"`{step_name}` returned before stage {span.stage}'s last block {span.end_block - 1} ran: "
                "the step must run the whole block stack."
            )
        return run.result

    @contextlib.contextmanager
    def _promotion(self, run: _ActiveRun):
        if run.span.is_first:
            yield
            return
        run.promotion = _MetaPromotion()
        with run.promotion:
            yield

    @contextlib.contextmanager
    def _capture_logs(self, recorded: list[LogCall]):
        if not hasattr(self.root, "log"):
            yield
            return

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("lightning-pipe records `self.log(name, value, **kwargs)`: pass options by keyword.")
            recorded.append(LogCall(name, value, kwargs))

        self.root.log = log  # instance attribute shadows LightningModule.log during the stage
        try:
            yield
        finally:
            del self.root.log


def _check_real_arguments(index: int, span: StageSpan, args: tuple, kwargs: dict) -> None:
    for position, leaf in enumerate(tree_flatten((args, kwargs))[0]):
        if isinstance(leaf, Tensor) and leaf.is_meta:
            raise RuntimeError(
                f"Block {index} of stage {span.stage} received a tensor that exists only on the meta device "
                f"(argument leaf {position}, shape {tuple(leaf.shape)}): it is computed from parameters this stage "
                "does not own. Side inputs of blocks (masks, positions) must be derived from the batch, not from "
                "embeddings or other layers outside the block stack."
            )
