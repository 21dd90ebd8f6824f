"""``python -m lightning_pipe.profiling``: the ``lightning-pipe-profile`` command."""

import sys

from lightning_pipe.profiling.cli import main

sys.exit(main())
