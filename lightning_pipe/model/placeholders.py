"""Real placeholders for values a stage cannot compute, and the proof that none reached a result.

During a stage run the parameters a rank does not hold are meta tensors. The code of the user's
step *between* units (attention masks, position ids, rotary tables, device moves) must still run for
real: models make data-dependent checks there (transformers' ``create_causal_mask`` calls
``.all()``) and move tensors to the device of their embeddings. :class:`PlaceholderMode` (a
torch-function mode, active outside the blocks this rank runs) gives every operation these rules:

* an operation on clean (real, not derived from a missing value) tensors runs for real;
* ``device="meta"`` (a factory such as ``torch.arange(T, device=embeds.device)``, or ``.to`` a meta
  tensor's device) means "this rank's device": non-owned values never decide where real tensors live;
* an operation that mixes a meta tensor with real ones runs on the meta device for its shape and
  returns a *placeholder*: a real tensor of zeros of that shape and dtype on the real device, never
  computed from anything; only meta tensors in: the result stays meta (a parameter's ``.T``
  allocates nothing);
* an operation on placeholders does the same: nothing is computed from a placeholder (no random
  numbers drawn, no running statistics updated), its results are placeholders too;
  value-independent factories (``zeros_like``, ``new_empty``, ...) give clean tensors, and ``.to``
  moves a placeholder where asked.

Every placeholder and every derived meta tensor carries its *sources*: the parameters and block
outputs it was derived from (``("param", name)``, ``("block", index)``, and ``("inside", index)`` for
a value produced inside a block but not among its outputs: a router loss collected by a hook). The
stage runner refuses to feed a placeholder to a block it runs, to return one as the loss or log it;
reading a placeholder's value (``.item()``, ``bool()``) is refused too, since a decision on zeros would
be silently wrong. In an *observation* run (every parameter treated as missing) the same sources
tell which unit needs which parameter and whether a value crosses blocks outside their outputs.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_pipe.model._torch_compat import tree_flatten, tree_leaves, tree_map, tree_unflatten, view_base
from lightning_pipe.model.shape_rules import TensorSpec

Source = tuple  # ("param", name) | ("block", index) | ("inside", index) | ("unknown",)

_TAG = "_lightning_pipe_sources"

_VALUE_READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__index__,
    Tensor.__complex__,
    Tensor.numpy,
    Tensor.__array__,
}
_VALUE_FREE = {  # results depend on shape, dtype and device only
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    Tensor.new_zeros,
    Tensor.new_ones,
    Tensor.new_empty,
    Tensor.new_full,
}
_MOVES = {Tensor.to, Tensor.cuda, Tensor.cpu, Tensor.type_as}
_SHAPE_DONORS = {Tensor.expand_as, Tensor.view_as, Tensor.reshape_as, Tensor.type_as}  # the 2nd gives shape or dtype


def describe_sources(sources: Iterable[Source], block_path: Callable[[int], str] | None = None) -> str:
    """Human words for a set of sources, for error messages."""
    words = []
    if any(s[0] != "unknown" for s in sources):  # a meta tensor with a better name beside it says nothing more
        sources = [s for s in sources if s[0] != "unknown"]
    for source in sorted(sources, key=repr):
        if source[0] == "param":
            words.append(f"parameter `{source[1]}`")
        elif source[0] == "block":
            words.append(f"the output of block `{block_path(source[1]) if block_path else source[1]}`")
        elif source[0] == "inside":
            words.append(
                f"a tensor produced inside block `{block_path(source[1]) if block_path else source[1]}` "
                "that is not among its outputs"
            )
        else:
            words.append("a tensor on the meta device")
    return ", ".join(words)


class PlaceholderReadError(RuntimeError):
    """User code read the value of a placeholder (``.item()``, ``bool()``, ...)."""

    def __init__(self, what: str, sources: frozenset) -> None:
        super().__init__(what)
        self.sources = sources


class PlaceholderCache:
    """What placeholders reuse across the runs of one stage runner, so that a later microbatch's
    placeholders cost neither a meta run nor memory.

    * ``shapes``: the placeholder shapes of an operation, keyed by its arguments' shapes, dtypes,
      strides and plain values. A meta run takes a few hundred microseconds (the embeddings and the
      code before the blocks, on every microbatch of a later stage); it depends on nothing else, and
      one that needs values fails instead of being memoised, so the memo is exact.
    * zero buffers, one per dtype and device: every placeholder is a view of one. A placeholder is
      never computed from and never written (operations on it run on meta, in-place ones are not
      performed), so placeholders may share their zeros; fresh ones cost an allocation and a fill per
      placeholder, as large as an activation, on every microbatch of every later stage.
    * one view of that buffer per shape: each placeholder is a fresh ``detach()`` of it (its own
      tensor object, for its own tag, without a base to tag), a fifth of the cost of slicing and
      viewing the buffer again, which every operation on a later stage's code before its blocks paid.
    """

    def __init__(self) -> None:
        self.shapes: dict[Any, tuple[list[Any], Any]] = {}
        self._zeros: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._views: dict[tuple[torch.Size, torch.dtype, torch.device], Tensor] = {}

    def zeros(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A tensor of zeros of ``shape``: a view of this cache's buffer for ``dtype`` and ``device``.
        Call it with torch-function handling off (inside a mode's handler): it runs tensor operations."""
        key = (shape, dtype, device)
        view = self._views.get(key)
        if view is None:
            numel = shape.numel()
            buffer = self._zeros.get((dtype, device))
            if buffer is None or buffer.numel() < numel:
                buffer = self._zeros[(dtype, device)] = torch.zeros(max(numel, 1), dtype=dtype, device=device)
                self._views.clear()  # views of the smaller buffer would keep it alive
            if len(self._views) >= _MEMO_LIMIT:
                self._views.clear()
            view = self._views[key] = buffer[:numel].view(shape)
        return view.detach()


