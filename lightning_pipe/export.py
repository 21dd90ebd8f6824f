"""Turn a sharded checkpoint directory into one file, or into a transformers-style safetensors folder.

Command line (``lightning-pipe-export`` or ``python -m lightning_pipe.export``)::

    lightning-pipe-export checkpoints/epoch=0-step=100.ckpt consolidated.ckpt
    lightning-pipe-export checkpoints/epoch=0-step=100.ckpt hf_model/ --format safetensors --config gpt2-config/

The consolidated file is what ``save_distributed_checkpoint=False`` writes: Lightning's checkpoint
with ``state_dict`` keyed by the module's own names and optimizer states in torch's index format
(indices agree with a single-process optimizer), so it loads into a plain LightningModule on one
device (``load_from_checkpoint``, ``Trainer.fit(ckpt_path=...)``). It is read in one process, which
needs the whole state in memory: meant for export and small models, not for resuming large ones
(resume from the directory instead; it reshards).

The safetensors folder is what ``PreTrainedModel.save_pretrained`` writes for the module's inner
transformers model: ``model.safetensors`` with the inner model's keys (the LightningModule's attribute
prefix, ``model.`` for ``self.model = AutoModelForCausalLM...``, stripped) and, with ``--config``,
``config.json``, so ``AutoModelForCausalLM.from_pretrained(folder)`` loads it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.runtime.sharded_checkpoint import META_FILENAME, is_sharded_checkpoint, load_all

__all__ = ["consolidate_checkpoint", "export_safetensors", "main", "read_checkpoint"]


def consolidate_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The single-file form of a sharded checkpoint directory, in memory (one process, no group).

    Args:
        directory: a checkpoint directory written with ``save_distributed_checkpoint=True``.

    Returns:
        Lightning's checkpoint dict: ``meta.pt``'s entries, ``state_dict`` in the module's key order,
        and ``optimizer_states`` in torch's index format (``master_weights`` too where saved).

    Raises:
        ValueError: ``directory`` is not a sharded checkpoint.
    """
    directory = Path(directory)
    if not is_sharded_checkpoint(directory):
        raise ValueError(
            f"{str(directory)!r} is not a sharded checkpoint directory (DCP shards and {META_FILENAME}). "
            "A single-file checkpoint needs no consolidation: load it with `torch.load`."
        )
    saved = load_all(directory)
    checkpoint = torch.load(directory / META_FILENAME, map_location="cpu", weights_only=False)
    module = saved.get("state_dict", {})
    order = checkpoint.get("pipeline", {}).get("state_dict_keys") or list(module)
    checkpoint["state_dict"] = {name: module[name] for name in order if name in module}
    checkpoint["state_dict"].update({name: value for name, value in module.items() if name not in order})
    states = []
    while f"optimizer_{len(states)}" in saved:
        states.append(_indexed(saved[f"optimizer_{len(states)}"]))
    if states:
        checkpoint["optimizer_states"] = states
    if "pipeline" in checkpoint:
        checkpoint["pipeline"] = {**checkpoint["pipeline"], "format": "consolidated"}
    return checkpoint


