"""Every private torch name the runtime touches, each in one place with a test (tests/runtime)."""

from __future__ import annotations

from torch.autograd.graph import Node


def grad_output_count(node: Node) -> int:
    """How many gradients flow into ``node`` (the outputs of its forward): the length of the tuple a
    node pre-hook receives. torch keeps it in the private ``Node._input_metadata``."""
    metadata = getattr(node, "_input_metadata", None)
    if metadata is None:
        raise RuntimeError(
            "torch.autograd Node has no `_input_metadata` in this torch version; lightning-pipe's split backward "
            "(zero-bubble schedules) needs the number of a node's gradient outputs: update runtime/_torch_compat.py."
        )
    return len(metadata)
