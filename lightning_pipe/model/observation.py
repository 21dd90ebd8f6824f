"""What the first step showed: the order of blocks, and which unit needs which parameter.

:meth:`StageRunner.observe <lightning_pipe.model.StageRunner.observe>` runs a step once with every
parameter and block treated as missing (meta twins, placeholders; nothing heavy runs) and records
the sources of every block input and step result. This module turns that into:

* checks that pipeline stages can run the step exactly (:func:`check_observation`): every block
  called once, in order; a block's inputs derived from the previous block's output only (plus
  the batch and parameters); the step's results from the last block's output only, and nothing
  produced inside a block outside its outputs (hooks, lists) reaching them;
* units by use (:func:`layout_from_observation`): a parameter belongs to every unit whose inputs
  or results it reaches (through the code between blocks), wherever it is declared. A head declared
  before the blocks is ``post``; tied or directly reused weights are shared by ``pre`` and ``post``.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from lightning_pipe.model.blocks import BlockStack
from lightning_pipe.model.placeholders import describe_sources
from lightning_pipe.model.stage_runner import StepObservation
from lightning_pipe.model.units import UnitLayout, make_layout, registered_tensors


def _order_problem(calls: list[int], num_blocks: int) -> str | None:
    if calls == list(range(num_blocks)):
        return None
    seen: set[int] = set()
    for position, index in enumerate(calls):
        if index in seen:
            return f"block {index} is called again after block {calls[position - 1]} (the stack runs more than once)"
        if position and index != calls[position - 1] + 1:
            return f"block {index} is called right after block {calls[position - 1]} (out of order)"
        if not position and index != 0:
            return f"the first block called is block {index}, not block 0 (out of order)"
        seen.add(index)
    missing = sorted(set(range(num_blocks)) - seen)
    return f"blocks {missing} are never called"


def check_observation(observation: StepObservation, stack: BlockStack) -> None:
    """Refuse a step that pipeline stages cannot run exactly, with what to change.

    Raises:
        ValueError: blocks not called exactly once each in order; a block input or a step result
            derived from a block output other than the previous (last) block's, or from a value
            produced inside a block outside its outputs.
    """
    name, path = observation.step_name, stack.path
    calls = observation.block_calls
    problem = _order_problem(calls, stack.num_blocks)
    if problem is not None:
        shown = ", ".join(map(str, calls[:24])) + (", ..." if len(calls) > 24 else "")
        raise ValueError(
            f"`{name}` calls the blocks of `{path}` in the order [{shown}]: {problem}. Pipeline stages need every "
            "block called exactly once per step, in order, since each stage runs a contiguous range of them once. "
            "Weight sharing across depth (ALBERT-style shared layers, looped models) or a custom order cannot be "
            "split into stages: train such a model without pipeline parallelism, or give each position its own "
            "block; if another container is the real stack, name it with `ElasticPipelineStrategy(blocks=...)`."
        )
    describe = stack.block_path
    for index, sources in zip(calls, observation.block_sources):
        bad = {s for s in sources if (s[0] == "block" and s[1] != index - 1) or s[0] in ("inside", "unknown")}
        if bad:
            raise ValueError(
                f"`{name}`: the inputs of block `{describe(index)}` are computed from "
                f"{describe_sources(bad, describe)}. A stage that starts at this block receives only the previous "
                "block's output, so values carried across blocks outside the block outputs cannot reach it. Return "
                "such a value from every block (as part of its output) and pass it on, or compute it from the batch."
            )
    last = stack.num_blocks - 1
    for what, sources in observation.result_sources.items():
        bad = {s for s in sources if (s[0] == "block" and s[1] != last) or s[0] in ("inside", "unknown")}
        if bad:
            raise ValueError(
                f"`{name}`: {what} is computed from {describe_sources(bad, describe)}. The last stage receives only "
                f"the last block's output (`{describe(last)}`), so a value carried across blocks outside their "
                "outputs (an auxiliary or MoE load-balancing loss summed over the blocks, router logits collected "
                "by a hook) would be missing on it and the result silently wrong. Return such a value from every "
                "block and accumulate it through the block outputs (for example a running sum passed in and "
                "returned by each block), or leave it out of the pipelined step."
            )


def needed_units(observations: list[StepObservation], num_blocks: int) -> dict[str, set[int]]:
    """Per parameter name, the units whose inputs (``pre`` for block 0's) or results it reaches."""
    needs: dict[str, set[int]] = defaultdict(set)
    for observation in observations:
        for index, sources in zip(observation.block_calls, observation.block_sources):
            unit = 0 if index == 0 else index + 1  # what feeds block 0 is computed in pre
            for source in sources:
                if source[0] == "param":
                    needs[source[1]].add(unit)
        for sources in observation.result_sources.values():
            for source in sources:
                if source[0] == "param":
                    needs[source[1]].add(num_blocks + 1)
    return needs


def layout_from_observation(root: nn.Module, stack: BlockStack, observations: list[StepObservation]) -> UnitLayout:
    """Units by use: a block's own tensors stay with it; every parameter also belongs to each unit it
    was seen to reach. Parameters the observed steps never reach keep their declaration unit."""
    owners = registered_tensors(root, stack)
    needs = needed_units(observations, stack.num_blocks)
    units_of: dict[str, set[int]] = {}
    for entries in owners.values():
        canonical = entries[0][1]
        declared = {u for u, _, _ in entries}
        in_blocks = {u for u in declared if 1 <= u <= stack.num_blocks}
        used = needs.get(canonical, set())
        units_of[canonical] = (in_blocks | used) or declared
    return make_layout(stack, owners, units_of)
