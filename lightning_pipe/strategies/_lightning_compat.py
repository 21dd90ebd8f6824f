"""Every private Lightning name lightning-pipe touches, in one place.

A Lightning upgrade that renames one of these breaks this file and its test
(tests/strategies/test_lightning_compat.py), nothing else.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "PipelineMultiProcessingLauncher",
    "_SubprocessScriptLauncher",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "set_skip_backward",
]


def set_skip_backward(trainer: pl.Trainer, skip: bool) -> None:
    """Turn Lightning's own backward and zero_grad in automatic optimization off (or back on).

    The pipeline runs backward inside the step, microbatch by microbatch; Lightning would zero the
    gradients after the step and call backward again (the StochasticWeightAveraging callback uses
    the same switch).
    """
    trainer.fit_loop._skip_backward = skip


class PipelineMultiProcessingLauncher(_MultiProcessingLauncher):
    """Spawn launcher that sends the *whole* model back to the main process.

    Lightning's launcher sends rank 0's ``state_dict()``, which holds only rank 0's stage; this one
    sends the state dict the strategy gathered from every stage.
    """

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        state_dict = self._strategy.lightning_module_state_dict()  # a collective: every rank takes part
        if self._strategy.global_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)
