"""Pipeline schedules as plain data: IR, families, validator, simulator (pure Python, no torch)."""

from . import families as _families  # noqa: F401  (registers the built-in families)
from .costs import ActionCosts
from .dsl import PRESETS, RuleContext, ScheduleSpec, build_spec, parse_spec, register_rule
from .instructions import Instruction, available_instructions, custom_action, get_instruction, register_instruction
from .ir import Action, ActionType, B, F, I, Program, W
from .lowering import build_program, forward_only, insert_communication, place_stages
from .registry import Schedule, available_schedules, register_schedule, resolve_schedule
from .simulate import SimulationResult, TimedAction, simulate
from .validate import ScheduleError, validate