class PlaceholderMode(TorchFunctionMode):
    """Run the code between units for real; values needing missing parameters become placeholders.

    Args:
        device: this rank's device (where ``device="meta"`` requests go, and placeholders live).
        parameter_names: ``id(parameter) -> name`` for every parameter of the module (names of
            sources; in an observation run also which real tensors count as missing).
        observe: treat every parameter as missing and let value reads return the zeros' values
            (recorded in :attr:`reads`) instead of raising.
        describe_block: block index -> its dotted path, for messages.
        cache: what placeholders reuse across runs, kept by the caller (:class:`PlaceholderCache`);
            None: every placeholder is allocated and every operation on one runs on meta.
        observers: objects whose ``observe(func, args, kwargs, result)`` is called after each
            operation the mode sees (a loss counter), with the operation's arguments and its result
            under these rules; they see the step's operations, not the mode's own.
    """

    def __init__(
        self,
        device: torch.device,
        parameter_names: dict[int, str],
        observe: bool = False,
        describe_block: Callable[[int], str] | None = None,
        cache: PlaceholderCache | None = None,
        observers: tuple[Any, ...] = (),
    ) -> None:
        super().__init__()
        self.device = device
        self.parameter_names = parameter_names
        self.observe = observe
        self.describe_block = describe_block
        self.cache = cache
        self.observers = observers
        self.inside: int | None = None  # observation: index of the block whose meta twin runs
        self.reads: list[frozenset] = []
        self._run = object()  # tags of earlier runs are ignored (a tensor may outlive a run)

    # --- tags --------------------------------------------------------------------------------

    def sources_of(self, value: Any) -> frozenset | None:
        """The sources of a tensor, or None for a clean (real, fully computed) tensor."""
        if not isinstance(value, Tensor):
            return None
        tag = value.__dict__.get(_TAG)
        if tag is not None and tag[0] is self._run:
            return tag[1]
        name = self.parameter_names.get(id(value))
        if name is not None and (self.observe or value.is_meta):
            return frozenset({("param", name)})
        if value.is_meta:
            return frozenset({("unknown",)})
        return None

    def tag(self, value: Tensor, sources: frozenset) -> None:
        """Mark ``value`` (never a parameter or buffer) as derived from ``sources``."""
        if isinstance(value, nn.Parameter) or id(value) in self.parameter_names:
            return
        value.__dict__[_TAG] = (self._run, sources | self._own_tag(value))
        base = view_base(value)
        if base is not None and not isinstance(base, nn.Parameter) and id(base) not in self.parameter_names:
            base.__dict__[_TAG] = (self._run, sources | self._own_tag(base))

    def _own_tag(self, value: Tensor) -> frozenset:
        tag = value.__dict__.get(_TAG)
        return tag[1] if tag is not None and tag[0] is self._run else frozenset()

    def placeholder(self, meta: Any, sources: frozenset, device: torch.device | None = None) -> Tensor:
        """A real tensor of zeros shaped like ``meta`` (a meta tensor, or anything with ``shape`` and
        ``dtype``: a block's remembered output spec), tagged with ``sources``."""
        device = device or self.device
        if self.cache is not None:
            out = self.cache.zeros(meta.shape, meta.dtype, device)
        else:
            out = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
        out.__dict__[_TAG] = (self._run, sources)
        return out

    # --- the rule per operation -------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = self._apply(func, args, kwargs)
        for observer in self.observers:
            observer.observe(func, args, kwargs, result)
        return result

    def _apply(self, func, args: tuple, kwargs: dict) -> Any:
        if self.inside is None and ("device" in kwargs or func in _MOVES):
            args, kwargs = real_devices(func, args, kwargs, self.device)
        leaves = _tensor_leaves(args, kwargs)
        tainted = [s for s in (self.sources_of(t) for t in leaves) if s is not None]
        if self.inside is not None:
            tainted.append(frozenset({("inside", self.inside)}))
        if not tainted:
            return func(*args, **kwargs)
        sources = frozenset().union(*tainted)
        if func in _VALUE_READS:
            return self._read(func, args, kwargs, sources)
        if func in _VALUE_FREE:
            return func(*tree_map(self._stand_in, args), **tree_map(self._stand_in, kwargs))
        if func in _SHAPE_DONORS and len(args) == 2 and not args[0].is_meta and self.sources_of(args[0]) is None:
            return func(args[0], self._stand_in(args[1]))  # mask.expand_as(embeds): the mask stays clean
        return self._on_meta(func, args, kwargs, leaves, sources)

    def _stand_in(self, value: Any) -> Any:
        if isinstance(value, Tensor) and (value.is_meta or self.sources_of(value) is not None):
            return torch.empty(value.shape, dtype=value.dtype, device=self.device if value.is_meta else value.device)
        return value

    def _on_meta(self, func, args: tuple, kwargs: dict, leaves: list[Tensor], sources: frozenset) -> Any:
        """Shapes from the meta device; results real zeros where a real tensor took part, else meta."""
        real = [t for t in leaves if not t.is_meta]
        if func in _MOVES and args and isinstance(args[0], Tensor) and not args[0].is_meta:
            moved = args[0].new_empty(0).to(*args[1:], **kwargs) if func is Tensor.to else getattr(
                args[0].new_empty(0), func.__name__
            )(*args[1:], **kwargs)
            meta = torch.empty(args[0].shape, dtype=moved.dtype, device="meta")
            return self.placeholder(meta, sources, moved.device)
        if func is F.embedding and real and (spec := _embedding_spec(args, kwargs)) is not None:
            return self.placeholder(spec, sources, _result_device(kwargs, real))
        memo = self.cache.shapes if self.cache is not None else None
        key = _memo_key(func, args, kwargs) if real and memo is not None and not _is_inplace(func, kwargs) else None
        if key is not None and key in memo:
            described, spec = memo[key]
            device = _result_device(kwargs, real)
            if spec is None:  # one tensor, the usual result
                return self.placeholder(described[0], sources, device)
            return tree_unflatten(
                [self.placeholder(item, sources, device) if isinstance(item, TensorSpec) else item for item in described],
                spec,
            )
        meta_args, meta_kwargs = tree_map(_to_meta, (args, kwargs))
        if _is_real_device(meta_kwargs.get("device")):
            meta_kwargs["device"] = torch.device("meta")
        if func in (Tensor.cuda, Tensor.cpu):
            result = meta_args[0]
        elif func is Tensor.to:
            meta_args = (meta_args[0], *(torch.device("meta") if _is_real_device(a) else a for a in meta_args[1:]))
            result = func(*meta_args, **meta_kwargs)
        else:
            try:
                result = func(*meta_args, **meta_kwargs)
            except (NotImplementedError, RuntimeError) as error:
                raise RuntimeError(
                    f"`{_name(func)}` needs the values of {describe_sources(sources, self.describe_block)}, which this "
                    f"rank does not hold, and its result's shape depends on them ({type(error).__name__}: {error}). "
                    "Compute such values inside a block (they then travel with the block's outputs)."
                ) from None
        if not real:
            for leaf in tree_flatten(result)[0]:
                if isinstance(leaf, Tensor):
                    self.tag(leaf, sources)
            return result
        if _is_inplace(func, kwargs):  # a real tensor updated by a value this rank cannot compute
            target = kwargs.get("out", args[0])
            for leaf in tree_flatten(target)[0]:
                if isinstance(leaf, Tensor):
                    self.tag(leaf, sources)
            return None if func.__name__ == "__setitem__" else target
        if key is not None:
            _remember(memo, key, result)
        device = _result_device(kwargs, real)
        return tree_map(
            lambda leaf: self.placeholder(leaf, sources, device) if isinstance(leaf, Tensor) and leaf.is_meta else leaf,
            result,
        )

    def _read(self, func, args: tuple, kwargs: dict, sources: frozenset) -> Any:
        if not self.observe:
            raise PlaceholderReadError(
                f"The step reads the value of a tensor (`{_name(func)}`) computed from "
                f"{describe_sources(sources, self.describe_block)}, which this rank does not hold. A pipeline stage "
                "runs the code between blocks without the parameters of other stages; decisions on their values "
                "cannot be made there. Move this computation inside a block, or make it depend on the batch only.",
                sources,
            )
        self.reads.append(sources)
        stand_in = torch.zeros(args[0].shape, dtype=args[0].dtype)
        return func(stand_in, *args[1:], **kwargs)


