"""Sharded checkpoint directories through ``torch.distributed.checkpoint`` (DCP).

Each rank hands DCP a nested state dict of what it holds: ``{"state_dict": {name: tensor},
"optimizer_0": {"state": {param name: {key: value}}, "param_groups": [...]}}``. DCP flattens it to
keys such as ``state_dict.blocks.0.attn.weight`` and ``optimizer_0.state.blocks.0.attn.weight.exp_avg``
(the flat path of every key is kept in the checkpoint's metadata), and its save planner writes every
key once: a key several ranks hold (data-parallel replicas, tied parameters of the pipeline's two ends)
goes to one of them, spread over the holders. Loading asks for keys by name, whichever rank wrote them:
a rank of another layout simply asks for the keys it owns now (``load_keys``). Nothing here knows
about Lightning; ``strategies/distributed_checkpoint.py`` builds the state dicts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

# Lightning's name for the small file of non-tensor state next to the shards (``_METADATA_FILENAME``).
META_FILENAME = "meta.pt"

FlatPath = tuple[Any, ...]


def create_checkpoint_group(timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """A gloo group of every process for checkpoint coordination (a collective: all ranks call it).

    A group of its own, so that an asynchronous save can plan and finish on a background thread while
    training uses the other groups, and object collectives work whatever the training backend is.
    None without an initialized process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def save_shards(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> None:
    """Write this rank's ``state`` into ``directory`` (a collective of ``group``)."""
    with warnings.catch_warnings():  # without a group: "assuming the intent is to save in a single process"
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state, storage_writer=FileSystemWriter(directory), process_group=group, no_dist=group is None)


def start_async_save(state: dict[str, Any], directory: Path, group: dist.ProcessGroup | None) -> Future:
    """Copy ``state``'s tensors to fresh host memory now, write them on a background thread.

    The returned future completes when every rank's shard and DCP's metadata are written. ``group``
    must not be used by anything else until then (see :func:`create_checkpoint_group`).
    """
    return dcp.async_save(state, storage_writer=FileSystemWriter(directory), process_group=group, no_dist=group is None)


def read_metadata(directory: Path) -> Metadata:
    """DCP's metadata of a checkpoint directory: every key's size and dtype, and its nested path."""
    return FileSystemReader(directory).read_metadata()


def flat_paths(metadata: Metadata) -> dict[str, FlatPath]:
    """Every flat key of the checkpoint and its path in the nested state dict that was saved."""
    planner_data = metadata.planner_data or {}
    return {key: tuple(planner_data.get(key, (key,))) for key in metadata.state_dict_metadata}


def load_keys(
    directory: Path,
    metadata: Metadata,
    wanted: Callable[[FlatPath], bool],
    group: dist.ProcessGroup | None,
    targets: dict[FlatPath, torch.Tensor] | None = None,
) -> dict[FlatPath, Any]:
    """Read the entries whose nested path ``wanted`` accepts, by path (a collective of ``group``).

    Tensors are read into ``targets[path]`` where given (in place: a module's own parameters), else
    into new host tensors of the stored size and dtype; other values (numbers, lists) are unpickled.
    Every rank asks for its own keys; DCP finds them in whichever rank's file holds them.
    """
    targets = targets or {}
    request: dict[str, Any] = {}
    paths = {}
    for key, path in flat_paths(metadata).items():
        if not wanted(path):
            continue
        stored = metadata.state_dict_metadata[key]
        if path in targets:
            request[key] = targets[path]
        elif isinstance(stored, TensorStorageMetadata):
            request[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
        else:
            request[key] = None
        paths[key] = path
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(request, storage_reader=FileSystemReader(directory), process_group=group, no_dist=group is None)
    return {paths[key]: value for key, value in request.items()}


def nest(entries: dict[FlatPath, Any]) -> dict[str, Any]:
    """Rebuild the nested state dict from ``{path: value}`` (integer path parts index lists)."""
    root: dict[Any, Any] = {}
    for path, value in entries.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _lists(root)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return [_lists(node[i]) for i in sorted(node)]
    return {k: _lists(v) for k, v in node.items()}


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (DCP shards and the meta file)."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file()


def partial_path(path: Path) -> Path:
    """Where a save into ``path`` writes until it is complete (a hidden sibling)."""
    return path.parent / f".{path.name}.partial"


def publish(partial: Path, path: Path) -> None:
    """Make the complete ``partial`` directory the checkpoint ``path`` (replacing what was there).

    A rename, so ``path`` is either the previous checkpoint or the new one, never a half-written
    directory. Replacing an existing ``path`` takes two renames (POSIX cannot rename a directory over
    a non-empty one): between them, the previous checkpoint is at ``.<name>.previous``.
    """
    _fsync_directory(partial)
    previous = path.parent / f".{path.name}.previous"
    if previous.exists():
        remove_path(previous)
    if path.exists() or path.is_symlink():
        os.replace(path, previous)
    os.replace(partial, path)
    _fsync_directory(path.parent)
    if previous.exists() or previous.is_symlink():
        remove_path(previous)


def remove_path(path: Path) -> None:
    """Remove a checkpoint file, directory or link (nothing if it is not there)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable where the filesystem can (best effort: some filesystems do
    not open or fsync directories, and the rename itself is still atomic there)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def load_all(directory: Path) -> dict[str, Any]:
    """Every entry of a sharded checkpoint, nested as saved, in this process (no process group)."""
    metadata = read_metadata(directory)
    return nest(load_keys(directory, metadata, lambda path: True, None))
