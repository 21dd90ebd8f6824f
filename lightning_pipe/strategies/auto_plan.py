"""``ElasticPipelineStrategy(plan="auto")``: the strategy installs the joint planner itself.

With ``plan="auto"`` every step's plan (partition, schedule family, microbatching, memory plan) comes
from :class:`~lightning_pipe.callbacks.AutoPlanner` with its defaults (the strategy's
``memory_budget`` and ``num_microbatches``, families ``1f1b``, ``gpipe``, ``zb_h1`` and
``interleaved_1f1b``, even and work-balanced microbatches, lookahead), added to the Trainer's
callbacks before their ``setup`` hooks run, so a LightningCLI YAML needs one line
(``init_args: {plan: auto}``) and no callback entry.

Refused, with what to change, because the joint plan would silently override them: a user's own
``AutoPlanner`` (configure it and keep ``plan="static"``), single-lever planners (``ElasticRepartition``,
``ScheduleSwitch``, ``MemoryPlanner``: the joint planner chooses their part with the others), and the
static ``recompute``/``offload`` arguments (memory plans are chosen per batch under ``memory_budget``).

``strategies`` may not import ``callbacks`` (tests/test_layers.py): the package's ``__init__`` registers
the planner class and the conflicting classes here with :func:`register_auto_planner`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from lightning.pytorch.callbacks import Checkpoint

PlanMode = Literal["static", "auto"]
PLAN_MODES = ("static", "auto")

_registered: dict[str, Any] = {}


def register_auto_planner(factory: Callable[[], Any], conflicts: tuple[type, ...]) -> None:
    """Tell the strategy how to make the joint planner and which callbacks ``plan="auto"`` refuses.

    Args:
        factory: makes the planner callback (``AutoPlanner``); also its class, to recognise it.
        conflicts: callback classes whose decisions the joint plan would override.
    """
    _registered.update(factory=factory, conflicts=conflicts)


def check_plan_mode(plan: str, recompute: Any, offload: bool | int) -> None:
    """Refuse a bad ``plan`` argument, or ``plan="auto"`` with static memory arguments."""
    if plan not in PLAN_MODES:
        raise ValueError(f"`ElasticPipelineStrategy(plan={plan!r})`: use 'static' or 'auto'.")
    if plan == "auto" and (recompute is not None or offload):
        raise ValueError(
            f"`ElasticPipelineStrategy(plan='auto')` chooses recomputation and offload per batch under `memory_budget`, "
            f"so `recompute={recompute!r}` and `offload={offload!r}` would be overridden: leave them unset, or use "
            "plan='static' with those arguments."
        )


def install_auto_planner(trainer: Any) -> None:
    """Add the joint planner to ``trainer.callbacks`` (once), or refuse a conflicting callback.

    Called from the strategy's ``setup_environment`` on every rank, before the callbacks' ``setup``.
    """
    if not _registered:
        raise RuntimeError("`plan='auto'` needs `import lightning_pipe` (it registers the joint planner).")
    factory, conflicts = _registered["factory"], _registered["conflicts"]
    callbacks = trainer.callbacks
    if any(getattr(c, "_installed_by_strategy", False) for c in callbacks):
        return  # a second fit with the same Trainer
    clashing = [type(c).__name__ for c in callbacks if isinstance(c, (factory, *conflicts))]
    if clashing:
        raise ValueError(
            f"`ElasticPipelineStrategy(plan='auto')` installs its own AutoPlanner, which chooses partition, schedule "
            f"family, microbatching and memory plan together; the Trainer also has {', '.join(sorted(clashing))}, whose "
            "decisions it would override. Remove them from `callbacks`, or keep plan='static' and add the callbacks "
            "you want (an `AutoPlanner(...)` with your own settings included)."
        )
    planner = factory()
    planner._installed_by_strategy = True
    at = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
    callbacks.insert(at, planner)  # checkpoint callbacks stay last, as Lightning orders them
