"""Argument checks shared by the family generators."""

from __future__ import annotations


def check_sizes(family: str, num_ranks: int, num_microbatches: int) -> None:
    """Raise ValueError naming the argument when a size is not a positive integer."""
    for argument, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{family}: {argument} must be a positive integer, got {argument}={value!r}")
