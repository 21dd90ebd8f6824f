"""Understanding the user's module: its blocks and units, and running stages of its own steps."""

from lightning_pipe.model.blocks import BlockStack, find_blocks
from lightning_pipe.model.sharding import move_real_tensors, owned_units, shard_module
from lightning_pipe.model.stage_runner import LogCall, StageResult, StageRunner, StageSpan
from lightning_pipe.model.units import UnitLayout, analyze_units, real_parameter_bytes

# Public: what the strategy and tests use to analyze and run a module as pipeline stages.
__all__ = [
    "BlockStack",
    "LogCall",
    "StageResult",
    "StageRunner",
    "StageSpan",
    "UnitLayout",
    "analyze_units",
    "find_blocks",
    "move_real_tensors",
    "owned_units",
    "real_parameter_bytes",
    "shard_module",
]
