"""A registered instruction's runtime function for tests: it records where it ran."""

from __future__ import annotations

import json
from pathlib import Path


def record(call) -> None:
    """Append ``(stage, microbatch)`` to ``<attributes['dir']>/rank<r>.jsonl``."""
    path = Path(call.attributes["dir"]) / f"rank{call.pipeline_rank}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps([call.name, call.stage, call.microbatch]) + "\n")
