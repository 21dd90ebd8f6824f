"""Lightning glue: the pipeline strategy, and the protocol callbacks type it by."""

from lightning_pipe.strategies.elastic_pipeline import ElasticPipelineStrategy
from lightning_pipe.strategies.protocol import PipelineStrategy

__all__ = ["ElasticPipelineStrategy", "PipelineStrategy"]
