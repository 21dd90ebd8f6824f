"""Sharded checkpoints: every rank writes what it owns, loading reshards (``save_distributed_checkpoint``).

The layout follows Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy``: a directory with
``torch.distributed.checkpoint`` shards and ``meta.pt`` holding the rest of Lightning's checkpoint
(loops, callbacks, schedulers, precision plugin, hyperparameters) plus ``"pipeline"`` (the plan, the
layout that wrote it, the module's key order). The shards hold

* ``state_dict.<name>``: the module's own state-dict entries (aliases of tied parameters included, so
  the directory alone is a complete state dict), each written once by one of the ranks holding it;
* ``optimizer_<i>.state.<parameter name>.<key>``: torch's per-parameter optimizer state keyed by the
  parameter's name instead of its index (what ``torch.distributed.checkpoint.state_dict`` calls the
  FQN form); ``optimizer_<i>.param_groups`` with the names of each group's parameters; and
  ``optimizer_<i>.master_weights.<name>`` for host masters wider than their parameters (optimizer
  offload with 16-bit parameters).

Names instead of indices make the optimizer state independent of which rank holds which parameter:
a run of any other layout asks DCP for the names it owns and converts them back to its optimizer's
indices, which agree with a single-process optimizer's (see ``checkpointing.py``). The other
engineer-facing format, one consolidated file gathered on rank 0, stays in ``checkpointing.py``.

A save writes into ``.<name>.partial`` next to the target and renames it into place when complete:
a save interrupted midway leaves the previous checkpoint as it was.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.runtime import sharded_checkpoint as shards
from lightning_pipe.runtime import collectives

if TYPE_CHECKING:
    from lightning_pipe.strategies.elastic_pipeline import ElasticPipelineStrategy

log = logging.getLogger(__name__)

MODULE_KEY = "state_dict"


def optimizer_key(index: int) -> str:
    """The top-level key of the ``index``-th optimizer in the shards (Lightning's convention)."""
    return f"optimizer_{index}"


def _unwrap(optimizer: Any) -> Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def parameter_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The module's name of each of ``optimizer``'s parameters, in the optimizer's index order.

    Raises:
        ValueError: a parameter the optimizer steps is not a parameter of the module.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    result = []
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"`{type(optimizer).__name__}` (param group {group_index}) steps a tensor of shape "
                    f"{tuple(p.shape)} that is not a parameter of `{type(module).__name__}`: a sharded checkpoint "
                    "names optimizer state by the module's parameter names. Build the optimizer from "
                    "`self.parameters()` in `configure_optimizers`, or use `save_distributed_checkpoint=False`."
                )
            result.append(names[id(p)])
    return result


def local_module_state(module: nn.Module) -> dict[str, Any]:
    """This rank's entries of the module's state dict (units on the meta device are other ranks')."""
    return {
        name: value.detach() if isinstance(value, Tensor) else value
        for name, value in module.state_dict().items()
        if not (isinstance(value, Tensor) and value.is_meta)
    }


