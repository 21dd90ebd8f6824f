"""``lightning-pipe-profile``: profile the model and data of a LightningCLI config in one process.

Writes the JSON profile that ``ElasticRepartition(cost_model="profile.json")`` reads::

    lightning-pipe-profile --config examples/gpt/configs/cpu_elastic.yaml --output profile.json
    python -m lightning_pipe.profiling --config ... --output profile.json --lengths 64 128 256 --sequences 1 2
    lightning-pipe-profile --config ... --plan-ranks 4 --families 1f1b zb_h1 helix spipe

``--plan-ranks P`` also prices every family of ``--families`` for the first batch on ``P`` pipeline ranks
with the joint planner (best partition, microbatch count and memory plan of each) and prints them
fastest first: which schedule to start a run with. The split-placement families (``helix``, ``spipe``)
are compared here, before the run, because a run cannot switch into or out of them.

A command-line entry point (like ``lightning_pipe/cli.py``): it builds the module and data through
LightningCLI, so it may import Lightning and the package, which the rest of ``profiling/`` does not.
"""

from __future__ import annotations

import argparse
import io
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
    parser.add_argument("--plan-ranks", type=int, default=None, help="also rank the families for this many pipeline ranks")
    parser.add_argument("--families", nargs="*", default=["1f1b", "zb_h1", "interleaved_1f1b", "helix", "spipe"],
                        help="families --plan-ranks compares")
    parser.add_argument("--budget", default=None, help="bytes per device the plans must fit (\"60GiB\"); default none")
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
    if args.plan_ranks:
        batch_lengths = [max(1, n - estimate.length_offset) for n in sequence_lengths(batch)]
        print(format_family_ranking(estimate.cost_model, batch_lengths, args.plan_ranks, args.families, args.budget))
    return 0


def format_family_ranking(
    cost_model: Any, lengths: Sequence[int], num_ranks: int, families: Sequence[str], budget: str | None = None
) -> str:
    """A table of the best plan of each family for a batch of ``lengths`` (the joint planner, one family at
    a time so that every family is priced, not pruned by another's bound), fastest first."""
    from rich.console import Console
    from rich.table import Table

    from lightning_pipe.planning.joint import JointConfig, plan_joint
    from lightning_pipe.planning.memory_model import parse_size
    from lightning_pipe.planning.memory_planner import MemoryBudgetError

    limit = None if budget is None else parse_size(budget)
    rows = []
    for family in families:
        try:
            joint = plan_joint(cost_model, lengths, num_ranks, limit, config=JointConfig(families=(family,)))
        except (MemoryBudgetError, ValueError) as error:
            rows.append((float("inf"), family, "-", str(error)))
            continue
        plan = joint.plan
        detail = f"{plan.num_microbatches} microbatches" + ("" if plan.memory is None else ", with a memory plan")
        rows.append((joint.step_seconds, family, detail, ""))
    rows.sort(key=lambda row: row[0])
    table = Table(title=f"Simulated step of the first batch on {num_ranks} pipeline ranks (joint planner)")
    for column in ("family", "best plan", "step ms", "vs fastest"):
        table.add_column(column)
    fastest = rows[0][0]
    for seconds, family, detail, why in rows:
        finite = seconds != float("inf")
        table.add_row(family, detail if finite else f"does not run: {why}", f"{seconds * 1e3:.2f}" if finite else "-",
                      f"{seconds / fastest:.2f}x" if finite and fastest != float("inf") else "-")
    console = Console(width=160, record=True, color_system=None, file=io.StringIO())
    console.print(table)
    console.print(f"Start the run with `schedule={rows[0][1]!r}`." if fastest != float("inf") else "No family fits.", markup=False)
    return console.export_text()


def _configured_microbatches(strategy: Any) -> int | None:
    if isinstance(strategy, dict):
        return strategy.get("init_args", {}).get("num_microbatches") or 2 * (
            strategy.get("init_args", {}).get("pipeline_parallel_size") or 2
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
