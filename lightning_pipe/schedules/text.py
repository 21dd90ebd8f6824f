"""Text forms of programs: torch.distributed.pipelining action tokens, CSV, per-rank tables.

One action is one token ``f"{stage}{type}{microbatch}"`` exactly as torch's ``_Action`` prints it
(``0F3``, ``1B2``, ``2I0``, ``2W0``, ``0SEND_F1``, ``1RECV_B0``). A
program is a CSV with one row per rank and one action per cell (torch's ``_dump_csv``/``_load_csv``
layout: no header), or a table with one ``rank r: ...`` line per rank for humans and golden tests.
Registered instructions use their name as the type token (``3SYNC7``); torch does not know those.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Sequence

from .instructions import is_registered_instruction
from .ir import Action, ActionType, Program

__all__ = [
    "format_action",
    "parse_action",
    "format_csv",
    "parse_csv",
    "format_table",
    "parse_table",
    "program_from_rows",
]

_BUILTIN = sorted((t.value for t in ActionType if t is not ActionType.CUSTOM), key=len, reverse=True)
_TOKEN = re.compile(r"^(\d+)([A-Z_]*[A-Z])(\d*)$")
_TORCH_ONLY = {"UNSHARD", "RESHARD", "REDUCE_GRAD", "OVERLAP_F_B"}


def format_action(action: Action) -> str:
    """Token of one action (``str(action)``), torch's ``_Action`` text form."""
    return str(action)


def parse_action(token: str) -> Action:
    """Parse one token such as ``0F3``, ``1SEND_F2`` or ``4RECOMPUTE7``.

    Args:
        token: the text; surrounding spaces are ignored.

    Returns:
        The action.

    Raises:
        ValueError: for text that is not ``{stage}{type}{microbatch}``, a torch-only kind
            (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``, ``OVERLAP_F_B``) or an unregistered name.
    """
    text = token.strip()
    match = _TOKEN.match(text)
    if not match:
        raise ValueError(
            f"invalid action {token!r}: expected '{{stage}}{{type}}{{microbatch}}', e.g. '2F0' or '1SEND_B3'"
        )
    stage, kind, microbatch = int(match.group(1)), match.group(2), match.group(3)
    mb = int(microbatch) if microbatch else None
    if kind in _BUILTIN:
        action_type = ActionType(kind)
        if mb is None:
            raise ValueError(f"invalid action {token!r}: {kind} needs a microbatch index")
        return Action(stage, action_type, mb)
    if kind in _TORCH_ONLY:
        raise ValueError(f"action {token!r}: torch's {kind} has no lightning-pipe equivalent")
    if kind == "STEP":
        raise ValueError(
            f"action {token!r}: STEP is not an action; per-stage optimizer steps run during backward with "
            "`optimizer_offload=True` (runtime/optimizer_offload.py)"
        )
    if is_registered_instruction(kind):
        return Action(stage, ActionType.CUSTOM, mb, name=kind)
    raise ValueError(
        f"invalid action {token!r}: unknown type {kind!r}; expected one of {', '.join(sorted(_BUILTIN))} "
        "or a registered instruction"
    )


def program_from_rows(
    rows: Sequence[Sequence[Action]],
    *,
    name: str = "parsed",
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
) -> Program:
    """Program from per-rank action lists, inferring what is not given.

    Args:
        rows: per rank, its actions in order.
        name: program name.
        num_microbatches: default: one more than the largest microbatch index.
        stage_to_rank: default: the rank each stage's actions appear on.

    Returns:
        The program (not validated).

    Raises:
        ValueError: if a stage appears on two ranks or some stage below the largest one appears nowhere.
    """
    if stage_to_rank is None:
        placement: dict[int, int] = {}
        for rank, actions in enumerate(rows):
            for a in actions:
                if placement.setdefault(a.stage, rank) != rank:
                    raise ValueError(
                        f"stage {a.stage} appears on ranks {placement[a.stage]} and {rank}; pass stage_to_rank"
                    )
        missing = [s for s in range(max(placement, default=-1) + 1) if s not in placement]
        if missing:
            raise ValueError(f"stages {missing} appear on no rank; pass stage_to_rank")
        stage_to_rank = [placement[s] for s in range(len(placement))]
    if num_microbatches is None:
        num_microbatches = 1 + max((a.microbatch for r in rows for a in r if a.microbatch is not None), default=-1)
    return Program(
        name=name,
        num_stages=len(stage_to_rank),
        num_microbatches=num_microbatches,
        stage_to_rank=tuple(stage_to_rank),
        actions=tuple(tuple(r) for r in rows),
    )


def _rows(program: Program, compute_only: bool) -> list[list[Action]]:
    return [[a for a in rank if not (compute_only and a.type.is_communication)] for rank in program.actions]


def format_csv(program: Program, *, compute_only: bool = False) -> str:
    """CSV text: one row per rank, one action token per cell (torch's layout).

    Args:
        program: the program.
        compute_only: drop the point-to-point actions (torch's ``"compute_only"`` format, which
            torch lowers to communication itself); default keeps them (``"compute_comms"``).
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for row in _rows(program, compute_only):
        writer.writerow([format_action(a) for a in row])
    return buffer.getvalue()


def parse_csv(
    text: str,
    *,
    name: str = "csv",
    num_microbatches: int | None = None,
    stage_to_rank: Sequence[int] | None = None,
) -> Program:
    """Program from CSV text (:func:`format_csv` or torch's ``_dump_csv``); empty cells are skipped.

    A compute-only CSV yields a program without communication: pass it through
    :func:`lightning_pipe.schedules.lowering.insert_communication` (or ``build_program``) first.
    """
    rows = [[parse_action(cell) for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
    return program_from_rows(rows, name=name, num_microbatches=num_microbatches, stage_to_rank=stage_to_rank)


def format_table(program: Program, *, compute_only: bool = False) -> str:
    """One ``rank r: 0F0 0F1 ...`` line per rank: the per-rank text table of golden tests."""
    return "\n".join(
        f"rank {r}: " + " ".join(format_action(a) for a in row) for r, row in enumerate(_rows(program, compute_only))
    )


def parse_table(text: str | Iterable[str], **kwargs: object) -> Program:
    """Inverse of :func:`format_table` (``rank r:`` prefixes optional; blank lines ignored)."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    rows = []
    for line in lines:
        body = line.split(":", 1)[1] if line.strip().startswith("rank") else line
        if line.strip():
            rows.append([parse_action(tok) for tok in body.split()])
    return program_from_rows(rows, **kwargs)  # type: ignore[arg-type]