def local_optimizer_state(strategy: ElasticPipelineStrategy, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter name (the host optimizers' with optimizer offload).

    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}``, plus
    ``"master_weights": {name: tensor}`` for host masters wider than their parameters.
    """
    optimizer = _unwrap(optimizer)
    names = parameter_names(strategy.lightning_module, optimizer)
    state = optimizer.state_dict()
    entries = dict(state["state"])
    masters: dict[int, Tensor] = {}
    offloaded = strategy.memory.offloaded_optimizer_state(optimizer)
    if offloaded is not None:
        entries.update(offloaded["state"])
        masters = dict(offloaded["master_weights"])
    result: dict[str, Any] = {
        "state": {names[i]: dict(value) for i, value in entries.items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }
    if masters:
        result["master_weights"] = {names[i]: master for i, master in masters.items()}
    return result


def checkpoint_record(strategy: ElasticPipelineStrategy, sharded: bool) -> dict[str, Any]:
    """What ``meta.pt`` (or the single file) records of the pipeline that wrote the checkpoint."""
    plan = strategy.plan
    module = strategy.lightning_module
    return {
        "format": "sharded" if sharded else "consolidated",
        "plan": plan.describe(),
        "pipeline_parallel_size": strategy.pipeline_parallel_size,
        "data_parallel_size": strategy.layout.data_parallel_size,
        "state_dict_keys": list(module.state_dict().keys()),
    }


@dataclass
class _PendingSave:
    path: Path
    partial: Path
    thread: threading.Thread | None = None
    error: BaseException | None = None
    removals: list[Path] = field(default_factory=list)


class ShardedCheckpoints:
    """Writes and reads the strategy's sharded checkpoint directories (one per strategy).

    Args:
        asynchronous: write shards on a background thread (the state is first copied to host memory,
            so training continues at once); at most one save is in flight, the next save and the end
            of training wait for it. A checkpoint is in place (renamed from ``.<name>.partial``) only
            when every rank has written its shard.
    """

    def __init__(self, asynchronous: bool = False) -> None:
        self.asynchronous = asynchronous
        self.group: Any = None  # set by the strategy after the process group exists
        self.global_rank = 0
        self._pending: _PendingSave | None = None

    # --- saving -----------------------------------------------------------------------------------

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write Lightning's ``checkpoint`` (with this rank's ``state_dict`` and optimizer states) to ``path``.

        A collective of every process. Global rank 0 writes ``meta.pt`` and renames the directory into
        place once all shards are written.
        """
        self.wait()
        partial = shards.partial_path(path)
        if self.global_rank == 0:
            shards.remove_path(partial)
            partial.mkdir(parents=True)
        self._barrier()
        state = {MODULE_KEY: checkpoint.pop(MODULE_KEY)}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[optimizer_key(index)] = optimizer_state
        pending = _PendingSave(path, partial)
        meta = io.BytesIO()  # serialized now: what the callbacks and loops said at this step
        torch.save(checkpoint, meta)
        if not self.asynchronous:
            shards.save_shards(state, partial, self.group)
            self._publish(pending, meta.getvalue())
            return
        future = shards.start_async_save(state, partial, self.group)
        del state  # the shards were copied to host memory: training may change the tensors now

        def complete() -> None:
            try:
                future.result()
                self._publish(pending, meta.getvalue())
            except BaseException as error:  # noqa: BLE001 (raised in the main thread by `wait`)
                pending.error = error

        pending.thread = threading.Thread(target=complete, name=f"checkpoint {path.name}", daemon=True)
        self._pending = pending
        pending.thread.start()

    def _publish(self, pending: _PendingSave, meta: bytes) -> None:
        if self.global_rank != 0:
            return
        with open(pending.partial / shards.META_FILENAME, "wb") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        shards.publish(pending.partial, pending.path)
        for path in pending.removals:
            shards.remove_path(path)
        log.debug("sharded checkpoint written to %s", pending.path)

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is in place; raise its error."""
        pending, self._pending = self._pending, None
        if pending is None or pending.thread is None:
            return
        pending.thread.join()
        if pending.error is not None:
            raise RuntimeError(
                f"Rank {self.global_rank}: the asynchronous save of checkpoint {str(pending.path)!r} failed "
                f"({type(pending.error).__name__}: {pending.error}); the previous checkpoint is unchanged."
            ) from pending.error

    def remove(self, path: Path) -> None:
        """Remove a checkpoint on global rank 0, after the save in flight is in place (if any): until a
        new checkpoint is complete, the one it replaces stays."""
        if self._pending is not None:
            self._pending.removals.append(path)
        elif self.global_rank == 0:
            shards.remove_path(path)

    def _barrier(self) -> None:
        if self.group is not None:
            collectives.barrier(self.group)

    # --- loading ----------------------------------------------------------------------------------

    def load(self, strategy: ElasticPipelineStrategy, path: Path) -> dict[str, Any]:
        """Read a sharded checkpoint into the layout of ``strategy`` (a collective of every process).

        The module's owned tensors are read in place. Returns Lightning's checkpoint dict: ``meta.pt``'s
        entries, ``"state_dict"`` (every key of the module: tensors this rank owns, already loaded, and
        the meta placeholders of the rest, so the strategy's usual loading checks missing and unexpected
        keys), and, when fitting, ``"optimizer_states"`` in torch's index format with this rank's
        entries only.
        """
        self.wait()
        metadata = shards.read_metadata(path)
        paths = shards.flat_paths(metadata)
        checkpoint = torch.load(path / shards.META_FILENAME, map_location="cpu", weights_only=False)
        module = strategy.lightning_module
        current = module.state_dict(keep_vars=True)
        saved_module = {p[1]: key for key, p in paths.items() if p[0] == MODULE_KEY and len(p) == 2}
        targets = {
            (MODULE_KEY, name): value.detach()
            for name, value in current.items()
            if name in saved_module and isinstance(value, Tensor) and not value.is_meta
        }
        optimizers = [_unwrap(o) for o in strategy.optimizers]
        names = [parameter_names(module, o) for o in optimizers]
        owned = [
            {n for n, p in zip(n_list, (p for g in o.param_groups for p in g["params"])) if not p.is_meta}
            for n_list, o in zip(names, optimizers)
        ]
        top = {optimizer_key(i): i for i in range(len(optimizers))}

        def wanted(p: tuple) -> bool:
            if p[0] == MODULE_KEY:
                value = current.get(p[1]) if len(p) == 2 else None
                return not (isinstance(value, Tensor) and value.is_meta) and p[1] in current
            if p[0] in top:
                return p[1] == "param_groups" or (len(p) > 2 and p[2] in owned[top[p[0]]])
            return False

        loaded = shards.nest(shards.load_keys(path, metadata, wanted, self.group, targets))
        checkpoint[MODULE_KEY] = _module_entries(current, loaded.get(MODULE_KEY, {}), saved_module, metadata)
        if optimizers and optimizer_key(0) in {p[0] for p in paths.values()}:
            checkpoint["optimizer_states"] = [
                _indexed_optimizer_state(loaded[optimizer_key(i)], names[i], type(o).__name__)
                for i, o in enumerate(optimizers)
            ]
        return checkpoint


def _module_entries(
    current: dict[str, Any], loaded: dict[str, Any], saved: dict[str, str], metadata: Any
) -> dict[str, Any]:
    """Every key the module has and the checkpoint holds: loaded values, meta placeholders for other
    ranks' units, and meta tensors of the stored shape for keys the module lacks (so a strict load
    reports them as unexpected, as torch does)."""
    entries: dict[str, Any] = {}
    for name, value in current.items():
        if name in loaded:
            entries[name] = loaded[name]
        elif name in saved:
            entries[name] = value.detach() if isinstance(value, Tensor) else value
    for name, key in saved.items():
        if name not in current:
            stored = metadata.state_dict_metadata[key]
            size = getattr(stored, "size", ())
            entries[name] = torch.empty(size, device="meta")
    return entries


def _indexed_optimizer_state(saved: dict[str, Any], names: list[str], optimizer_name: str) -> dict[str, Any]:
    """The loaded name-keyed optimizer state in torch's index format for the current optimizer."""
    groups = saved["param_groups"]
    saved_names = [n for group in groups for n in group["params"]]
    if saved_names != names:
        missing = sorted(set(names) - set(saved_names))
        unexpected = sorted(set(saved_names) - set(names))
        raise ValueError(
            f"The checkpoint's `{optimizer_name}` steps other parameters than the current one "
            f"(missing from the checkpoint: {missing[:5]}, not in the module: {unexpected[:5]}"
            f"{', or in another order or grouping' if not (missing or unexpected) else ''}). Build the optimizer "
            "as the run that wrote the checkpoint did."
        )
    index = {name: i for i, name in enumerate(names)}
    result: dict[str, Any] = {
        "state": {index[n]: value for n, value in saved.get("state", {}).items()},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in groups],
    }
    if saved.get("master_weights"):
        result["master_weights"] = {index[n]: value for n, value in saved["master_weights"].items()}
    return result
