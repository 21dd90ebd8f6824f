"""Every private Lightning name lightning-pipe touches, in one place.

A Lightning upgrade that renames one of these breaks this file and its test
(tests/strategies/test_lightning_compat.py), nothing else.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import importlib

import lightning
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipe.runtime.groups import destroy_default_group

if TYPE_CHECKING:
    import lightning.pytorch as pl


def private_name(module: str, name: str) -> Any:
    """``module.name`` from Lightning, or an ImportError saying that this file needs updating.

    Raises:
        ImportError: when this Lightning version has no such name.
    """
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"Lightning {lightning.__version__} has no private `{module}.{name}` that lightning-pipe relies on: "
            "update lightning_pipe/strategies/_lightning_compat.py."
        ) from error


# (module, name) of every private Lightning name looked up here; tests/strategies/test_lightning_compat.py
# checks each one (the attribute-level names, such as ``fit_loop._skip_backward``, have their own tests)
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.distributed", "_sync_ddp"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
    ("lightning.pytorch.loops.fetchers", "_DataFetcher"),
    ("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher"),
    ("lightning.pytorch.strategies.launchers.launcher", "_Launcher"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput"),
    ("lightning.pytorch.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.pytorch.trainer.connectors.accelerator_connector", "_AcceleratorConnector"),
    ("lightning.pytorch.trainer.connectors.logger_connector.result", "_ResultMetric"),
)
(
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp,
    _optimizers_to_device,
    _DataFetcher,
    _PrefetchDataFetcher,
    _Launcher,
    _MultiProcessingLauncher,
    _WorkerOutput,
    _SubprocessScriptLauncher,
    _AcceleratorConnector,
    _ResultMetric,
) = (private_name(module, name) for module, name in PRIVATE_NAMES)


def sync_ddp(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """Lightning's reduction of a logged value over ``group`` (``_sync_ddp``: ``"mean"``, ``"sum"``,
    a ``ReduceOp``), so ``self.log(..., sync_dist=True)`` reduces as in any Lightning strategy."""
    return _sync_ddp(tensor, group=group, reduce_op=reduce_op)


def optimizers_to_device(optimizers: Any, device: torch.device) -> None:
    """Move the optimizers' state tensors to ``device`` as Lightning's strategies do at teardown."""
    _optimizers_to_device(optimizers, device)

__all__ = [
    "PipelineMultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "fix_unbounded_epoch_description",
    "install_strategy_name_hint",
    "logged_values_in_place",
    "optimizers_to_device",
    "peek_next_training_batch",
    "private_name",
    "set_skip_backward",
    "sync_ddp",
]


@contextlib.contextmanager
def logged_values_in_place() -> Iterator[None]:
    """While active, ``self.log`` does not re-move a logged value's accumulator that is already on the value's device.

    Lightning's ``_ResultCollection.log`` calls ``_ResultMetric.to(value.device)`` on every call, which
    rebuilds the accumulator's whole ``__dict__`` with ``apply_to_collection`` (about half a
    millisecond of CPU a call) even when every tensor in it is already there, and then holds the same
    tensors. The strategy replays each step's ``self.log`` calls on every rank (at the end of the
    first rank's step, on the critical path), so the no-op is skipped: where every tensor of the
    accumulator (and of its dicts and lists: torchmetrics' defaults) is on that device, ``to`` returns
    the accumulator as it is; anything else (a torchmetrics ``Metric`` logged as the value, another
    device, deeper nesting) takes Lightning's own ``to``.
    """
    original = _ResultMetric.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.device) and _all_on(self.__dict__, args[0]):
            return self
        return original(self, *args, **kwargs)

    _ResultMetric.to = to
    try:
        yield
    finally:
        _ResultMetric.to = original


def _all_on(state: dict, device: torch.device) -> bool:
    for value in state.values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                if item.device != device:
                    return False
            elif isinstance(item, (torch.nn.Module, dict, list, tuple)):  # a Metric, or nesting `to` would walk
                return False
    return True


def install_strategy_name_hint(name: str) -> None:
    """Add "did you mean" to Lightning's "invalid strategy name" error for near-misses of ``name``.

    ``Trainer(strategy="elastic-pipe")`` (or ``"elasticpipe"``, ``"elastic_pipeline"``) otherwise ends in
    Lightning's generic message listing ``auto, ddp, ddp_spawn, deepspeed, ...``. Registering the
    misspellings as aliases would put them in Lightning's list of strategies; instead, Lightning's
    configuration check (``_AcceleratorConnector._check_config_and_set_final_flags``, which raises the
    error after recording the lowercased flag as ``_strategy_flag``) is wrapped to append the hint. Only
    that error changes, and only while this package is imported (nothing can help before: Lightning has
    no entry point for strategies).
    """
    original = _AcceleratorConnector._check_config_and_set_final_flags
    if getattr(original, "_lightning_pipe_hint", None) == name:
        return

    @functools.wraps(original)
    def check(self: _AcceleratorConnector, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except ValueError as error:
            flag = getattr(self, "_strategy_flag", None)
            if "invalid strategy name" not in str(error) or not isinstance(flag, str):
                raise
            normalized = flag.replace("-", "_").replace(" ", "_")
            close = difflib.get_close_matches(normalized, [name, name + "line"], n=1, cutoff=0.75)
            if normalized != name and not close:
                raise
            raise ValueError(
                f"{error} Did you mean `strategy={name!r}` (lightning-pipe's pipeline strategy; Lightning's strategy "
                "names are lowercase with underscores)?"
            ) from None

    check._lightning_pipe_hint = name  # type: ignore[attr-defined]
    _AcceleratorConnector._check_config_and_set_final_flags = check  # type: ignore[method-assign]


def set_skip_backward(trainer: pl.Trainer, skip: bool) -> None:
    """Turn Lightning's own backward and zero_grad in automatic optimization off (or back on).

    The pipeline runs backward inside the step, microbatch by microbatch; Lightning would zero the
    gradients after the step and call backward again (the StochasticWeightAveraging callback uses
    the same switch).
    """
    trainer.fit_loop._skip_backward = skip


def fix_unbounded_epoch_description(trainer: pl.Trainer) -> None:
    """Make Lightning's rich progress bar show ``Epoch 3`` rather than ``Epoch 3/-2`` without an epoch limit.

    With only ``max_steps`` set, ``trainer.max_epochs`` is -1 and ``RichProgressBar`` (Lightning's
    default bar whenever ``rich`` is installed, which lightning-pipe requires) appends
    ``/{max_epochs - 1}``. Lightning fixed this after 2.6 (pull request 21924: no total when epochs
    are unlimited); this applies the same rule to the trainer's bar instance on older versions.
    """
    from lightning.pytorch.callbacks import RichProgressBar

    bar = trainer.progress_bar_callback
    if not isinstance(bar, RichProgressBar) or "_get_train_description" in vars(bar):
        return
    original = bar._get_train_description

    def describe(current_epoch: int) -> str:
        text = original(current_epoch)
        if bar.trainer.max_epochs is not None and bar.trainer.max_epochs < 0:
            text = text.replace(f"Epoch {current_epoch}/{bar.trainer.max_epochs - 1}", f"Epoch {current_epoch}")
        return text

    bar._get_train_description = describe


def peek_next_training_batch(trainer: pl.Trainer) -> tuple[bool, Any]:
    """The batch the fit loop hands out after the current one, without consuming it.

    Returns ``(True, batch)`` (the batch as the dataloader yields it, before it is moved to the
    device), or ``(False, None)`` at the end of an epoch or when the loop gives no lookahead (a
    ``training_step`` taking ``dataloader_iter``).

    Lightning's ``_PrefetchDataFetcher`` keeps one batch ahead only for loaders of unknown length;
    for sized loaders this fetches the next batch early and leaves it in the fetcher's queue, where
    the loop takes it next, with the fetcher's counters as they were (so ``is_last_batch`` is
    unchanged). The next batch is loaded before the current step runs instead of after it: a
    dataset drawing from the main process's global RNG (``num_workers=0``) draws in another order
    relative to the model's own random ops.
    """
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if not isinstance(fetcher, _PrefetchDataFetcher):
        return False, None
    if not fetcher.batches:
        if fetcher.done:
            return False, None
        fetched, done = fetcher.fetched, fetcher.done
        try:
            item = _DataFetcher.__next__(fetcher)
        except StopIteration:
            return False, None
        fetcher.batches.append(item)
        fetcher.fetched, fetcher.done = fetched, done
    batch, _, _ = fetcher.batches[0]
    return True, batch


class PipelineMultiProcessingLauncher(_Launcher):
    """Spawn/fork launcher of the pipeline strategy: Lightning's, with three differences.

    * Configuration errors that need only the module (no block stack, a partition that does not
      fit, manual optimization) are raised in the main process before any process starts.
    * After ``fit``, the *whole* model comes back to the main process (Lightning's launcher sends
      rank 0's ``state_dict()``, which holds only rank 0's stage).
    * ``trainer.predict`` returns predictions (rank 0 holds those of every batch it saw: the whole
      dataset without data parallelism). Lightning refuses that for any ``_MultiProcessingLauncher``
      because a DDP rank holds only its shard, so this class wraps one instead of being one.
    """

    def __init__(self, strategy: Any, start_method: str) -> None:
        self._strategy = strategy
        self._launcher = _GatheringLauncher(strategy, start_method=start_method)

    @property
    def is_interactive_compatible(self) -> bool:
        return self._launcher.is_interactive_compatible

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.lightning_module is not None:
            self._strategy.validate_module(trainer.lightning_module, fitting=trainer.state.fn == TrainerFn.FITTING)
        results = self._launcher.launch(function, *args, trainer=trainer, **kwargs)
        return results.load() if isinstance(results, _ResultBytes) else results

    def kill(self, signum: Any) -> None:
        self._launcher.kill(signum)


class _GatheringLauncher(_MultiProcessingLauncher):
    """Lightning's multiprocessing launcher, sending back the state dict gathered from every stage."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # A worker that exits with its process group alive can abort (SIGABRT) in interpreter
        # finalization while gloo's threads release tensors (pytorch/pytorch#190489). The worker's
        # process group is its own to end: the main process never joins it. (After an error the
        # worker exits anyway and torch's process context stops the others.)
        destroy_default_group()

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if worker_output.weights_path is not None and any(t.is_meta for t in module.state_dict().values()):
            # A module built on meta (`init_module(empty_init=True)`) has no storage to copy the trained
            # weights into: it takes the loaded tensors themselves.
            state = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            module.load_state_dict(state, strict=False, assign=True)
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        fitting = trainer.state.fn == TrainerFn.FITTING
        state_dict = self._strategy.gather_module_state_dict() if fitting else {}  # a collective when fitting
        if self._strategy.global_rank != 0:
            return None
        weights_path = None
        if fitting:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, _ResultBytes(results), extra)


class _ResultBytes:
    """A worker's results as bytes: tensors put on the return queue as they are would be shared
    through file descriptors that vanish when the worker exits (predictions, for instance)."""

    def __init__(self, results: Any) -> None:
        buffer = io.BytesIO()
        torch.save(results, buffer)
        self.data = buffer.getvalue()

    def load(self) -> Any:
        return torch.load(io.BytesIO(self.data), weights_only=False)
