"""Zero-bubble's split backward: an input-gradient pass (I) now, a weight-gradient pass (W) later.

I computes the gradients of the stage's inputs (what the previous stage waits for). On the way, it
records the gradient flowing into every graph node where a deferred parameter's own subgraph meets
the path from the inputs to the outputs (the "intermediates", found as in torch's
``torch.distributed.pipelining._backward``). W starts from those nodes with those gradients and
computes only those parameters' gradients, one parameter group at a time, so no input gradient is
computed twice. Parameters whose subgraph never meets that path (all of them on a first stage,
whose inputs are token ids) start from the stage outputs with the output gradients.

W computes the gradients of the *matrices* (parameters of two or more dimensions: linear and
embedding weights), which hold nearly all of the weight-gradient work (one matrix product each, as
large as the input gradient's). The gradients of vectors (norm scales, biases) are computed by I
on its way when it has input gradients to compute: a norm's backward produces its input's and its
weights' gradients in one kernel, and deferring its weights would run that kernel twice (measured on
the benchmark GPT's last stage: W 8.5 ms of which 1.2 ms layer-norm backward, against 0.55 ms for
the layer norms' whole backward in one pass), and a bias's is a sum over the gradient I already
has. This is what zero-bubble implementations defer in practice (Megatron's deferred weight-gradient
GEMMs); the schedule's W is the matrices' products, I no longer than the input gradients plus
these reductions. A stage without input gradients (a first stage fed token ids) runs no I at all.

Both passes accumulate through the autograd engine (``backward(..., inputs=...)``, entered without
the public call's gradient checks: ``_torch_compat.accumulate_from_edges``), so ``.grad``
accumulation and post-accumulate-grad hooks (optimizer offload) work as in one pass.
The gradients are exact: the same chain rule in another order of summation per parameter.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node

from lightning_pipe.runtime._torch_compat import (
    AccumulateGrad,
    accumulate_from_edges,
    grad_output_count,
    has_gradient_hooks,
    linear_weight_factors,
)


@dataclass
class _Group:
    """Parameters whose weight gradients start at the same intermediate nodes."""

    params: set[Node]
    intermediates: set[Node]
    grads: dict[Node, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightPass:
    """What the I pass kept for the W pass of one (stage, microbatch)."""

    groups: list[_Group]
    params_by_node: dict[Node, Tensor]

    def run(self, accumulate: bool = True) -> None:
        """Accumulate the weight gradients into ``.grad``; the W action. ``accumulate=False`` computes
        them the same way and drops them (what a measurement of W's cost needs: no ``.grad`` and no
        gradient hook sees them)."""
        through_engine: list[tuple[Node, Tensor]] = []  # (weight's accumulator, its gradient): one engine call
        for group in self.groups:
            found = _linear_weight(group)
            if found is not None:
                _add_product(*found, accumulate, through_engine)
                continue
            edges, grads = [], []
            for node, captured in group.grads.items():
                for index, grad in enumerate(captured):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue
            handles = []
            if len(group.grads) > 1:  # a node also reached through another one gets its own gradient once
                handles = [
                    node.register_prehook(lambda _, saved=captured: saved) for node, captured in group.grads.items()
                ]
            try:
                params = [self.params_by_node[node] for node in group.params]
                accumulate_from_edges(tuple(edges), tuple(grads), tuple(params), accumulate)
            finally:
                for handle in handles:
                    handle.remove()
        if through_engine:  # one engine call from the accumulators: nothing else to walk
            accumulate_from_edges(
                tuple(GradientEdge(node, 0) for node, _ in through_engine), tuple(grad for _, grad in through_engine),
                tuple(node.variable for node, _ in through_engine),
            )
        self.groups = []


def _add_product(accumulator: Node, left: Tensor, right: Tensor, accumulate: bool, through_engine: list) -> None:
    """Add a linear weight's gradient ``left.mm(right)`` to its ``.grad``.

    The engine would store the product (no ``.grad`` yet) or add it in place (``grad += product``);
    here the addition is fused into the product (``grad.addmm_(left, right)``: no product-sized
    temporary, no engine call), equal to the engine's up to the rounding of one addition, within the
    float64 parity of every test. A weight with gradient hooks (tensor hooks, post-accumulate-grad
    hooks: optimizer offload) goes through the engine, which runs them. Hooks registered on the
    accumulator node itself, which torch does not list, are not run for linear weights.
    """
    param = accumulator.variable
    with torch.no_grad():  # as the engine runs it: the saved operand requires grad
        if not accumulate:
            left.mm(right)
        elif has_gradient_hooks(param):
            through_engine.append((accumulator, left.mm(right)))
        elif param.grad is None:
            param.grad = left.mm(right)
        else:
            param.grad.addmm_(left, right)


def _linear_weight(group: _Group) -> tuple[Node, Tensor, Tensor] | None:
    """For a group that is one linear layer's weight, its accumulator and the two factors of its
    gradient; None for any other group."""
    if len(group.grads) != 1 or len(group.params) != 1:
        return None
    (node, captured), = group.grads.items()
    if len(captured) != 1 or captured[0] is None:
        return None
    found = linear_weight_factors(node, captured[0])
    return found if found is not None and found[0] in group.params else None


def _node(tensor: Tensor) -> Node | None:
    """The tensor's grad_fn, or for a leaf its gradient accumulator."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if tensor.requires_grad:
        return tensor.view_as(tensor).grad_fn.next_functions[0][0]
    return None


