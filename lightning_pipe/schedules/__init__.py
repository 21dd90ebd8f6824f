"""Pipeline schedules as plain data: IR, families, DSL, validator, simulator, pictures. No torch.

What is public is listed in ``__all__``; everything else (``lowering``, ``dsl_engine``, helpers
with a leading underscore) may change. Typical use::

    from lightning_pipe.schedules import ActionCosts, render_ascii, resolve_schedule, simulate, validate

    schedule = resolve_schedule("interleaved_1f1b")          # or a DSL spec, text or dict
    program = validate(schedule.build(num_ranks=4, num_microbatches=8))
    result = simulate(program, ActionCosts.uniform(program.num_stages, 8))
    print(render_ascii(result), result.bubble_ratio)
"""

from . import families as _families  # noqa: F401  (importing registers the built-in families)
from .auto import AutoScheduleRow, auto_schedule, format_auto_table, render_auto_table, split_stages
from .backward_merging import (
    merge_backward_pairs,
    merge_decision_costs,
    measured_merge_costs,
    merge_split_backwards,
    mergeable_pairs,
    merged_if_split,
    merged_program,
)
from .costs import ActionCosts, SplitBackward
from .dsl import PRESETS, ScheduleSpec, build_spec, parse_spec, register_rule
from .dsl_engine import RuleContext
from .families.helix import helix, helix_stage_costs
from .families.spipe import spipe
from .instructions import (
    Instruction,
    available_instructions,
    custom_action,
    get_instruction,
    register_instruction,
    unregister_instruction,
)
from .ir import Action, ActionType, B, F, I, Program, W
from .layout_program import LayoutProgram, layout_1f1b
from .lowering import build_program, forward_only, insert_communication, place_stages
from .registry import Schedule, available_schedules, register_schedule, unregister_schedule
from .render import render_ascii, render_png, to_chrome_trace, write_chrome_trace
from .resolve import resolve_schedule
from .simulate import SimulationResult, TimedAction, simulate
from .split_schedules import is_split_placement, split_program
from .text import format_action, format_csv, format_table, parse_action, parse_csv, parse_table
from .validate import ScheduleError, format_grid, validate

__all__ = [
    # IR and costs (the shared contract)
    "Action",
    "ActionType",
    "Program",
    "ActionCosts",
    "SplitBackward",
    "F",
    "B",
    "I",
    "W",
    # families and registry
    "Schedule",
    "resolve_schedule",
    "register_schedule",
    "unregister_schedule",
    "available_schedules",
    "forward_only",
    "LayoutProgram",
    "layout_1f1b",
    "build_program",
    "insert_communication",
    "place_stages",
    # split placement (simulated only: HelixPipe, SPipe)
    "helix",
    "helix_stage_costs",
    "spipe",
    "split_program",
    "is_split_placement",
    # checking and measuring
    "validate",
    "ScheduleError",
    "format_grid",
    "simulate",
    "SimulationResult",
    "TimedAction",
    # text forms (torch.distributed.pipelining tokens and CSV)
    "format_action",
    "parse_action",
    "format_csv",
    "parse_csv",
    "format_table",
    "parse_table",
    # pictures
    "render_ascii",
    "render_png",
    "to_chrome_trace",
    "write_chrome_trace",
    # zero-bubble pairs run as one backward where splitting buys nothing
    "mergeable_pairs",
    "merge_backward_pairs",
    "merge_split_backwards",
    "merge_decision_costs",
    "merged_program",
    "merged_if_split",
    "measured_merge_costs",
    # DSL
    "ScheduleSpec",
    "parse_spec",
    "build_spec",
    "PRESETS",
    "RuleContext",
    "register_rule",
    "Instruction",
    "register_instruction",
    "unregister_instruction",
    "get_instruction",
    "available_instructions",
    "custom_action",
    # auto-scheduler
    "auto_schedule",
    "AutoScheduleRow",
    "format_auto_table",
    "render_auto_table",
    "split_stages",
]
