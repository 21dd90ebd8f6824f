"""Understanding the user's module: its blocks and units, and running stages of its own steps."""

from lightning_pipe.model.attention import PackedAttention, select_attention_backend, varlen_attention
from lightning_pipe.model.blocks import BlockStack, find_blocks
from lightning_pipe.model.observation import check_observation, layout_from_observation
from lightning_pipe.model.placeholders import PlaceholderMode
from lightning_pipe.model.sharding import move_real_tensors, owned_units, shard_module
from lightning_pipe.model.sub_blocks import BlockNotSplittable, SubBlockUnits, split_block_at_attention
from lightning_pipe.model.stage_runner import LogCall, StageResult, StageRunner, StageSpan, StepObservation
from lightning_pipe.model.units import UnitLayout, analyze_units, real_parameter_bytes

# Public: what the strategy and tests use to analyze and run a module as pipeline stages.
__all__ = [
    "BlockNotSplittable",
    "BlockStack",
    "LogCall",
    "PackedAttention",
    "PlaceholderMode",
    "StageResult",
    "StageRunner",
    "StageSpan",
    "StepObservation",
    "SubBlockUnits",
    "UnitLayout",
    "analyze_units",
    "check_observation",
    "find_blocks",
    "layout_from_observation",
    "move_real_tensors",
    "owned_units",
    "real_parameter_bytes",
    "select_attention_backend",
    "shard_module",
    "split_block_at_attention",
    "varlen_attention",
]
