"""Write a Hugging Face model directory from full weights or from a DCP checkpoint.

The directory holds ``config.json``, ``generation_config.json``, the weights as
safetensors (full tensors; tied weights once) and the tokenizer's files, so that
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it. The weights are checked against the model the config describes (every
parameter present, every shape equal: a 0-element placeholder of a dedicated matrix is
refused), and the directory is written next to its final place and renamed into it, so a
failed export leaves the previous one (or nothing) behind.

``python -m dmuon.checkpoint export-hf CHECKPOINT DIR`` exports a checkpoint written at
any world size. It reads what it needs besides the weights from the checkpoint's ``hf/``
folder (``config.json``, the tokenizer's files, and ``keys.json`` when the checkpoint's
parameter names are not HF's, as for the recipe's presets), which the recipe writes into
every checkpoint; ``--config DIR`` takes them from a model directory instead.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dmuon.checkpoint._export import load_full_weights
from dmuon.checkpoint._manifest import replace_folder

__all__ = ["KEYS_FILE", "check_export_target", "export_hf", "save_hf_model"]

KEYS_FILE = "keys.json"
"""``{checkpoint name: HF name}`` in a checkpoint's ``hf/`` folder, when names differ."""
_NOT_TOKENIZER = {"config.json", KEYS_FILE, "generation_config.json"}
_HF_DIR = "hf"


def check_export_target(output: str | os.PathLike[str]) -> Path:
    """Check that ``output`` can receive an export: absent, empty, or an earlier export.

    Raises:
        ValueError: ``output`` is a file, or a non-empty folder without ``config.json``
            (it would be replaced).
    """
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"export folder {out} is a file; pass a folder path")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise ValueError(
            f"export folder {out} is not empty and holds no earlier export (no config.json); "
            "pass a new or empty folder, so that nothing else in it is replaced"
        )
    return out


def _build_meta_model(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_hf_model(
    weights: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    output: str | os.PathLike[str],
    *,
    keys: Mapping[str, str] | None = None,
    tokenizer_files: str | os.PathLike[str] | None = None,
) -> Path:
    """Write the HF directory of ``weights`` under the architecture ``config`` describes.

    Args:
        weights: full tensors by parameter name (a model state dict).
        config: a ``config.json`` as a dict (``model_type`` included).
        output: the directory to write (replaced if it holds an earlier export).
        keys: ``{name in weights: HF name}`` when the names differ.
        tokenizer_files: a folder whose files (other than configs) are the tokenizer's;
            copied into ``output``.

    Raises:
        ValueError: a parameter is missing, has another shape (a 0-element placeholder),
            or ``output`` cannot receive an export.
    """
    from transformers import AutoConfig, GenerationConfig
    from transformers.utils import logging as hf_logging

    out = check_export_target(output)
    settings = dict(config)
    model_type = settings.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **settings)
    model = _build_meta_model(hf_config)
    renamed = {(keys or {}).get(name, name): tensor for name, tensor in weights.items()}
    expected = model.state_dict()
    tied = {name for name in expected if name not in renamed}
    problems = []
    for name, tensor in renamed.items():
        if name not in expected:
            problems.append(f"{name} is not a parameter of {type(model).__name__}")
        elif tuple(tensor.shape) != tuple(expected[name].shape):
            problems.append(
                f"{name} has shape {tuple(tensor.shape)}, the model {tuple(expected[name].shape)}"
            )
    model.load_state_dict(renamed, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.state_dict().items() if p.is_meta and n in tied]
    problems += [f"{name} is missing" for name in missing]
    if problems:
        raise ValueError(
            "the weights do not fit the model's config: " + "; ".join(problems[:8])
            + ". Export a checkpoint of this model (full weights; a checkpoint written by "
            "dmuon.get_model_state_dict holds every dedicated matrix whole)"
        )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_{out.name}.", dir=out.parent))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        if tokenizer_files is not None:
            for item in Path(tokenizer_files).iterdir():
                if item.is_file() and item.name not in _NOT_TOKENIZER:
                    shutil.copy2(item, tmp / item.name)
        tmp.chmod(0o755)
        replace_folder(tmp, out, out.with_name(f".tmp_old_{out.name}"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return out


def export_hf(
    checkpoint_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    config_dir: str | os.PathLike[str] | None = None,
    key: str = "model",
) -> Path:
    """Export a DCP checkpoint (any world size) as an HF directory; see the module docstring.

    Raises:
        FileNotFoundError: not a DCP checkpoint, or no config to export with.
        KeyError: the checkpoint has no tensors under ``key``.
        ValueError: the weights do not fit the config, or ``output`` cannot be written.
    """
    checkpoint = Path(checkpoint_dir)
    check_export_target(output)
    snapshot = Path(config_dir) if config_dir is not None else checkpoint / _HF_DIR
    if not (snapshot / "config.json").is_file():
        where = f"--config {config_dir}" if config_dir is not None else f"{checkpoint}/{_HF_DIR}"
        raise FileNotFoundError(
            f"{where} has no config.json to export with; pass --config MODEL_DIR (the model "
            "directory the checkpoint was trained from)"
        )
    weights = load_full_weights(checkpoint, key)
    config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
    keys_path = snapshot / KEYS_FILE
    keys = json.loads(keys_path.read_text(encoding="utf-8")) if keys_path.is_file() else None
    return save_hf_model(weights, config, output, keys=keys, tokenizer_files=snapshot)
