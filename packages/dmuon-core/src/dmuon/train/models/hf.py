"""Hugging Face model directories: checked from ``config.json``, built or loaded offline.

``--model DIR`` takes a local directory in Hugging Face layout:

* ``config.json`` only: ``AutoModelForCausalLM.from_config``, initialized from ``--seed``
  with a private RNG state (the global one is left as it was), so every rank at every
  world size builds the same weights;
* with ``*.safetensors`` weights (one file, or shards with their index): those weights,
  through ``AutoModelForCausalLM.from_pretrained``; every parameter must be in them.

Distributed, the model is built on the meta device on every rank (`meta_hf_model`),
dedicated and sharded there; rank 0 alone builds it whole on the CPU, and
`materialize_hf` loads rank 0's weights into every rank's shards and owned matrices
(``broadcast_from_rank0``), so no other rank ever holds the whole model.

Nothing reaches the network (``local_files_only``) and no code from the directory runs
(``trust_remote_code=False``). `inspect_model_dir` checks a directory from its config
alone, before any process group or file exists; `build_hf_model` builds it.

The decoder layers (FSDP2's units, and those of activation checkpointing and compile)
are the modules whose class the model lists in ``_no_split_modules``; a model without
that list falls back to the elements of its ``layers`` / ``h`` / ``blocks`` module list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import torch
from torch import nn

__all__ = [
    "HFModelInfo",
    "build_hf_model",
    "decoder_layers",
    "inspect_model_dir",
    "materialize_hf",
    "meta_hf_model",
]


@dataclass(frozen=True)
class HFModelInfo:
    """What the recipe needs to know of a model directory before building it.

    Attributes:
        path: the resolved directory.
        model_type: ``config.json``'s ``model_type`` (``llama``, ``gpt2``, ...).
        vocab_size: rows of the input embedding (``config.vocab_size``).
        max_positions: ``max_position_embeddings`` (``n_positions`` for GPT-2), or None.
        weight_files: the ``*.safetensors`` files; empty for a config-only directory.
        has_tokenizer: whether the directory holds a tokenizer ``AutoTokenizer`` loads.
    """

    path: Path
    model_type: str
    vocab_size: int
    max_positions: int | None
    weight_files: tuple[Path, ...]
    has_tokenizer: bool

    @property
    def has_weights(self) -> bool:
        """Whether the directory has weights (fine-tuning) rather than a config only."""
        return bool(self.weight_files)


def _load_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(
            f"--model {path}: transformers cannot read its config.json ({exc}). Pass a "
            "directory written by save_pretrained, or a preset name"
        ) from None


def inspect_model_dir(model: str, seq_len: int) -> HFModelInfo:
    """Check ``--model DIR`` from its files and config alone; return what it holds.

    Raises:
        ValueError: the path is not a model directory, needs remote code, is not a
            causal language model transformers builds, has weights in another format
            than safetensors, or supports fewer positions than ``seq_len``.
    """
    path = Path(model).expanduser()
    presets = ", ".join(sorted(contract.PRESETS))
    if not path.exists():
        raise ValueError(
            f"--model {model!r} is neither a preset ({presets}) nor an existing directory; "
            "pass a preset name or a Hugging Face model directory (with config.json)"
        )
    if not path.is_dir() or not contract.is_model_directory(path):
        raise ValueError(contract.not_model_directory_message(model))
    path = path.resolve()
    try:
        raw = json.loads((path / contract.HF_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--model {model}: {contract.HF_CONFIG_FILE} is not JSON ({exc})"
        ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model {model}: {contract.HF_CONFIG_FILE} is not a JSON object")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if "auto_map" in raw:
            raise ValueError(contract.remote_code_message(model, model_type))
        raise ValueError(
            f"--model {model}: model_type {model_type!r} in its config.json is not a causal "
            "language model this transformers builds. Use an architecture "
            "AutoModelForCausalLM knows (llama, qwen2, mistral, mixtral, gpt2, ...)"
        )
    config = _load_config(path)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"--model {model}: its config.json has no vocab_size")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions < seq_len:
        raise ValueError(contract.positions_message(seq_len, positions, model))
    weights = tuple(sorted(path.glob("*.safetensors")))
    if not weights and any(path.glob("*.bin")) and any(path.glob("pytorch_model*")):
        raise ValueError(
            f"--model {model}: its weights are pickled pytorch_model*.bin files, which the "
            "recipe does not load; save them as safetensors (save_pretrained's default) or "
            "remove them to train from the config alone"
        )
    has_tokenizer = any((path / name).is_file() for name in contract.TOKENIZER_FILES)
    return HFModelInfo(
        path=path,
        model_type=str(model_type),
        vocab_size=vocab,
        max_positions=positions if isinstance(positions, int) else None,
        weight_files=weights,
        has_tokenizer=has_tokenizer,
    )


def build_hf_model(info: HFModelInfo, *, seed: int, dtype: torch.dtype) -> nn.Module:
    """Build the model of ``info`` on the CPU: from its weights, or initialized from ``seed``.

    Raises:
        ValueError: the weights miss parameters of the model or have other shapes.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    options: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        if info.has_weights:
            model, loading = AutoModelForCausalLM.from_pretrained(
                info.path,
                local_files_only=True,
                trust_remote_code=False,
                use_safetensors=True,
                output_loading_info=True,
                **options,
            )
            problems = [
                f"{what}: {', '.join(sorted(map(str, names))[:5])}"
                for what, names in (
                    ("missing", loading.get("missing_keys", ())),
                    ("with other shapes", loading.get("mismatched_keys", ())),
                )
                if names
            ]
            if problems:
                raise ValueError(
                    f"--model {info.path}: its safetensors weights do not fit its config "
                    f"({'; '.join(problems)}). Save the model again with save_pretrained, or "
                    "remove the weights to train from the config alone"
                )
        else:
            config = _load_config(info.path)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(config, **options)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.use_cache = False
    return model.to(dtype=dtype)


