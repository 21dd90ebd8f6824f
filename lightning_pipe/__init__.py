"""lightning-pipe: pipeline-parallel training of unchanged LightningModules.

``import lightning_pipe`` registers the strategy name ``"elastic_pipe"`` with Lightning, so
``Trainer(strategy="elastic_pipe")`` works (Lightning has no entry point for strategies: without the
import, Lightning answers "You selected an invalid strategy name"). Near-misses such as
``"elastic-pipe"`` get a "did you mean" added to Lightning's error while the package is imported.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.planning import MemoryPlan, PipelinePlan, PlanProposal, StageMemory
from lightning_pipe.runtime.packing import Packer
from lightning_pipe.strategies import ElasticPipelineStrategy
from lightning_pipe.strategies._lightning_compat import install_strategy_name_hint
from lightning_pipe.strategies.auto_plan import register_auto_planner
from lightning_pipe.callbacks import AutoPlanner, ElasticRepartition, MemoryPlanner, ScheduleSwitch  # noqa: I001 (after the strategy)

__version__ = "0.1.0"

if "elastic_pipe" not in StrategyRegistry:
    ElasticPipelineStrategy.register_strategies(StrategyRegistry)
install_strategy_name_hint("elastic_pipe")  # "elastic-pipe" and the like: Lightning's error gets a hint
register_auto_planner(AutoPlanner, conflicts=(ElasticRepartition, MemoryPlanner, ScheduleSwitch))  # plan="auto"

# Public API.
__all__ = [
    "ElasticPipelineStrategy", "MemoryPlan", "Packer", "PipelinePlan", "PlanProposal", "StageMemory", "__version__",
]
