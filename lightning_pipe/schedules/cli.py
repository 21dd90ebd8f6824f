"""Command line: look at schedules without a cluster (``lightning-pipe-schedule``).

Examples::

    python -m lightning_pipe.schedules.cli show 1f1b --ranks 4 --microbatches 8
    python -m lightning_pipe.schedules.cli show zbv --stages 8 --microbatches 8 --png zbv.png --trace zbv.json
    python -m lightning_pipe.schedules.cli show "placement=circular stages_per_rank=2 max_in_flight=4" -p 4 -m 8
    python -m lightning_pipe.schedules.cli auto --ranks 4 --microbatches 8 --saved-bytes 1 --memory-limit 4
    python -m lightning_pipe.schedules.cli show helix --ranks 4 --blocks 8 --microbatches 8
    python -m lightning_pipe.schedules.cli list
    python -m lightning_pipe.schedules.cli gallery docs/img/schedules

``--stages`` counts stages as the rest of the project does (a rank holds ``stages_per_rank`` of
them), so ``--stages 8`` with ``zbv`` means 4 ranks; ``--ranks`` gives the pipeline size directly.
Costs are per rank's share of the model (``--forward 1 --backward 2``) and are divided among a
rank's stages.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .auto import auto_schedule, format_auto_table
from .costs import ActionCosts
from .dsl import PRESETS
from .gallery import render_gallery
from .registry import Schedule, available_schedules
from .resolve import resolve_schedule
from .render import render_ascii, render_png, write_chrome_trace
from .simulate import simulate
from .split_schedules import is_split_placement, split_program, split_share_costs
from .text import format_table

__all__ = ["main"]


def _add_size_and_costs(parser: argparse.ArgumentParser, *, stages: bool = True) -> None:
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--ranks", "-p", type=int, help="pipeline ranks")
    if stages:
        size.add_argument("--stages", type=int, help="total stages (ranks x stages per rank)")
    parser.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches per step")
    parser.add_argument("--forward", type=float, default=1.0, help="forward seconds of one rank's share (default 1)")
    parser.add_argument("--backward", type=float, default=2.0, help="backward seconds of one rank's share (default 2)")
    parser.add_argument("--backward-input", type=float, default=None, help="I seconds (default backward / 2)")
    parser.add_argument("--backward-weight", type=float, default=None, help="W seconds (default backward / 2)")
    parser.add_argument(
        "--saved-bytes", type=float, default=1.0, help="activation bytes one rank's share saves per microbatch"
    )
    parser.add_argument("--static-bytes", type=float, default=0.0, help="parameter/optimizer bytes of one rank's share")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per point-to-point message")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-pipe-schedule", description="Inspect pipeline schedules (simulated)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="print the timeline of one schedule")
    show.add_argument("schedule", help="family name (see 'list') or DSL spec text")
    _add_size_and_costs(show)
    show.add_argument("--png", help="also write a Gantt chart PNG here")
    show.add_argument("--trace", help="also write a Chrome-trace JSON here")
    show.add_argument("--width", type=int, default=160, help="characters for the time axis (default 160)")
    show.add_argument("--actions", action="store_true", help="also print each rank's action list")
    show.add_argument(
        "--blocks", type=int, default=None,
        help="the model's blocks, for helix/spipe (their stage count follows the model; uniform share costs)",
    )
    auto = commands.add_parser("auto", help="rank families and DSL settings by simulated step time")
    _add_size_and_costs(auto, stages=False)
    auto.add_argument("--memory-limit", type=float, default=None, help="bytes per rank")
    auto.add_argument("--top", type=int, default=None, help="show only the best N rows")
    auto.add_argument("--blocks", type=int, default=None, help="the model's blocks: also price spipe (and helix)")
    auto.add_argument(
        "--attention-share", type=float, default=None, help="fraction of a block's time in attention (prices helix)"
    )
    commands.add_parser("list", help="list families and DSL presets")
    gallery = commands.add_parser("gallery", help="render the documented pictures into a folder")
    gallery.add_argument("out_dir")
    return parser


def _costs(args: argparse.Namespace, num_ranks: int, stages_per_rank: int) -> ActionCosts:
    v = stages_per_rank

    def share(value: float | None) -> float | None:
        return None if value is None else value / v

    return ActionCosts.uniform(
        num_ranks * v,
        args.microbatches,
        forward=args.forward / v,
        backward=args.backward / v,
        backward_input=share(args.backward_input),
        backward_weight=share(args.backward_weight),
        saved_bytes=args.saved_bytes / v,
        static_bytes=args.static_bytes / v,
        latency=args.latency,
    )


def _num_ranks(args: argparse.Namespace, schedule: Schedule) -> int:
    if args.ranks is not None:
        return args.ranks
    if args.stages % schedule.stages_per_rank:
        raise ValueError(
            f"--stages {args.stages} is not a multiple of the {schedule.stages_per_rank} stages per rank of "
            f"{schedule.name!r}; pass --ranks instead"
        )
    return args.stages // schedule.stages_per_rank


def _show(args: argparse.Namespace) -> int:
    schedule = resolve_schedule(args.schedule)
    num_ranks = _num_ranks(args, schedule)
    v = schedule.stages_per_rank
    if is_split_placement(schedule):  # stages follow the model: one rank's share costs 1 forward, 2 backward
        if args.ranks is None:
            raise ValueError(f"{schedule.name!r} places stages by the model's blocks: pass --ranks and --blocks")
        program = split_program(schedule, num_ranks, args.microbatches, args.blocks or num_ranks)
        result = simulate(program, split_share_costs(program, num_ranks))
    else:
        program = schedule.build(num_ranks, args.microbatches)
        result = simulate(program, _costs(args, num_ranks, v))
    layout = (
        f"{num_ranks} ranks, {program.num_stages} stages placed per microbatch"
        if program.pair_ranks is not None
        else f"{num_ranks} ranks x {v} stage(s) per rank = {program.num_stages} stages"
    )
    print(f"{program.name}: {layout}, {args.microbatches} microbatches")
    print(render_ascii(result, max_width=args.width))
    print(f"makespan {result.makespan:g}   bubble ratio {result.bubble_ratio:.1%}")
    print(f"peak in-flight microbatches per rank: {list(result.max_in_flight)}")
    print(f"peak memory per rank: {[round(x, 4) for x in result.peak_memory]}")
    if args.actions:
        print(format_table(program))
    if args.png:
        print(f"wrote {render_png(result, args.png)}")
    if args.trace:
        print(f"wrote {write_chrome_trace(result, args.trace)}")
    return 0


def _auto(args: argparse.Namespace) -> int:
    costs = _costs(args, args.ranks, 1)
    rows = auto_schedule(
        costs, args.ranks, args.memory_limit, num_blocks=args.blocks, attention_share=args.attention_share
    )
    print(format_auto_table(rows, limit=args.top))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for invalid arguments or schedules)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "show":
            return _show(args)
        if args.command == "auto":
            return _auto(args)
        if args.command == "gallery":
            for path in render_gallery(args.out_dir):
                print(f"wrote {path}")
            return 0
        print("families: " + ", ".join(n for n in available_schedules() if n != "dsl"))
        print("DSL presets (e.g. 'preset=zb' or '1f1b max_in_flight=2'): " + ", ".join(sorted(PRESETS)))
        return 0
    except ValueError as error:  # includes ScheduleError
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