def real_devices(func: Any, args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """Rewrite ``device="meta"`` (and ``.to`` a meta device or meta tensor, on a real tensor) to ``device``.

    On a rank that holds no parameters of a unit, ``embeds.device`` is ``meta``; the user's code
    means "where the model lives", which for what does not need those parameters is this rank.
    """
    if func in _MOVES and args and isinstance(args[0], Tensor) and args[0].is_meta:
        return args, kwargs  # a missing tensor stays missing, wherever it is asked to go
    if _is_meta_device(kwargs.get("device")):
        kwargs = {**kwargs, "device": device}
    if func in _MOVES and args and isinstance(args[0], Tensor) and not args[0].is_meta:
        rest = []
        for arg in args[1:]:
            if _is_meta_device(arg):
                arg = device
            elif isinstance(arg, Tensor) and arg.is_meta:
                arg = torch.empty((), dtype=arg.dtype, device=device)
            rest.append(arg)
        args = (args[0], *rest)
    return args, kwargs


_MEMO_LIMIT = 4096
_MEMO_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size, type(Ellipsis))


class _Unkeyable(Exception):
    """An argument the memo key cannot describe exactly; its operation always runs on meta."""


def _memo_key(func: Any, args: tuple, kwargs: dict) -> Any:
    """What a meta run of ``func`` depends on, hashable; None when an argument cannot be described
    exactly (an object whose attributes could matter), which then always runs on meta."""
    try:
        key = (func, _describe(args), _describe(kwargs))
        hash(key)  # a function object without a hash
    except (_Unkeyable, TypeError):
        return None
    return key


