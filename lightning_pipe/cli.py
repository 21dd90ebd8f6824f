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


def main(args: Any = None) -> LightningCLI:
    """Run the CLI (``args``: argument list or dict; None reads ``sys.argv``).

    The working directory goes on the import path, as with ``python -m``, so that ``class_path``
    entries name the project's own modules (``examples.gpt.model.GPT``) from the installed command too.
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


if __name__ == "__main__":
    main()
