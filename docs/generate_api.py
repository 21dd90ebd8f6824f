"""Write docs/api.md from the docstrings of the public API (every subpackage's ``__all__``).

    python docs/generate_api.py          # rewrite docs/api.md
    python docs/generate_api.py --check  # exit 1 if docs/api.md is out of date (used by the tests)
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

PACKAGES = [
    "lightning_pipe",
    "lightning_pipe.callbacks",
    "lightning_pipe.schedules",
    "lightning_pipe.planning",
    "lightning_pipe.model",
    "lightning_pipe.runtime",
    "lightning_pipe.profiling",
    "lightning_pipe.export",
]
TARGET = Path(__file__).with_name("api.md")


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _entry(qualified: str, obj: object) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    lines = [f"### `{qualified}`", "", f"*{kind}* `{qualified.rsplit('.', 1)[-1]}{_signature(obj) if kind != 'value' else ''}`", ""]
    doc = inspect.getdoc(obj) if kind != "value" else None
    if doc:
        lines += [doc, ""]
    return lines


def render() -> str:
    """The whole API page as markdown."""
    lines = ["# API reference", "", "Generated from docstrings by `docs/generate_api.py`; do not edit by hand.", ""]
    for package in PACKAGES:
        module = importlib.import_module(package)
        lines += [f"## `{package}`", ""]
        doc = inspect.getdoc(module)
        if doc:
            lines += [doc.split("\n\n")[0], ""]
        for name in getattr(module, "__all__", []):
            if name.startswith("__"):
                continue
            lines += _entry(f"{package}.{name}", getattr(module, name))
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if TARGET.exists() and TARGET.read_text() == text else 1)
    TARGET.write_text(text)
    print(f"wrote {TARGET} ({len(text.splitlines())} lines)")