def _indexed(saved: dict[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state -> torch's format (indices in the param groups' order)."""
    groups = saved["param_groups"]
    index = {name: i for i, name in enumerate(n for group in groups for n in group["params"])}
    state = saved.get("state", {})
    result: dict[str, Any] = {
        "state": {index[n]: state[n] for n in sorted(state, key=index.__getitem__)},
        "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in groups],
    }
    masters = saved.get("master_weights", {})
    if masters:
        result["master_weights"] = {index[n]: masters[n] for n in sorted(masters, key=index.__getitem__)}
    return result


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint of either format as one dict: a sharded directory consolidated, a file loaded."""
    path = Path(path)
    if path.is_dir():
        return consolidate_checkpoint(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def _strip_prefix(state: dict[str, torch.Tensor], prefix: str | None) -> dict[str, torch.Tensor]:
    """The inner model's keys: ``prefix`` removed; None: the first name component, if every key shares it."""
    if prefix is None:
        heads = {name.split(".", 1)[0] for name in state}
        if len(heads) != 1 or any("." not in name for name in state):
            raise ValueError(
                f"The module's keys start with several attributes ({sorted(heads)[:5]}): say which one holds the "
                "transformers model with `prefix=` (command line: `--prefix model`)."
            )
        prefix = heads.pop()
    prefix = prefix.rstrip(".") + "." if prefix else ""
    inner = {name[len(prefix) :]: value for name, value in state.items() if name.startswith(prefix)}
    if not inner:
        raise ValueError(f"No key of the checkpoint starts with {prefix!r}: check `prefix`.")
    return inner


def export_safetensors(
    checkpoint: str | Path | dict[str, Any],
    directory: str | Path,
    prefix: str | None = None,
    config: Any = None,
) -> Path:
    """Write the module's inner transformers model as ``save_pretrained`` does (``model.safetensors``).

    Args:
        checkpoint: a checkpoint path (sharded directory or file) or a loaded checkpoint dict.
        directory: the folder to write (created).
        prefix: the LightningModule attribute holding the model (``"model"``); None: the one attribute
            every key starts with.
        config: a ``transformers.PretrainedConfig``, or a name or folder ``AutoConfig.from_pretrained``
            reads; written as ``config.json``. None: the checkpoint's hyperparameters' ``config`` if it
            is a config or its dict, else no ``config.json``.

    Returns:
        The path of ``model.safetensors``.
    """
    from safetensors.torch import save_file

    loaded = checkpoint if isinstance(checkpoint, dict) else read_checkpoint(checkpoint)
    tensors = {k: v for k, v in loaded["state_dict"].items() if isinstance(v, torch.Tensor)}
    inner = _strip_prefix(tensors, prefix)
    # safetensors refuses tensors sharing memory (tied weights): every entry gets its own contiguous copy
    inner = {name: value.detach().cpu().contiguous().clone() for name, value in inner.items()}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "model.safetensors"
    save_file(inner, str(target), metadata={"format": "pt"})
    config = config if config is not None else _config_from_hyperparameters(loaded)
    if config is not None:
        _write_config(config, directory)
    return target


def _config_from_hyperparameters(checkpoint: dict[str, Any]) -> Any:
    hparams = checkpoint.get("hyper_parameters") or {}
    config = hparams.get("config") if isinstance(hparams, dict) else None
    if config is None or hasattr(config, "save_pretrained"):
        return config
    return config if isinstance(config, dict) and "model_type" in config else None


def _write_config(config: Any, directory: Path) -> None:
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
        return
    if isinstance(config, dict):
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        return
    from transformers import AutoConfig

    AutoConfig.from_pretrained(config).save_pretrained(directory)


def main(argv: list[str] | None = None) -> None:
    """``lightning-pipe-export CHECKPOINT OUTPUT [--format ckpt|safetensors] [--prefix P] [--config C]``."""
    parser = argparse.ArgumentParser(
        prog="lightning-pipe-export",
        description="Turn a sharded lightning-pipe checkpoint (a directory) into one .ckpt file, or into a "
        "transformers-style folder with model.safetensors.",
    )
    parser.add_argument("checkpoint", type=Path, help="the checkpoint directory (or a single-file checkpoint)")
    parser.add_argument("output", type=Path, help="the .ckpt file, or the folder for --format safetensors")
    parser.add_argument("--format", choices=["ckpt", "safetensors"], default="ckpt")
    parser.add_argument("--weights-only", action="store_true", help="ckpt: keep only state_dict (no optimizer)")
    parser.add_argument("--prefix", default=None, help="safetensors: the LightningModule attribute of the model")
    parser.add_argument("--config", default=None, help="safetensors: a transformers config name or folder")
    args = parser.parse_args(argv)
    checkpoint = read_checkpoint(args.checkpoint)
    if args.format == "safetensors":
        target = export_safetensors(checkpoint, args.output, prefix=args.prefix, config=args.config)
        print(f"wrote {target} ({len(checkpoint['state_dict'])} tensors of the module)")
        return
    if args.weights_only:
        kept = ("state_dict", "epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "hparams_name")
        checkpoint = {key: value for key, value in checkpoint.items() if key in kept}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
