"""Find the repeated block stack of a user's module: the thing pipeline stages are cut from."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class BlockStack:
    """The model's repeated stack of blocks.

    Attributes:
        path: dotted path of the container inside the root module (``"model.layers"``).
        container: the ``nn.ModuleList``/``nn.Sequential`` itself.
    """

    path: str
    container: nn.Module

    @property
    def blocks(self) -> list[nn.Module]:
        """The blocks, in execution order."""
        return list(self.container.children())

    @property
    def num_blocks(self) -> int:
        """Number of blocks in the stack."""
        return len(self.blocks)

    def block_path(self, index: int) -> str:
        """Dotted path of block ``index`` (its parameter-name prefix)."""
        return f"{self.path}.{index}"


def _num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(root: nn.Module, blocks: str | None = None) -> BlockStack:
    """Return the block stack of ``root``: the one named by ``blocks`` or the largest one found.

    Auto-detection picks, among all ``nn.ModuleList``/``nn.Sequential`` containers whose children
    (at least two) are all of one class, the one holding the most parameters.

    Args:
        root: the user's module (a LightningModule or any ``nn.Module``).
        blocks: dotted path of the stack (``"model.layers"``), or None to detect it.

    Raises:
        ValueError: ``blocks`` does not name a suitable container, or none was found.
    """
    if blocks is not None:
        try:
            container = root.get_submodule(blocks)
        except AttributeError as err:
            raise ValueError(
                f"`blocks={blocks!r}` names no submodule of {type(root).__name__}: {err}. "
                "Pass the dotted path of the nn.ModuleList/nn.Sequential holding the repeated blocks."
            ) from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 1:
            raise ValueError(
                f"`blocks={blocks!r}` is a {type(container).__name__}; it must be a non-empty "
                "nn.ModuleList or nn.Sequential of blocks."
            )
        return BlockStack(blocks, container)

    candidates = []
    for name, module in root.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        candidates.append((_num_parameters(module), name, module))
    if not candidates:
        raise ValueError(
            f"No block stack found in {type(root).__name__}: no nn.ModuleList/nn.Sequential with two or more "
            "children of one class. Pass `ElasticPipelineStrategy(blocks='dotted.path.to.layers')`."
        )
    _, name, module = max(candidates, key=lambda c: c[0])
    return BlockStack(name, module)
