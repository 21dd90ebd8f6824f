"""Cut an unchanged transformer block at its attention call: pre-attention, attention, post-attention.

HelixPipe places the parameterised parts of a layer (pre-attention: norm and QKV projection;
post-attention: output projection and MLP) on other ranks than the parameter-free attention core.
The user's block is one ``forward``; this module turns it into three callables without touching its
class or source.

Mechanism, and why. The block is captured once with ``torch.export`` (the training IR, which keeps
``aten.scaled_dot_product_attention`` and custom attention operators as single nodes) with every
dimension of its tensor inputs symbolic except the last, so one capture serves every batch size and
sequence length. The graph is then cut at its one attention node: the *pre* unit holds every node the
attention depends on (plus shape guards), the *attention* unit the node alone, and the *post* unit
everything else. Values that cross a cut (the residual stream, symbolic sizes) become outputs of the
earlier unit and inputs of the later one. The three units are ``torch.fx.GraphModule`` objects whose
parameters *are* the block's parameters (same tensor objects), so gradients land where a
single-process run puts them, and the composition runs exactly the block's operations in the block's
order: in float64 it equals the block's output bit for bit. Alternatives considered: intercepting the
attention call at run time (a torch-function mode) cannot resume the block's frame after the call, so
post-attention would have to rerun pre-attention; ``torch.fx.symbolic_trace`` fails on transformers'
layers (shape-dependent Python branches), which ``torch.export`` handles with guards.

What is recognised as attention: ``F.scaled_dot_product_attention`` (and its flash / efficient / math
kernels), flash-attn's operators, and transformers' attention interface when it dispatches to one of
those (``attn_implementation="sdpa"`` or ``"flash_attention_2"``; the ``"eager"`` implementation is a
plain matmul-softmax and is refused). A block that cannot be exported, has no attention call or more
than one is refused with :class:`BlockNotSplittable` naming the reason and what to change; schedules
that do not cut blocks are unaffected.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ._torch_compat import tree_flatten, tree_map, tree_unflatten

__all__ = ["BlockNotSplittable", "SubBlockUnits", "is_attention_node", "split_block_at_attention"]


class BlockNotSplittable(ValueError):
    """A block the sub-block schedules (``helix``) cannot cut at its attention; says why and what to do."""


_ATTENTION_NAMES = (
    "aten.scaled_dot_product_attention",
    "aten._scaled_dot_product_flash_attention",
    "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._flash_attention_forward",
    "aten._efficient_attention_forward",
    "flash_attn.",  # flash-attn's custom operators (flash_attn::_flash_attn_forward, varlen, ...)
    "flash_attn_3.",
)


def is_attention_node(node: fx.Node) -> bool:
    """Whether an exported graph node is an attention call this module cuts at."""
    if node.op != "call_function":
        return False
    name = str(node.target)
    return any(name.startswith(prefix) for prefix in _ATTENTION_NAMES)


@dataclass
class SubBlockUnits:
    """A block cut into three units (see the module docstring).

    Call order: ``carried, attention_inputs = pre(*args, **kwargs)``;
    ``out = attention(*attention_inputs)``; ``block_output = post(out, *carried)``.

    Attributes:
        pre: ``GraphModule``: flat block inputs -> attention inputs followed by carried values.
        attention: ``GraphModule``: attention inputs -> attention output (no parameters).
        post: ``GraphModule``: attention output and carried values -> flat block outputs.
        num_attention_inputs: how many of ``pre``'s outputs go to ``attention``.
        in_spec: pytree spec of the block's ``(args, kwargs)``.
        out_spec: pytree spec of the block's output.
        carried_tensors: per carried value, whether it is a tensor (False: a size, an int).
    """

    pre: fx.GraphModule
    attention: fx.GraphModule
    post: fx.GraphModule
    num_attention_inputs: int
    in_spec: Any
    out_spec: Any
    carried_tensors: tuple[bool, ...] = ()
    layouts: dict[str, tuple[tuple[int, ...] | None, ...]] = field(default_factory=dict)

    def tensor_names(self, unit: str) -> frozenset[str]:
        """Names, relative to the block, of the parameters and buffers ``unit`` (``"pre"`` or ``"post"``)
        reads: what a rank running only that unit must hold (HelixPipe's sharding by sub-block unit)."""
        graph = getattr(self, unit).graph
        return frozenset(str(node.target) for node in graph.nodes if node.op == "get_attr")

    def chunk_mlp(self, chunk_size: int, names: Sequence[str] = ("mlp", "ffn", "feed_forward")) -> SubBlockUnits:
        """The same units with the block's MLP, inside ``post``, run in sequence chunks of ``chunk_size``
        (HelixPipe's chunked MLP: the hidden layer's working memory shrinks to one chunk's).

        The MLP is the part of ``post``'s graph that the capture attributes to a submodule named one of
        ``names``; it must take one tensor ``[..., T, C]`` and give one, position by position (the
        usual MLP: linear layers and pointwise activations). Chunks along dimension -2 are concatenated
        back; results equal the unchunked ones up to the order of floating-point sums.

        Raises:
            ValueError: no such submodule, or it takes or gives more than one value.
        """
        graph = self.post.graph
        region = [n for n in graph.nodes if n.op == "call_function" and _module_root(n) in names]
        inside = set(region)
        if not region:
            raise ValueError(f"`mlp_chunk_size`: the block has no submodule named {list(names)} after its attention")
        inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes if a not in inside and a.op != "get_attr"))
        outputs = [n for n in region if any(user not in inside for user in n.users)]
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(
                f"`mlp_chunk_size`: the block's MLP takes {len(inputs)} values and gives {len(outputs)}; chunking needs "
                "one tensor in and one out"
            )
        chunked = _ChunkedModule(_subgraph(self.post, region, inputs, outputs), chunk_size)
        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in graph.nodes:
            if node in inside:
                if node is outputs[0]:
                    env[node] = new.call_module("chunked_mlp", (env[inputs[0]],))
                continue
            env[node] = new.node_copy(node, lambda n: env[n])
        root = nn.Module()
        for name, child in self.post.named_children():
            root.add_module(name, child)
        for name, tensor in self.post.named_parameters(recurse=False):
            root.register_parameter(name, tensor)
        for name, tensor in self.post.named_buffers(recurse=False):
            root.register_buffer(name, tensor)
        root.add_module("chunked_mlp", chunked)
        new.lint()
        return dataclasses.replace(self, post=fx.GraphModule(root, new))

    def rebind(self, block: nn.Module) -> SubBlockUnits:
        """The same cut for another block of the stack (same class and parameter shapes): units that
        use ``block``'s own parameters, with no second capture.

        Raises:
            BlockNotSplittable: when ``block``'s parameters and buffers do not match by name and shape.
        """
        mine = {n: tuple(t.shape) for n, t in _tensors(self.pre) | _tensors(self.post)}
        theirs = dict((n, tuple(t.shape)) for n, t in _tensors(block))
        if any(theirs.get(name) != shape for name, shape in mine.items()):
            raise _refuse(block, "its parameters differ from the captured block's (a stack of unlike blocks)")

        def module(unit: fx.GraphModule) -> fx.GraphModule:
            root = nn.Module()
            for name, child in block.named_children():
                root.add_module(name, child)
            for name, tensor in block.named_parameters(recurse=False):
                root.register_parameter(name, tensor)
            for name, tensor in block.named_buffers(recurse=False):
                root.register_buffer(name, tensor)
            for node in unit.graph.nodes:  # effect-only submodules of the capture (shape guards)
                if node.op == "call_module" and not hasattr(root, str(node.target)):
                    root.add_module(str(node.target), unit.get_submodule(str(node.target)))
            return fx.GraphModule(root, unit.graph)

        return SubBlockUnits(
            module(self.pre), self.attention, module(self.post), self.num_attention_inputs, self.in_spec,
            self.out_spec, self.carried_tensors, self.layouts,
        )

    def run_pre(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Pre-attention: ``(attention_inputs, carried)`` from the block's own arguments."""
        flat, spec = tree_flatten((args, _without_caches(kwargs)))
        if spec != self.in_spec:
            raise BlockNotSplittable(
                f"the block was captured for arguments shaped {self.in_spec} but is called with {spec}; "
                "sub-block units need the same argument structure at every call"
            )
        try:
            outputs = tuple(self.pre(*flat))
        except AssertionError as error:  # torch.export's shape guards
            if "Guard failed" not in str(error):
                raise
            raise BlockNotSplittable(
                f"the units were captured for other sizes ({error}); torch.export fixes a dimension that is 0 or 1 "
                "in the example: capture with an example whose batch and sequence sizes are at least 2"
            ) from error
        return outputs[: self.num_attention_inputs], outputs[self.num_attention_inputs :]

    def run_attention(self, *attention_inputs: Any) -> Any:
        """The attention core (parameter-free), on inputs in the captured memory layout."""
        inputs = _in_layouts(attention_inputs, self.layouts.get("attention_inputs", ()))
        return self.attention(*inputs)[0]

    def run_post(self, attention_output: Any, *carried: Any) -> Any:
        """Post-attention: the block's output, structured as the block returns it."""
        values = _in_layouts((attention_output, *carried), self.layouts.get("post_inputs", ()))
        flat = self.post(*values)
        return tree_unflatten(list(flat), self.out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The three units composed: equal to the block's forward."""
        attention_inputs, carried = self.run_pre(*args, **kwargs)
        return self.run_post(self.run_attention(*attention_inputs), *carried)


def _layout(value: Any) -> tuple[int, ...] | None:
    """A tensor's dimensions from the largest stride to the smallest (None: not a tensor)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    return tuple(sorted(range(value.dim()), key=lambda d: (-value.stride(d), d)))


def _in_layouts(values: Sequence[Any], layouts: Sequence[tuple[int, ...] | None]) -> list[Any]:
    """``values`` with every tensor in its recorded layout (a differentiable copy where it differs).

    The captured graph may rely on the layout it saw: a ``.contiguous()`` that was a no-op during
    capture is dropped, so a ``view`` after it needs the same strides. A tensor that crossed a process
    boundary arrives contiguous; this puts it back as the capture saw it (same values, same ops)."""
    out = list(values)
    for index, order in enumerate(layouts):
        value = out[index] if index < len(out) else None
        if order is None or not isinstance(value, torch.Tensor) or _layout(value) == order:
            continue
        inverse = tuple(sorted(range(len(order)), key=lambda d: order[d]))
        out[index] = value.permute(order).contiguous().permute(inverse)
    return out


def _is_cache(value: Any) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__)


def _without_caches(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with transformers' key/value caches replaced by None.

    A training step builds a cache (``use_cache`` defaults to True) that every layer appends its keys
    and values to, and nothing reads: the loss does not depend on it. The units cannot carry it (it is
    neither a tensor nor a size), so they run without it; a step that returns or reads the cache would
    see it empty."""
    return {k: None if _is_cache(v) else v for k, v in kwargs.items()}


def _tensors(module: nn.Module) -> set[tuple[str, torch.Tensor]]:
    return set(module.named_parameters()) | {(n, b) for n, b in module.named_buffers() if b is not None}


def _dynamic_shapes(block: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every dimension of every tensor input symbolic except the last of floating tensors (features, head
    size), keyed by the names of ``block.forward``'s parameters (what ``torch.export`` expects with keyword
    arguments). The last dimension of a mask (``[B, 1, T, T]``, boolean or additive) follows the sequence:
    a floating tensor of 4 dimensions or more, or any non-floating one, keeps it symbolic too (``AUTO``:
    fixed where the block's code fixes it)."""

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            last = value.dim() if (not value.is_floating_point() or value.dim() >= 4) else value.dim() - 1
            return {d: torch.export.Dim.AUTO for d in range(max(last, 0))} or None
        return None

    bound = inspect.signature(block.forward).bind(*args, **kwargs)
    return {name: tree_map(spec, value) for name, value in bound.arguments.items()}


def _subgraph(
    root: fx.GraphModule, nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]
) -> fx.GraphModule:
    """A module running ``nodes`` (in order) from ``inputs`` to the tuple of ``outputs``; parameters and
    buffers (``get_attr``) are fetched from ``root`` where used, so they stay the block's own tensors."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in mapping and node.op == "get_attr":
            mapping[node] = graph.get_attr(node.target)  # type: ignore[arg-type]
        return mapping[node]

    for node in inputs:
        mapping[node] = graph.placeholder(node.name)
        mapping[node].meta = dict(node.meta)
    for node in nodes:
        mapping[node] = graph.node_copy(node, lookup)
    graph.output(tuple(lookup(n) for n in outputs))
    graph.lint()
    return fx.GraphModule(root, graph)


def _module_root(node: fx.Node) -> str | None:
    """The first name of the innermost submodule path the capture gives ``node`` (``"mlp"`` for
    ``mlp.c_fc``), or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path.split(".")[0] if path else None


class _ChunkedModule(nn.Module):
    """Runs a one-tensor-in, one-tensor-out graph in chunks along dimension -2."""

    def __init__(self, inner: fx.GraphModule, chunk_size: int) -> None:
        super().__init__()
        self.inner, self.chunk_size = inner, chunk_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2] <= self.chunk_size:
            return self.inner(x)[0]
        return torch.cat([self.inner(piece)[0] for piece in x.split(self.chunk_size, dim=-2)], dim=-2)


def _refuse(block: nn.Module, reason: str) -> BlockNotSplittable:
    return BlockNotSplittable(
        f"block {type(block).__name__} cannot be cut at its attention for sub-block schedules (schedule='helix'): "
        f"{reason}. Call attention through F.scaled_dot_product_attention or flash-attn (transformers: "
        "attn_implementation='sdpa'), exactly once per block, or use a schedule that keeps blocks whole "
        "(1f1b, zb_h1, interleaved_1f1b)."
    )


def split_block_at_attention(
    block: nn.Module, args: tuple, kwargs: dict | None = None, *, capture: Callable[..., Any] | None = None
) -> SubBlockUnits:
    """Capture ``block`` once and cut it into pre-attention, attention and post-attention units.

    Args:
        block: the user's block, unchanged (its parameters are shared with the units).
        args: example positional arguments of one call (any batch size and sequence length of at least
            2: torch.export fixes a dimension that is 0 or 1 in the example, and the units then refuse
            other sizes).
        kwargs: example keyword arguments.
        capture: replaces ``torch.export.export`` (tests).

    Returns:
        The units.

    Raises:
        BlockNotSplittable: when the block cannot be captured, or has no or several attention calls.
    """
    kwargs = _without_caches(dict(kwargs or {}))
    exporter = capture or torch.export.export
    try:
        program = exporter(block, tuple(args), kwargs, dynamic_shapes=_dynamic_shapes(block, tuple(args), kwargs))
    except Exception as error:  # noqa: BLE001 - any capture failure is a refusal with its reason
        raise _refuse(block, f"torch.export could not capture it ({type(error).__name__}: {str(error)[:300]})") from error
    module = program.module()
    graph = module.graph
    attention = [n for n in graph.nodes if is_attention_node(n)]
    if len(attention) != 1:
        found = "no attention call" if not attention else f"{len(attention)} attention calls"
        raise _refuse(block, f"its captured graph holds {found}")
    core = attention[0]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    ancestors: set[fx.Node] = set()
    stack = list(core.all_input_nodes)
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    # shape guards and other effect-only nodes that need nothing after the cut run with pre-attention
    for node in graph.nodes:
        if node.op not in ("placeholder", "output", "get_attr") and not node.users and node is not core:
            if all(n in ancestors or n.op in ("placeholder", "get_attr") for n in node.all_input_nodes):
                ancestors.add(node)
    computed = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    pre_nodes = [n for n in computed if n in ancestors]
    post_nodes = [n for n in computed if n not in ancestors and n is not core]
    post_set = set(post_nodes) | {output}
    attention_inputs = [n for n in core.all_input_nodes if n.op != "get_attr"]
    carried = [n for n in placeholders + pre_nodes if any(user in post_set for user in n.users)]
    leaves = tree_flatten(output.args[0])[0]
    results = [n for n in leaves if isinstance(n, fx.Node)]
    if len(results) != len(leaves):
        raise _refuse(block, "it returns a constant among its outputs")
    units = SubBlockUnits(
        pre=_subgraph(module, pre_nodes, placeholders, attention_inputs + carried),
        attention=_subgraph(module, [core], attention_inputs, [core]),
        post=_subgraph(module, post_nodes, [core] + carried, results),
        num_attention_inputs=len(attention_inputs),
        in_spec=program.call_spec.in_spec,
        out_spec=program.call_spec.out_spec,
        carried_tensors=tuple(isinstance(n.meta.get("val"), torch.Tensor) for n in carried),
    )
    with torch.no_grad():  # one real run of the example records the layouts the graph saw
        attention_values, carried_values = units.run_pre(*args, **kwargs)
        output = units.attention(*attention_values)[0]
    units.layouts = {
        "attention_inputs": tuple(_layout(v) for v in attention_values),
        "post_inputs": tuple(_layout(v) for v in (output, *carried_values)),
    }
    return units
