"""Measuring a module: what each unit costs (meta-device counts, real timings) and keeps in memory.

Apart from ``runtime/`` (which runs steps and imports neither this package nor ``planning/``): the
probes here fit ``planning/`` cost and memory models, so they may import ``planning/``. The strategy
(``strategies/costs.py``, ``strategies/memory.py``), the ``PipelineProfiler`` callback and the
``lightning-pipe-profile`` command (``profiling/cli.py``) use them.
"""

from lightning_pipe.profiling.cost_probe import CostEstimate, DeviceSpeed, count_units, fit_cost_model
from lightning_pipe.profiling.estimate import estimate_costs, format_fits, profile_module, save_profile
from lightning_pipe.profiling.memory_profile import measure_stages, probe_microbatches, sequence_lengths
from lightning_pipe.profiling.probing import token_tensor, untouched
from lightning_pipe.profiling.unit_timing import fit_timings, time_units

# Public: the estimate a profile produces and the functions that make it from a module and a microbatch.
__all__ = [
    "CostEstimate",
    "DeviceSpeed",
    "count_units",
    "estimate_costs",
    "fit_cost_model",
    "fit_timings",
    "format_fits",
    "measure_stages",
    "probe_microbatches",
    "profile_module",
    "save_profile",
    "sequence_lengths",
    "time_units",
    "token_tensor",
    "untouched",
]