def _describe(value: Any) -> Any:
    kind = type(value)
    if isinstance(value, Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.is_meta)
    if kind is tuple or kind is list:
        return (kind.__name__, tuple(_describe(item) for item in value))
    if kind is dict:
        return ("dict", tuple((key, _describe(item)) for key, item in value.items()))
    if kind is slice:
        return ("slice", _describe(value.start), _describe(value.stop), _describe(value.step))
    if kind in _MEMO_PLAIN:
        return (kind, value)  # the type too: True and 1 are equal keys, but not equal arguments
    raise _Unkeyable


def _remember(memo: dict, key: Any, result: Any) -> None:
    """Keep a meta run's result shapes under ``key`` (only when every tensor in it is meta: those
    are what become placeholders); a single tensor is kept without a tree spec (None)."""
    results, spec = tree_flatten(result)
    if not all(leaf.is_meta for leaf in results if isinstance(leaf, Tensor)):
        return
    if len(memo) >= _MEMO_LIMIT:  # many lengths: start over rather than grow without end
        memo.clear()
    described = [TensorSpec(leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else leaf for leaf in results]
    memo[key] = (described, None if isinstance(result, Tensor) else spec)


def _embedding_spec(args: tuple, kwargs: dict) -> TensorSpec | None:
    """The result of ``F.embedding(indices, weight)``: a row of ``weight`` per index, shaped from the
    two without a meta run. A later stage embeds every microbatch's tokens with the first stage's
    (meta) table, and with microbatches at their own lengths nearly every one is a memo miss: its
    meta run took 0.25 ms in a step, against 0.03 ms for this. None for arguments it does not know."""
    bound = dict(zip(("input", "weight"), args), **{k: v for k, v in kwargs.items() if k in ("input", "weight")})
    indices, weight = bound.get("input"), bound.get("weight")
    if not (isinstance(indices, Tensor) and isinstance(weight, Tensor) and weight.dim() == 2):
        return None
    if indices.dtype not in (torch.int32, torch.int64):
        return None  # the meta run raises what torch raises
    return TensorSpec(torch.Size((*indices.shape, weight.shape[1])), weight.dtype)


def _result_device(kwargs: dict, real: list[Tensor]) -> torch.device:
    """Where a placeholder result lives: the call's real ``device=``, else its first real input's."""
    device = kwargs.get("device")
    return device if _is_real_device(device) else real[0].device


def _tensor_leaves(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among a call's arguments."""
    return [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]


def _name(func: Any) -> str:
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    return getattr(owner, "__name__", name) if name == "__get__" else name


def _is_inplace(func: Any, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if "out" in kwargs or name == "__setitem__" or (name.startswith("__i") and name.endswith("__")):
        return True
    return name.endswith("_") and not name.startswith("__")


def _is_meta_device(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "meta") or value == "meta"


def _is_real_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type != "meta"
    return isinstance(value, str) and value != "meta" and value.split(":")[0] in ("cpu", "cuda", "mps", "xpu", "hpu")


def _to_meta(value: Any) -> Any:
    if isinstance(value, Tensor) and not value.is_meta:
        return value.detach().to("meta")
    return value


def find_tainted(mode: PlaceholderMode, value: Any) -> list[tuple[int, Tensor, frozenset]]:
    """``(leaf position, tensor, sources)`` of every placeholder or meta tensor among ``value``'s leaves."""
    found = []
    for position, leaf in enumerate(tree_leaves(value)):
        sources = mode.sources_of(leaf)
        if sources is not None:
            found.append((position, leaf, sources))
    return found
