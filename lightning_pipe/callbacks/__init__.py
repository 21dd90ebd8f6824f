"""Lightning callbacks that decide plans and watch the pipeline."""

from lightning_pipe.callbacks.auto_planner import AutoPlanner
from lightning_pipe.callbacks.elastic_depth import ElasticDepth
from lightning_pipe.callbacks.elastic_repartition import ElasticRepartition
from lightning_pipe.callbacks.memory_planner import MemoryPlanner
from lightning_pipe.callbacks.monitor import PipelineMonitor
from lightning_pipe.callbacks.profiler import PipelineProfiler
from lightning_pipe.callbacks.progress import PipelineProgressBar
from lightning_pipe.callbacks.schedule_switch import ScheduleSwitch
from lightning_pipe.callbacks.sequence_grouping import SequenceGrouper

# Public: callbacks users add to the Trainer.
__all__ = [
    "AutoPlanner",
    "ElasticDepth",
    "ElasticRepartition",
    "MemoryPlanner",
    "PipelineMonitor",
    "PipelineProfiler",
    "PipelineProgressBar",
    "ScheduleSwitch",
    "SequenceGrouper",
]