_CONTAINER_NAMES = ("layers", "h", "blocks")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model, in order (see the module docstring)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in classes and m is not model]
    if found:
        return found
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in _CONTAINER_NAMES:
            return list(module)
    return []


def meta_hf_model(info: HFModelInfo, *, dtype: torch.dtype) -> nn.Module:
    """The model of ``info`` on the meta device (no memory, no values), in ``dtype``: to
    dedicate and shard before `materialize_hf`."""
    from transformers import AutoModelForCausalLM

    config = _load_config(info.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    return model.to(dtype=dtype)


def non_persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s buffers that its state dict leaves out (rotary frequencies), in
    ``named_buffers`` order."""
    owners = dict(module.named_modules())
    found = []
    for name, buffer in module.named_buffers():
        prefix, _, attr = name.rpartition(".")
        if attr in owners[prefix]._non_persistent_buffers_set:
            found.append((name, buffer))
    return found


def materialize_hf(module: nn.Module, whole: nn.Module | None, device: torch.device) -> None:
    """Give a `meta_hf_model` (dedicated and sharded) memory on ``device`` and the weights
    of ``whole``, the model `build_hf_model` built on rank 0 (``None`` on every other
    rank). Call on every rank.

    The state dict goes through ``dmuon.set_model_state_dict(..., full_state_dict=True,
    broadcast_from_rank0=True)``, which sends each tensor from rank 0 to the ranks that
    keep a part of it; the buffers a state dict leaves out are broadcast from rank 0.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import dmuon

    module.to_empty(device=device)
    full = whole.state_dict() if whole is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dmuon.set_model_state_dict(module, full, options=options)
    del full
    given = dict(non_persistent_buffers(whole)) if whole is not None else {}
    for name, buffer in non_persistent_buffers(module):
        if whole is not None:
            buffer.copy_(given[name])
        # not audited: a buffer the state dict leaves out (rotary tables), once at load
        dist.broadcast(buffer, src=0)
