"""The strategy's helpers read it through a typed context, and callbacks through a protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_pipe.strategies import ElasticPipelineStrategy, PipelineStrategy
from lightning_pipe.strategies.context import PipelineContext, PipelineState

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_pipe"


def _protocol_members() -> set[str]:
    members = set(PipelineStrategy.__annotations__)
    members |= {
        name
        for name, value in vars(PipelineStrategy).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }
    return members


def _attributes_read(path: Path, receiver: str) -> dict[str, int]:
    """``receiver.<name>`` reads in a file (first line of each)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == receiver:
            found.setdefault(node.attr, node.lineno)
    return found


def test_callbacks_read_only_what_the_protocol_declares():
    members = _protocol_members()
    missing = [
        f"{path.name}:{line} reads strategy.{name}"
        for path in sorted((PACKAGE / "callbacks").glob("*.py"))
        for name, line in _attributes_read(path, "strategy").items()
        if name not in members
    ]
    assert not missing, "declare these in strategies/protocol.py (PipelineStrategy):\n" + "\n".join(missing)


def test_the_strategy_implements_the_protocol():
    strategy = ElasticPipelineStrategy(pipeline_parallel_size=2)
    absent = [name for name in _protocol_members() if not hasattr(ElasticPipelineStrategy, name) and not hasattr(strategy, name)]
    assert not absent, f"ElasticPipelineStrategy lacks {absent} that PipelineStrategy promises"


@pytest.mark.parametrize("name", ["memory.py", "costs.py"])
def test_helpers_hold_no_strategy(name):
    """StrategyMemory and StrategyCosts read the context's fields and the state it returns, never the strategy."""
    path = PACKAGE / "strategies" / name
    assert "_strategy" not in _attributes_read(path, "self"), f"{name} keeps a back-pointer to the strategy"
    assert not _attributes_read(path, "strategy"), f"{name} reads strategy attributes: {_attributes_read(path, 'strategy')}"
    fields = set(PipelineContext.__dataclass_fields__) | {"pipeline_parallel_size"}
    read = _attributes_read(path, "context")
    assert set(read) <= fields, f"{name} reads {sorted(set(read) - fields)} that PipelineContext does not have"
    current = _attributes_read(path, "current")
    assert set(current) <= set(PipelineState.__dataclass_fields__), sorted(set(current) - set(PipelineState.__dataclass_fields__))


def test_context_and_state_are_frozen():
    assert PipelineContext.__dataclass_params__.frozen and PipelineState.__dataclass_params__.frozen
