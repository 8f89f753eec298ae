"""The model a cluster plan is made for: a Hugging Face causal LM built on the meta device
from its config alone (no weights are read or allocated)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: Names of the config fields that hold a mixture of experts' expert count.
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def load_config(source: str | Path | Mapping[str, Any]) -> Any:
    """A ``transformers`` config from a model directory, a ``config.json`` file, or a dict
    with its ``model_type``.

    Raises:
        ValueError: No config there, or one transformers does not know.
    """
    from transformers import AutoConfig

    fields = _config_fields(source)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # transformers' field validation raises several kinds
        raise ValueError(f"transformers cannot build a {model_type!r} model: {error}") from error


def planning_model(source: str | Path | Mapping[str, Any]) -> tuple[nn.Module, Any]:
    """The model to plan and its config, from a model directory, a ``config.json`` or a
    dict: a standard decoder (`dmuon.plan._decoder`) is built without importing
    transformers; any other model through `load_config` and `meta_model`.

    Raises:
        ValueError: As `load_config`, or transformers cannot lay the model out from these
            sizes (a head size of 0, say).
    """
    from dmuon.plan._decoder import decoder_meta_model

    fields = _config_fields(source)
    model = decoder_meta_model(fields)
    if model is not None:
        return model, model.config
    config = load_config(fields)
    try:
        return meta_model(config), config
    except (ArithmeticError, TypeError, ValueError, RuntimeError) as error:  # bad sizes
        raise ValueError(
            f"transformers cannot build a {fields['model_type']!r} model from this config: "
            f"{type(error).__name__}: {error}"
        ) from error


def _config_fields(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the config at ``source``, which must name its ``model_type``."""
    if isinstance(source, Mapping):
        fields = dict(source)
    else:
        path = Path(source)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(
                f"{str(source)!r} is neither a Hugging Face model directory with a config.json "
                "nor a config.json file; pass the folder that holds the model's config.json "
                "(weights are not needed)"
            )
        fields = json.loads(file.read_text(encoding="utf-8"))
    if not fields.get("model_type"):
        raise ValueError(
            'the config has no "model_type" (such as "llama" or "qwen3_moe"); it is needed '
            "to know which model to build"
        )
    return fields


def meta_model(config: Any) -> nn.Module:
    """The causal LM of ``config`` on the meta device: shapes and structure, no storage."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def active_parameters(model: nn.Module, config: Any) -> int:
    """Parameters one token passes through: every parameter, with each expert stack
    counted for the share ``num_experts_per_tok / experts`` of a mixture of experts."""
    total = sum(p.numel() for p in model.parameters())
    experts = next(
        (getattr(config, f) for f in _EXPERT_COUNT_FIELDS if getattr(config, f, None)), 0
    )
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    if not experts or not top_k:
        return total
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    return int(total - routed * (1 - top_k / experts))