def _reverse_edges(roots: list[Node]) -> dict[Node, list[Node]]:
    """For every node below ``roots``, the nodes that feed gradients into it."""
    reverse: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            reverse[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return reverse


def _walk_up(starts: list[Node], reverse: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the outputs, not passing through ``stop``; and the
    ``stop`` nodes met."""
    reached, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for parent in reverse.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in reached:
                reached.add(parent)
                queue.append(parent)
    return reached, met


def _groups(outputs: list[Node], inputs: list[Node], params: list[Node], reverse) -> list[_Group]:
    on_path, _ = _walk_up(inputs, reverse, set())  # from the inputs up to the outputs
    targets = on_path | set(outputs)
    by_intermediate: dict[Node, _Group] = {}
    for param in params:
        _, met = _walk_up([param], reverse, targets)
        if param in targets:  # a parameter that is itself an output (rare): start from it
            met.add(param)
        group = _Group({param}, met)
        for node in met:
            existing = by_intermediate.get(node)
            if existing is not None and existing is not group:
                existing.params |= group.params
                existing.intermediates |= group.intermediates
                for other in group.intermediates:
                    by_intermediate[other] = existing
                group = existing
            by_intermediate[node] = group
    unique = {id(g): g for g in by_intermediate.values()}
    return list(unique.values())


@dataclass(frozen=True)
class _Analysis:
    """Which parameters I accumulates (``now``) and W computes (``later``), and W's groups as
    ``(parameters, intermediates)``: positions in a graph's traversal order (:func:`_traverse`)."""

    now: tuple[int, ...]
    later: tuple[int, ...]
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


# Every microbatch of a stage builds a graph of the same shape: its analysis (two thirds of I's own
# work beside the engine on the benchmark GPT's blocks) is computed once per shape.
_ANALYSES: dict[tuple, _Analysis] = {}
_MAX_ANALYSES = 64


def _traverse(outputs: list[Node], inputs: list[Node], runs_now: bool) -> tuple[list[Node], tuple]:
    """The graph's nodes, the (distinct) outputs first, then breadth-first; and a key equal for two
    graphs exactly when the analysis of one holds for the other: what it depends on, the edges
    between positions, the parameters' positions and kinds (matrix or vector), the inputs' positions."""
    position: dict[Node, int] = {}
    order: list[Node] = []
    for node in outputs:
        if node not in position:
            position[node] = len(order)
            order.append(node)
    num_outputs = len(order)
    edges, params = [], []
    for index, node in enumerate(order):  # grows while it runs
        children = []
        for child, _ in node.next_functions:
            if child is not None:
                found = position.get(child)
                if found is None:
                    found = position[child] = len(order)
                    order.append(child)
                children.append(found)
        edges.append(tuple(children))
        if type(node) is AccumulateGrad and isinstance(node.variable, nn.Parameter):
            params.append((index, node.variable.dim() >= 2))
    input_positions = []
    for node in inputs:  # an input no output depends on is not below them
        if node not in position:
            position[node] = len(order)
            order.append(node)
        input_positions.append(position[node])
    return order, (num_outputs, tuple(input_positions), runs_now, tuple(params), tuple(edges))


def _analyse(order: list[Node], key: tuple, runs_now: bool) -> _Analysis:
    """The analysis of one graph (:func:`_traverse` gave its ``order`` and ``key``)."""
    num_outputs, input_positions, _, params, _ = key
    position = {node: index for index, node in enumerate(order)}
    outputs = order[:num_outputs]
    reverse = _reverse_edges(outputs)
    now = tuple(index for index, matrix in params if runs_now and not matrix)
    later = tuple(index for index, matrix in params if not runs_now or matrix)
    groups = _groups(outputs, [order[i] for i in input_positions], [order[i] for i in later], reverse)
    kept = tuple((tuple(map(position.get, g.params)), tuple(map(position.get, g.intermediates))) for g in groups)
    return _Analysis(now, later, tuple(group for group in kept if group[1]))


def backward_input(
    outputs: list[Tensor], output_grads: list[Tensor | None], inputs: list[Tensor], accumulate: bool = True
) -> tuple[list[Tensor | None], WeightPass]:
    """The I pass: gradients of ``inputs`` (None where unused), and what W needs.

    Args:
        outputs: the stage's outputs (or its loss) that carry gradients.
        output_grads: the gradient of each output (None: ones, for a scalar loss).
        inputs: the stage's floating-point inputs (leaves; those not requiring grad get None).
        accumulate: False computes the vectors' gradients the same way and drops them (a measurement
            of I's cost: no ``.grad`` and no gradient hook sees them), as ``WeightPass.run`` does.

    The parameters are every ``nn.Parameter`` the outputs depend on (found in the graph): when
    there are input gradients to compute, I accumulates the vectors' gradients on the way and W
    the matrices'; otherwise W all of them (module docstring).
    """
    output_nodes = [n for n in map(_node, outputs) if n is not None]
    needs = [t for t in inputs if t.requires_grad]
    input_nodes = [n for n in (_node(t) for t in needs) if n is not None]
    runs_now = bool(outputs and needs)
    order, key = _traverse(output_nodes, input_nodes, runs_now)
    analysis = _ANALYSES.get(key)
    if analysis is None:
        if len(_ANALYSES) >= _MAX_ANALYSES:
            _ANALYSES.clear()
        analysis = _ANALYSES[key] = _analyse(order, key, runs_now)
    now = [order[i].variable for i in analysis.now]
    later = [order[i] for i in analysis.later]
    groups = [_Group({order[i] for i in params}, {order[i] for i in met}) for params, met in analysis.groups]
    captured: dict[Node, tuple[Tensor | None, ...]] = {}
    handles = []
    for node in {n for g in groups for n in g.intermediates}:
        handles.append(node.register_prehook(lambda grads, node=node: captured.__setitem__(node, tuple(grads))))
    held = [t.grad for t in needs]  # the inputs' own .grad, put back after: I leaves no trace on them
    computed: list[Tensor | None] = [None] * len(needs)
    try:
        if runs_now:
            for t in needs:
                t.grad = None
            grads = tuple(torch.ones_like(o) if g is None else g for o, g in zip(outputs, output_grads, strict=True))
            returned = accumulate_from_edges(tuple(map(_edge, outputs)), grads, (*needs, *now), accumulate)
            computed = [t.grad for t in needs] if accumulate else list(returned[: len(needs)])
    finally:
        for handle in handles:
            handle.remove()
        for t, grad in zip(needs, held):
            t.grad = grad
    _fill_from_outputs(captured, outputs, output_grads)
    for group in groups:
        group.grads = {node: captured[node] for node in group.intermediates if node in captured}
    by_id = {id(t): g for t, g in zip(needs, computed)}
    return [by_id.get(id(t)) for t in inputs], WeightPass(groups, {n: n.variable for n in later})


def _edge(tensor: Tensor) -> GradientEdge:
    """Where ``tensor``'s gradient enters the graph."""
    return GradientEdge(_node(tensor), tensor.output_nr if tensor.grad_fn is not None else 0)


def _fill_from_outputs(captured: dict, outputs: list[Tensor], output_grads: list[Tensor | None]) -> None:
    """Output nodes the I pass did not run (no input needed them) start W with the output gradients."""
    for output, grad in zip(outputs, output_grads, strict=True):
        node = _node(output)  # a parameter returned as it is: its accumulator
        if node is None or (node in captured and not isinstance(captured[node], list)):
            continue
        slots = captured.setdefault(node, [None] * grad_output_count(node))
        grad = torch.ones_like(output) if grad is None else grad
        slots[output.output_nr] = grad if slots[output.output_nr] is None else slots[output.output_nr] + grad
    for node, slots in captured.items():
        if isinstance(slots, list):
            captured[node] = tuple(slots)
