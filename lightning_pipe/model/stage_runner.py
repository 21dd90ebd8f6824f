"""Run one pipeline stage of an unchanged module's own step function, for one microbatch.

The central trick of lightning-pipe (docs/architecture.md): every rank calls the user's own
``training_step`` (or ``validation_step``, ...) for every microbatch of a stage it runs.

* Blocks before the stage do not compute: they return real *placeholders* (zeros, tagged as such)
  of their output's shapes, found once per input signature by a meta-device twin of the block.
* The block just before the stage returns, instead, the tensors received from the previous stage
  (leaves that require grad): the stage's inputs.
* The stage's blocks run for real. After its last block, the output is captured and the rest of the
  user's step is cut short (a ``BaseException`` so that user ``except Exception`` blocks let it pass).
  The last stage runs the step to the end and returns its output (the loss).

Blocks are wrapped by an instance-level ``forward`` (the user's class and source are untouched; the
state-dict keys do not change). The code outside the blocks this rank runs (embeddings, masks,
rotary tables, the head) runs under :class:`~lightning_pipe.model.placeholders.PlaceholderMode`:
everything that needs no missing parameter is computed for real, the rest becomes placeholders,
and a placeholder that reaches a block this rank runs, the loss or a logged value is refused with
the value's sources named. :meth:`StageRunner.observe` runs the step once with every parameter
treated as missing and records the order of block calls and which parameters each block's inputs
and the step's results need (``model/observation.py`` turns that into units).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lightning_pipe.model._torch_compat import (
    PYTREE_NODES,
    function_modes_removed,
    meta_autocast_disabled,
    torch_function_disabled,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_unflatten,
)
from lightning_pipe.model.blocks import BlockStack
from lightning_pipe.model.placeholders import PlaceholderCache, PlaceholderMode, describe_sources, find_tainted
from lightning_pipe.model.shape_rules import BlockOutput, ShapeRules, TensorSpec


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


class _StageBoundary(BaseException):
    """Carries the last block's output out of the user's step."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor) and not value.is_meta:
        return value.detach().to("meta")
    return value


_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _signature(value: Any) -> Any:
    """Hashable description of a call's arguments: tensor shapes/dtypes, plain values, types of objects."""
    plain = _plain_signature(value)
    if plain is not None:
        return plain
    leaves, spec = tree_flatten(value)
    return (str(spec), tuple(_describe_leaf(leaf) for leaf in leaves))


def _plain_signature(value: Any) -> Any:
    """:func:`_signature` of a nest of exact tuples, lists and dicts without pytree (the usual case,
    and several times faster); None for anything pytree must take apart."""
    kind = type(value)
    if kind is tuple or kind is list or kind is dict:
        items = value.items() if kind is dict else enumerate(value)
        described = []
        for key, item in items:
            inner = _plain_signature(item)
            if inner is None:
                return None
            described.append((key, inner) if kind is dict else inner)
        return (kind.__name__, tuple(described))
    if isinstance(value, (tuple, list, dict)) or kind in PYTREE_NODES:
        return None
    return ("leaf", _describe_leaf(value))


