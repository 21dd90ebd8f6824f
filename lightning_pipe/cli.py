"""``lightning-pipe``: LightningCLI with the pipeline strategy registered.

    lightning-pipe fit --config examples/gpt/configs/cpu_2stage.yaml
    python -m lightning_pipe fit --config examples/gpt/configs/cpu_2stage.yaml

The model and data module are chosen in the config by ``class_path`` (any LightningModule and
LightningDataModule); ``trainer.strategy`` is ``elastic_pipe`` or
``{class_path: lightning_pipe.ElasticPipelineStrategy, init_args: {...}}``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_pipe  # noqa: F401  (registers "elastic_pipe")


def build_cli(args: Any = None) -> LightningCLI:
    """Parse ``args`` (argument list or dict; None reads ``sys.argv``) and run the subcommand.

    The working directory goes on the import path, as with ``python -m``, so that ``class_path``
    entries name the project's own modules (``examples.gpt.model.GPT``) from the installed command too.

    Returns:
        The ``LightningCLI`` (its ``trainer``, ``model``, ``datamodule``), for use from Python.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return LightningCLI(
        args=args,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def main(args: Any = None) -> int:
    """The ``lightning-pipe`` command: run the CLI and return the exit status (0 on success).

    The console script passes the return value to ``sys.exit``, so it must be a status, not the
    CLI object (``sys.exit(object)`` prints the object and exits with 1). Failures raise.
    """
    build_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
