"""``lightning-pipe``: LightningCLI with the pipeline strategy registered.

    lightning-pipe fit --config examples/gpt/configs/cpu_2stage.yaml
    python -m lightning_pipe fit --config examples/gpt/configs/cpu_2stage.yaml

The model and data module are chosen in the config by ``class_path`` (any LightningModule and
LightningDataModule); ``trainer.strategy`` is ``elastic_pipe`` or
``{class_path: lightning_pipe.ElasticPipelineStrategy, init_args: {...}}``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_pipe  # noqa: F401  (registers "elastic_pipe")


def main(args: Any = None) -> LightningCLI:
    """Run the CLI (``args``: argument list or dict; None reads ``sys.argv``)."""
    return LightningCLI(
        args=args,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
