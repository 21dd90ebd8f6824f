import sys

from lightning_pipe.cli import main

sys.exit(main())
