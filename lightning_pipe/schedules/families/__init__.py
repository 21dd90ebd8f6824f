"""Built-in schedule families, one module each; importing this package registers them all.

Every family is a pure function ``(num_ranks, num_microbatches, **options) -> Program`` that decides
the compute order of each rank; communication is added by
:func:`lightning_pipe.schedules.lowering.build_program`. ``gpipe``, ``1f1b``, ``interleaved_1f1b`` and
``looped_bfs`` are defined once, as DSL presets (``dsl.PRESETS``): their modules register the name and
build the preset. ``zb_h1``, ``zbv``, ``helix``, ``spipe`` and ``sliced_1f1b`` are generators.
"""

from .gpipe import gpipe
from .helix import helix
from .spipe import spipe
from .interleaved_1f1b import interleaved_1f1b
from .looped_bfs import looped_bfs
from .one_f_one_b import one_f_one_b
from .sliced_1f1b import sliced_1f1b
from .zb_h1 import zb_h1
from .zbv import zbv

__all__ = ["gpipe", "helix", "spipe", "one_f_one_b", "sliced_1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zbv"]
