"""lightning-pipe: pipeline-parallel training of unchanged LightningModules.

``import lightning_pipe`` registers the strategy name ``"elastic_pipe"`` with Lightning, so
``Trainer(strategy="elastic_pipe")`` works (Lightning has no entry point for strategies).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.planning import MemoryPlan, PipelinePlan, StageMemory
from lightning_pipe.strategies import ElasticPipelineStrategy

__version__ = "0.1.0"

if "elastic_pipe" not in StrategyRegistry:
    ElasticPipelineStrategy.register_strategies(StrategyRegistry)

# Public API.
__all__ = ["ElasticPipelineStrategy", "MemoryPlan", "PipelinePlan", "StageMemory", "__version__"]
