"""Consolidate the model part of a DCP checkpoint into one file of full weights."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["export_weights", "load_full_weights"]

FORMATS = (".pt", ".safetensors")


def load_full_weights(
    checkpoint_dir: str | os.PathLike[str], key: str = "model"
) -> dict[str, torch.Tensor]:
    """Read the full tensors stored under ``key`` of a DCP checkpoint, in one process.

    ``key`` is the top-level entry the model state dict was saved under (``"model"`` in
    ``dcp.save({"model": ..., "optim": ...})``); ``""`` reads a checkpoint saved from a
    bare model state dict. No process group is needed; shards written by any number of
    ranks are assembled by DCP.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` is not a DCP checkpoint.
        KeyError: the checkpoint has no tensors under ``key``.
    """
    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a DCP checkpoint (no .metadata file); pass a directory written "
            "by torch.distributed.checkpoint.save, such as CHECKPOINT_DIR/step_00000100"
        )
    metadata = FileSystemReader(str(path)).read_metadata()
    prefix = f"{key}." if key else ""
    template: dict[str, torch.Tensor] = {}
    for name, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and name.startswith(prefix):
            template[name[len(prefix) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    if not template:
        tops = sorted({name.split(".", 1)[0] for name in metadata.state_dict_metadata})
        raise KeyError(
            f"the checkpoint holds no tensors under {key!r}; its top-level entries are {tops}. "
            "Pass --key with the name the model state dict was saved under."
        )
    state = {key: template} if key else template
    with warnings.catch_warnings():
        # One process on purpose: DCP's "assuming the intent is to load in a single
        # process" note says what this function is for.
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return template


def export_weights(
    checkpoint_dir: str | os.PathLike[str], output: str | os.PathLike[str], key: str = "model"
) -> dict[str, torch.Tensor]:
    """Write the full weights of a checkpoint to ``output`` (``.pt`` or ``.safetensors``).

    ``.pt`` is a ``torch.save`` of the state dict (``model.load_state_dict`` takes it);
    ``.safetensors`` needs the ``safetensors`` package. Returns the weights written.

    Raises:
        ValueError: ``output`` has another suffix.
        ImportError: ``.safetensors`` without the ``safetensors`` package.
    """
    out = Path(output)
    if out.suffix not in FORMATS:
        raise ValueError(f"--output must end in .pt or .safetensors, got {str(out)!r}")
    weights = load_full_weights(checkpoint_dir, key)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".pt":
        torch.save(weights, out)
    else:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError(
                "writing .safetensors needs the safetensors package: pip install safetensors "
                "(or write .pt)"
            ) from None
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out))
    return weights
