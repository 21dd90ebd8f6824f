"""Lightning glue: the pipeline strategy."""

from lightning_pipe.strategies.elastic_pipeline import ElasticPipelineStrategy

__all__ = ["ElasticPipelineStrategy"]
