"""Checkpoints that are complete and independent of the partition.

Keys are the user module's own parameter names, and optimizer state uses torch's own format: every
rank's optimizer holds all parameters in the module's order (meta ones never get state), so the
per-parameter indices agree with a single-process optimizer's. A checkpoint written by any pipeline
size therefore loads into any other, and into a plain LightningModule on one device.
Everything is gathered on global rank 0, which writes one file (Lightning's own ``save_checkpoint``).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
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
    parts = _gather_parts(strategy, local)
    if parts is None:
        return {}
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return _ordered(merged, order)


def _gather_parts(strategy: ElasticPipelineStrategy, local: Any) -> list | None:
    """Every pipeline rank's ``local`` on global rank 0 (a collective of replica 0); None elsewhere."""
    if strategy.layout.data_parallel_rank != 0:
        return None
    parts = collectives.gather_objects(local, strategy.layout.pipeline_ranks()[0], strategy.groups.pipeline)
    return parts if strategy.global_rank == 0 else None


def _ordered(merged: dict, order: list | None) -> dict:
    keys = order if order is not None else sorted(merged)
    return {k: merged[k] for k in keys if k in merged}


def full_module_state(strategy: ElasticPipelineStrategy) -> dict[str, Any]:
    """The module's whole state dict on global rank 0 (a collective; empty on other ranks)."""
    state = strategy.lightning_module.state_dict()
    local = {k: v.detach().cpu() for k, v in state.items() if v.device.type != "meta"}
    return _gather_on_rank_zero(strategy, local, order=list(state.keys()))


def full_optimizer_state(strategy: ElasticPipelineStrategy, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's whole state dict on global rank 0 (a collective; empty on other ranks).

    With ``optimizer_offload=True`` the state lives in the per-stage host optimizers, not in
    ``optimizer``: their entries are saved under the user optimizer's indices, and host master weights
    wider than their parameters (fp32 masters of 16-bit parameters) under ``"master_weights"`` (a key
    torch's ``Optimizer.load_state_dict`` ignores, so the file still loads into a plain optimizer).
    """
    if isinstance(optimizer, LightningOptimizer):
        optimizer = optimizer.optimizer
    state = optimizer.state_dict()
    local = {index: _to_cpu(value) for index, value in state["state"].items()}
    masters: dict[int, Tensor] = {}
    offloaded = strategy.memory.offloaded_optimizer_state(optimizer)
    if offloaded is not None:
        local.update({index: _to_cpu(value) for index, value in offloaded["state"].items()})
        masters = {index: _to_cpu(value) for index, value in offloaded["master_weights"].items()}
    parts = _gather_parts(strategy, (local, masters))
    if parts is None:
        return {}
    merged_state: dict = {}
    merged_masters: dict = {}
    for part_state, part_masters in parts:
        merged_state.update(part_state)
        merged_masters.update(part_masters)
    full = {"state": _ordered(merged_state, None), "param_groups": state["param_groups"]}
    if merged_masters:
        full["master_weights"] = _ordered(merged_masters, None)
    return full


def _owned_indices(optimizer: Optimizer) -> set[int]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i for i, p in enumerate(params) if p.device.type != "meta"}


def load_owned_optimizer_states(strategy: ElasticPipelineStrategy, states: list[dict[str, Any]]) -> None:
    """Load full optimizer states, keeping only the entries of parameters this rank holds.

    With ``optimizer_offload=True`` the user's optimizer gets the hyperparameters only; the entries
    (and saved master weights) go to the host optimizers (``StrategyMemory.load_offloaded_optimizer_state``).
    """
    for optimizer, state in zip(strategy.optimizers, states, strict=True):
        optimizer = getattr(optimizer, "optimizer", optimizer)
        owned = _owned_indices(optimizer)
        entries = {i: v for i, v in state["state"].items() if i in owned}
        if strategy.memory.optimizer_offload:
            masters = {i: v for i, v in state.get("master_weights", {}).items() if i in owned}
            strategy.memory.load_offloaded_optimizer_state({"state": entries, "master_weights": masters})
            entries = {}
        optimizer.load_state_dict({"state": entries, "param_groups": state["param_groups"]})


def load_module_state(module: nn.Module, state: dict[str, Tensor], strict: bool = True) -> None:
    """Load a full state dict into a sharded module: real tensors are copied, meta ones (units other
    ranks hold) are skipped without torch's per-parameter "copying ... to a meta parameter ... is a
    no-op" warning (nothing a user can act on: 52 lines at pp=2). Missing and unexpected keys are
    checked against the whole module, as ``strict`` says."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta")
        module.load_state_dict(state, strict=strict)

