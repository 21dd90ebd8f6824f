"""Lightning callbacks that decide plans and watch the pipeline."""

from lightning_pipe.callbacks.schedule_switch import ScheduleSwitch

# Public: callbacks users add to the Trainer.
__all__ = ["ScheduleSwitch"]
