"""``lightning-pipe-profile``: profile the model and data of a LightningCLI config in one process.

Writes the JSON profile that ``ElasticRepartition(cost_model="profile.json")`` reads::

    lightning-pipe-profile --config examples/gpt/configs/cpu_elastic.yaml --output profile.json
    python -m lightning_pipe.profiling --config ... --output profile.json --lengths 64 128 256 --sequences 1 2

A command-line entry point (like ``lightning_pipe/cli.py``): it builds the module and data through
LightningCLI, so it may import Lightning and the package, which the rest of ``profiling/`` does not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from lightning_pipe.profiling.estimate import format_fits, probe_grid, probe_lengths, profile_module, save_profile
from lightning_pipe.profiling.memory_profile import sequence_lengths
from lightning_pipe.runtime.microbatch import split_batch

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-pipe-profile``: profile the model and data of a LightningCLI config in one process."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--config", required=True, help="LightningCLI YAML with `model` and `data`")
    parser.add_argument("--output", default="profile.json", help="JSON profile to write")
    parser.add_argument("--lengths", type=int, nargs="*", default=None, help="probe lengths (default: from the batch)")
    parser.add_argument("--sequences", type=int, nargs="*", default=None, help="probe samples per microbatch")
    parser.add_argument("--microbatches", type=int, default=None, help="split the first batch into this many")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optimizer-states", type=float, default=2.0, help="state tensors per parameter (Adam: 2)")
    args = parser.parse_args(argv)

    import torch
    from lightning.pytorch.cli import LightningCLI

    import lightning_pipe  # noqa: F401  (registers the strategy for the config)

    cli = LightningCLI(
        args=["--config", args.config, "--trainer.devices=1", "--trainer.strategy=auto", "--trainer.logger=false"],
        run=False,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        save_config_callback=None,
    )
    module, data = cli.model, cli.datamodule
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    strategy = cli.config.get("trainer", {}).get("strategy")
    microbatches = args.microbatches or _configured_microbatches(strategy) or 1
    microbatch = split_batch(batch, microbatches)[0]
    lengths = sequence_lengths(microbatch)
    shapes = probe_grid(
        args.lengths or probe_lengths(max(lengths)), args.sequences or [len(lengths), max(1, len(lengths) // 2)]
    )
    torch.manual_seed(0)
    estimate = profile_module(
        module, microbatch, shapes, repeats=args.repeats, optimizer_states_per_parameter=args.optimizer_states
    )
    save_profile(estimate, args.output)
    print(format_fits(estimate))
    print(f"length offset {estimate.length_offset}; profile written to {args.output}")
    return 0


def _configured_microbatches(strategy: Any) -> int | None:
    if isinstance(strategy, dict):
        return strategy.get("init_args", {}).get("num_microbatches") or 2 * (
            strategy.get("init_args", {}).get("pipeline_parallel_size") or 2
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
