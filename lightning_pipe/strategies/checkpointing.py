"""Checkpoints that are complete and independent of the partition.

Keys are the user module's own parameter names, and optimizer state uses torch's own format: every
rank's optimizer holds all parameters in the module's order (meta ones never get state), so the
per-parameter indices agree with a single-process optimizer's. A checkpoint written by any pipeline
size therefore loads into any other, and into a plain LightningModule on one device.
Everything is gathered on global rank 0, which writes one file (Lightning's own ``save_checkpoint``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from torch.optim import Optimizer

from lightning_pipe.runtime import collectives

if TYPE_CHECKING:
    from lightning_pipe.strategies.elastic_pipeline import ElasticPipelineStrategy


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _gather_on_rank_zero(strategy: ElasticPipelineStrategy, local: dict, order: list | None) -> dict:
    """Merge every stage's entries on global rank 0 (data-parallel replicas are identical: replica 0 only)."""
    if strategy.layout.data_parallel_rank != 0:
        return {}
    parts = collectives.gather_objects(local, strategy.layout.pipeline_ranks()[0], strategy.groups.pipeline)
    if strategy.global_rank != 0 or parts is None:
        return {}
    merged: dict = {}
    for part in parts:
        merged.update(part)
    keys = order if order is not None else sorted(merged)
    return {k: merged[k] for k in keys if k in merged}


def full_module_state(strategy: ElasticPipelineStrategy) -> dict[str, Any]:
    """The module's whole state dict on global rank 0 (a collective; empty on other ranks)."""
    state = strategy.lightning_module.state_dict()
    local = {k: v.detach().cpu() for k, v in state.items() if v.device.type != "meta"}
    return _gather_on_rank_zero(strategy, local, order=list(state.keys()))


def full_optimizer_state(strategy: ElasticPipelineStrategy, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's whole state dict on global rank 0 (a collective; empty on other ranks)."""
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    state = optimizer.state_dict()
    local = {index: _to_cpu(value) for index, value in state["state"].items()}
    merged = _gather_on_rank_zero(strategy, local, order=None)
    return {"state": merged, "param_groups": state["param_groups"]} if strategy.global_rank == 0 else {}


def load_owned_optimizer_states(optimizers: list[Optimizer], states: list[dict[str, Any]]) -> None:
    """Load full optimizer states, keeping only the entries of parameters this rank holds."""
    for optimizer, state in zip(optimizers, states, strict=True):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        owned = {i for i, p in enumerate(params) if p.device.type != "meta"}
        optimizer.load_state_dict(
            {"state": {i: v for i, v in state["state"].items() if i in owned}, "param_groups": state["param_groups"]}
        )
