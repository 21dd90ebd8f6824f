"""``PipelineProfiler``: measure what every unit really costs and fit the planners' cost model.

As a callback, before the first training batch every pipeline rank times the forward and backward
of the units it owns on a grid of microbatch shapes cut from that batch (no communication: a stage
that is not first gets zero inputs of the right shapes), global rank 0 fits per-unit linear costs
(``planning.fit``: non-negative least squares on relative residuals, error on held-out shapes),
every rank receives the fit, and the strategy's planners (``ElasticRepartition``,
``ScheduleSwitch("auto")``) use it. Saved bytes, parameter and link numbers come from the
meta-device estimate. Probing restores RNG state and buffers and changes no gradient: training is
the same as without it.

As a command, it profiles a whole model in one process from a LightningCLI config and writes the
JSON profile that ``ElasticRepartition(cost_model="profile.json")`` reads::

    python -m lightning_pipe.callbacks.profiler --config examples/gpt/configs/cpu_elastic.yaml --output profile.json
    lightning-pipe-profile --config ... --output profile.json --lengths 64 128 256 --sequences 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L

log = logging.getLogger(__name__)


class PipelineProfiler(L.Callback):
    """Profile every unit before the first training batch and hand the fit to the strategy.

    Args:
        output: path of the JSON profile written by global rank 0 (None: not written).
        lengths: probe lengths (positions of the batch's token tensor); None: the first batch's
            length and 3/4, 1/2, 1/4 of it.
        num_sequences: probe samples per microbatch; None: the first microbatch's and half of it.
        repeats: timed runs per shape (the median is kept; more repeats on a busy machine).
        warmup: untimed runs per shape first.
        holdout_fraction: share of each unit's shapes held out to report the fit error.
        use: make the fit the strategy's cost model (for the planner callbacks after this one).

    Attributes:
        estimate: the fitted ``CostEstimate`` (after the first batch).
    """

    def __init__(
        self,
        output: str | Path | None = None,
        lengths: Sequence[int] | None = None,
        num_sequences: Sequence[int] | None = None,
        repeats: int = 3,
        warmup: int = 1,
        holdout_fraction: float = 0.25,
        use: bool = True,
    ) -> None:
        if repeats < 1 or warmup < 0:
            raise ValueError(f"`PipelineProfiler` needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}.")
        self.output = output
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.num_sequences = None if num_sequences is None else [int(b) for b in num_sequences]
        self.repeats = repeats
        self.warmup = warmup
        self.holdout_fraction = holdout_fraction
        self.use = use
        self.estimate: Any = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Check that the Trainer runs the pipeline strategy."""
        if getattr(trainer.strategy, "costs", None) is None:
            raise TypeError(
                f"`PipelineProfiler` needs `strategy='elastic_pipe'` (ElasticPipelineStrategy), the Trainer runs "
                f"`{type(trainer.strategy).__name__}`. To profile without training: `python -m lightning_pipe.callbacks.profiler`."
            )

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Profile once, on the first training batch (every rank, together)."""
        if self.estimate is not None:
            return
        strategy = trainer.strategy
        costs = strategy.costs
        lengths = costs.microbatch_lengths(batch)
        longest, size = max(n for mb in lengths for n in mb), max(len(mb) for mb in lengths)
        everyone = costs.replica_values((longest, size))  # the same grid on every replica
        longest, size = everyone[0]
        shapes = _grid(self.lengths or _fractions(longest), self.num_sequences or [size, max(1, size // 2)])
        self.estimate = costs.profile(batch, batch_idx, shapes, self.repeats, self.warmup, self.holdout_fraction)
        for line in format_fits(self.estimate).splitlines():
            log.info(line)
        if self.output is not None and trainer.global_rank == 0:
            save_profile(self.estimate, self.output)
        if self.use:
            costs.use(self.estimate)


def _fractions(length: int) -> list[int]:
    return list(dict.fromkeys(max(2, round(length * f)) for f in (1.0, 0.75, 0.5, 0.25)))


def _grid(lengths: Sequence[int], sizes: Sequence[int]) -> list[tuple[int, int]]:
    return [(b, n) for n in dict.fromkeys(lengths) for b in dict.fromkeys(sizes)]


def save_profile(estimate: Any, path: str | Path) -> None:
    """Write a ``CostEstimate`` as JSON (a ``CostModel`` profile plus ``length_offset`` and fit errors)."""
    data = estimate.to_dict()
    data["fit_errors"] = {
        fit.unit.name: {"forward": fit.forward.relative_error, "backward": fit.backward.relative_error}
        for fit in estimate.fits
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def format_fits(estimate: Any) -> str:
    """One line per unit: fitted forward/backward coefficients and held-out relative errors."""
    lines = [f"{'unit':<10} {'fwd s/token':>12} {'fwd s/len^2':>12} {'bwd s/token':>12} {'fwd err':>8} {'bwd err':>8}"]
    for fit in estimate.fits:
        unit = fit.unit
        lines.append(
            f"{unit.name:<10} {unit.forward.per_token:>12.3e} {unit.forward.per_squared_length:>12.3e} "
            f"{unit.backward.per_token:>12.3e} {fit.forward.relative_error:>8.1%} {fit.backward.relative_error:>8.1%}"
        )
    return "\n".join(lines)


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
    from lightning_pipe.runtime.microbatch import split_batch
    from lightning_pipe.strategies.costs import profile_module

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
    from lightning_pipe.runtime.memory_profile import sequence_lengths

    lengths = sequence_lengths(microbatch)
    shapes = _grid(
        args.lengths or _fractions(max(lengths)), args.sequences or [len(lengths), max(1, len(lengths) // 2)]
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