def _describe_leaf(leaf: Any) -> Any:
    if isinstance(leaf, Tensor):
        return ("T", tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
    if isinstance(leaf, _PLAIN):
        return leaf
    return ("O", type(leaf).__qualname__)  # a cache object, a config: its identity must not grow the memo


def _meta_leaf(item: Any) -> Any:
    """A meta tensor for a :class:`TensorSpec`; any other leaf as it is."""
    return torch.empty(item.shape, dtype=item.dtype, device="meta") if isinstance(item, TensorSpec) else item


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


@dataclass
class StepObservation:
    """What one run of a step with every parameter treated as missing showed (:meth:`StageRunner.observe`).

    Attributes:
        step_name: the step function observed.
        block_calls: block indices in the order the step called them.
        block_sources: per call, the sources of the call's tensor arguments (see
            ``model/placeholders.py``: ``("param", name)``, ``("block", i)``, ``("inside", i)``).
        result_sources: per result of the step (``"the loss"``, ``"logged value 'acc'"``), its sources.
        reads: sources of every tensor whose value the step read (``.item()``, ``bool()``).
    """

    step_name: str
    block_calls: list[int] = field(default_factory=list)
    block_sources: list[frozenset] = field(default_factory=list)
    result_sources: dict[str, frozenset] = field(default_factory=dict)
    reads: list[frozenset] = field(default_factory=list)


class _ActiveRun:
    """State of one stage run: which blocks are real, what to inject, what came out."""

    def __init__(
        self,
        span: StageSpan | None,
        receive: Callable[[list[Tensor]], list[Tensor]] | None,
        wrap_block: BlockWrapper | None,
        mode: PlaceholderMode,
        observation: StepObservation | None = None,
    ) -> None:
        self.span = span
        self.receive = receive
        self.wrap_block = wrap_block
        self.mode = mode
        self.observation = observation
        self.result = StageResult()
        self.last_block: int | None = None


def _suspended():
    """Plain torch inside (a meta twin, a transfer, building placeholders): the runner's own modes are
    taken off the stack, so their Python dispatch is not paid on every tensor attribute read there."""
    return function_modes_removed(_idle_in_blocks)


def _idle_in_blocks(mode: Any) -> bool:
    """Modes with nothing to do inside a block this rank runs, taken off the stack there.

    Placeholders only arise outside real blocks, and a loss the counter (an observer of the
    placeholder mode) traces is computed after the blocks; a loss call inside a block would be seen
    only on the stage that happens to run that block and so depend on the partition. Modes of the
    model's attention (packing, slicing) stay.
    """
    return isinstance(mode, PlaceholderMode)


class StageRunner:
    """Runs stages of a module's step functions; owns the block wrappers and meta twins.

    Args:
        root: the user's module (unchanged; its blocks get an instance-level ``forward`` wrapper
            that behaves exactly like the original outside :meth:`run`).
        stack: the block stack found in ``root``.
        device: this rank's device (where placeholders and ``device="meta"`` requests go); None:
            the device of the first real parameter, else the CPU.
    """

    def __init__(self, root: nn.Module, stack: BlockStack, device: torch.device | None = None) -> None:
        self.root = root
        self.stack = stack
        self.device = device
        self._twins = [_meta_twin(block) for block in stack.blocks]
        self._shape_memo: dict[tuple[int, Any], tuple[list[Any], Any]] = {}  # (block, signature) -> output
        self._placeholders_cache = PlaceholderCache()
        self.shape_rules = ShapeRules()
        self.predict_shapes = False  # new sizes from shape rules instead of probes (the sender describes its tensors)
        self.probes = 0  # meta-device runs of blocks so far (the cost shape rules save)
        self._active: _ActiveRun | None = None
        self._parameter_names: dict[int, str] | None = None  # id(parameter) -> name, for sources
        self._real_parameters: list[nn.Parameter] | None = None
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
            if run.observation is not None:
                return self._observe_block(run, index, args, kwargs)
            return self._call_block(run, index, original, args, kwargs)

        forward.__wrapped__ = original  # type: ignore[attr-defined]
        return forward

    def _mode(self, observe: bool, observers: tuple[Any, ...] = ()) -> PlaceholderMode:
        device = self.device
        if device is None:
            device = next((p.device for p in self.root.parameters() if not p.is_meta), torch.device("cpu"))
        if observe or self._parameter_names is None:  # an observation must see the parameters as they are now
            self._parameter_names = {id(p): name for name, p in self.root.named_parameters()}
        return PlaceholderMode(
            device,
            self._parameter_names,
            observe=observe,
            describe_block=self.stack.block_path,
            cache=None if observe else self._placeholders_cache,
            observers=observers,
        )

    def parameters_changed(self) -> None:
        """Call after parameter objects were replaced or moved (sharding, migration): names in messages
        and :meth:`real_parameters` stay right."""
        self._parameter_names = None
        self._real_parameters = None

    def real_parameters(self) -> list[nn.Parameter]:
        """The module's parameters this rank holds (not on the meta device), in module order; kept
        until :meth:`parameters_changed` (walking the module tree costs 0.1-0.3 ms, at every step's start)."""
        if self._real_parameters is None:
            self._real_parameters = [p for p in self.root.parameters() if not p.is_meta]
        return list(self._real_parameters)

    # --- blocks ------------------------------------------------------------------------------

    def _call_block(self, run: _ActiveRun, index: int, original: Callable, args: tuple, kwargs: dict) -> Any:
        span = run.span
        assert span is not None
        if run.last_block is not None and index <= run.last_block:
            raise RuntimeError(
                f"Block `{self.stack.block_path(index)}` was called after block `{self.stack.block_path(run.last_block)}` "
                f"in one step (stage {span.stage}): pipeline stages need every block of `{self.stack.path}` called "
                "exactly once per step, in order."
            )
        run.last_block = index
        if index < span.first_block:
            with torch_function_disabled():  # shapes read and placeholders made by the runner, not the step
                key = (index, _signature((args, kwargs)))
                memo = self._shape_memo.get(key)
            if memo is None:
                with _suspended():  # a probe: modes of the model (attention) stay
                    memo = self._new_output_spec(key, args, kwargs)
            described, spec = memo
            with torch_function_disabled():
                if index == span.first_block - 1:
                    meta_output = tree_unflatten([_meta_leaf(item) for item in described], spec)
                else:  # straight from the shapes: no meta tensors on the way
                    sources = frozenset({("block", index)})
                    return tree_unflatten(
                        [run.mode.placeholder(item, sources) if isinstance(item, TensorSpec) else item for item in described],
                        spec,
                    )
            return self._inject(run, meta_output)
        if index >= span.end_block:
            raise RuntimeError(
                f"Block {index} ran after stage {span.stage}'s last block {span.end_block - 1} without the stage "
                "being cut short; the block stack must be called in order, once per step."
            )
        with function_modes_removed(_idle_in_blocks):  # the check too: tensor attributes read without dispatch
            self._check_real_arguments(run, index, args, kwargs)
            if run.wrap_block is not None:
                output = run.wrap_block(index, original, args, kwargs)
            else:
                output = original(*args, **kwargs)
        if index == span.end_block - 1 and not span.is_last:
            raise _StageBoundary(output)
        return output

    def _check_real_arguments(self, run: _ActiveRun, index: int, args: tuple, kwargs: dict) -> None:
        tainted = find_tainted(run.mode, (args, kwargs))
        if tainted:
            position, leaf, sources = tainted[0]
            raise RuntimeError(
                f"Block `{self.stack.block_path(index)}` of stage {run.span.stage} received a tensor (argument leaf "
                f"{position}, shape {tuple(leaf.shape)}) computed from {describe_sources(sources, self.stack.block_path)}, "
                "which this rank does not hold or run. Inputs of a block must come from the previous block's output, "
                "the batch, or parameters the step uses before the blocks; a value carried past a block outside its "
                "outputs cannot reach a later stage: return it from the block instead."
            )

    def _new_output_spec(self, key: tuple, args: tuple, kwargs: dict) -> BlockOutput:
        """The leaves (a :class:`TensorSpec` per tensor) and tree spec of block ``key[0]``'s output for
        arguments not in the shape memo (``key``: the block and the arguments' signature): predicted by
        the shape rules, or probed on the meta device, and remembered."""
        index, memo = key[0], None
        if self.predict_shapes:
            memo = self.shape_rules.predict(index, (args, kwargs))
        if memo is None:
            self.probes += 1
            with torch.no_grad():
                output = self._twins[index](*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            leaves, spec = tree_flatten(output)
            memo = ([TensorSpec(leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)
            self._shape_memo[key] = memo
            self.shape_rules.observe(index, (args, kwargs), memo)
        return memo

    def _placeholders(self, mode: PlaceholderMode, meta_output: Any, sources: frozenset) -> Any:
        with _suspended():
            return tree_map(
                lambda leaf: mode.placeholder(leaf, sources) if isinstance(leaf, Tensor) else leaf, meta_output
            )

    def _inject(self, run: _ActiveRun, meta_output: Any) -> Any:
        if run.receive is None:
            raise RuntimeError(f"Stage {run.span.stage} needs its inputs but no receive function was given.")
        leaves, spec = tree_flatten(meta_output)
        metas = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        with _suspended():
            received = run.receive(metas)
        if len(received) != len(metas):
            raise RuntimeError(
                f"Stage {run.span.stage} expected {len(metas)} tensors from the previous stage, got {len(received)}."
            )
        it = iter(received)
        leaves = [next(it) if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        run.result.inputs = list(received)
        return tree_unflatten(leaves, spec)

    def _observe_block(self, run: _ActiveRun, index: int, args: tuple, kwargs: dict) -> Any:
        mode, observation = run.mode, run.observation
        assert observation is not None
        leaves = [mode.sources_of(t) for t in tree_leaves((args, kwargs))]
        observation.block_calls.append(index)
        observation.block_sources.append(frozenset().union(*[s for s in leaves if s is not None]))
        with _suspended():
            meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        mode.inside = index  # what the twin leaves behind (hooks, lists) is marked as from inside the block
        try:
            with torch.no_grad():
                output = self._twins[index](*meta_args, **meta_kwargs)
        finally:
            mode.inside = None
        return self._placeholders(mode, output, frozenset({("block", index)}))

    # --- steps -------------------------------------------------------------------------------

    def run(
        self,
        step_name: str,
        step_args: tuple,
        span: StageSpan,
        receive: Callable[[list[Tensor]], list[Tensor]] | None = None,
        wrap_block: BlockWrapper | None = None,
        observers: tuple[Any, ...] = (),
    ) -> StageResult:
        """Run ``root.<step_name>(*step_args)`` as stage ``span`` and return what it produced.

        Args:
            step_name: ``"training_step"``, ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
            step_args: the arguments of the step (the microbatch, its index, ...).
            span: the blocks this stage runs.
            receive: given the meta tensors of the previous stage's output (shapes, dtypes), returns
                the real tensors; required unless ``span.is_first``.
            wrap_block: runs each of the stage's block calls (memory plans: recompute, offload).
            observers: see each operation of the step outside the blocks this stage runs, with its
                result (a :class:`~lightning_pipe.model.loss_counting.LossCounter`); the placeholder
                mode calls them (``observe(func, args, kwargs, result)``), so they cost no mode
                dispatch of their own and do not see the placeholder mode's own operations.

        Raises:
            RuntimeError: a block this stage runs, the loss or a logged value would be computed
                from a placeholder (a value needing parameters or blocks of other stages), or the
                step read such a value; the message names the value's sources.
        """
        if self._active is not None:
            raise RuntimeError("StageRunner.run is not reentrant: a stage is already running.")
        run = _ActiveRun(span, receive, wrap_block, self._mode(observe=False, observers=observers))
        self._active = run
        recorded: list[LogCall] = []
        try:
            with self._capture_logs(recorded), meta_autocast_disabled(), run.mode:
                try:
                    run.result.step_output = getattr(self.root, step_name)(*step_args)
                except _StageBoundary as boundary:
                    run.result.outputs = [t for t in tree_leaves(boundary.output) if isinstance(t, Tensor)]
            if span.is_last:
                self._check_results(run.mode, step_name, span, run.result.step_output, recorded)
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

    def _check_results(self, mode: PlaceholderMode, step_name: str, span: StageSpan, output: Any, logs: list) -> None:
        results = [("the value the step returns", output)] + [(f"the logged value {c.name!r}", c.value) for c in logs]
        for what, value in results:
            tainted = find_tainted(mode, value)
            if tainted:
                raise RuntimeError(
                    f"`{step_name}` on stage {span.stage}: {what} is computed from "
                    f"{describe_sources(tainted[0][2], self.stack.block_path)}, which this rank does not hold or run. "
                    "With pipeline stages, what the step returns or logs after the blocks may depend on the last "
                    "block's output, the batch and parameters only; a value carried across blocks outside their "
                    "outputs (an auxiliary loss summed in the loop, a hook collecting router logits) must be "
                    "returned by each block and accumulated in its outputs instead."
                )

    def observe(self, step_name: str, step_args: tuple) -> StepObservation:
        """Run ``root.<step_name>(*step_args)`` once with every parameter and block treated as missing.

        Nothing heavy runs: blocks run as meta twins, operations on parameters on the meta device
        (or for real where this rank holds them, without gradients). Returns the order of block
        calls and the sources of every block input and step result.
        """
        if self._active is not None:
            raise RuntimeError("StageRunner.observe is not reentrant: a stage is already running.")
        observation = StepObservation(step_name)
        run = _ActiveRun(None, None, None, self._mode(observe=True), observation)
        self._active = run
        recorded: list[LogCall] = []
        try:
            with self._capture_logs(recorded), meta_autocast_disabled(), run.mode, torch.no_grad():
                output = getattr(self.root, step_name)(*step_args)
                results = [("the value the step returns", output)] + [
                    (f"the logged value {c.name!r}", c.value) for c in recorded
                ]
                for what, value in results:
                    found = [s for _, _, s in find_tainted(run.mode, value)]
                    observation.result_sources[what] = frozenset().union(*found)
        finally:
            self._active = None
        observation.reads = list(run.mode.reads)
        return observation

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
