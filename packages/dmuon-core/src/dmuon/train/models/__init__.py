"""Model builders of the recipe: byte-level presets and Hugging Face model directories.

`resolve_model` checks ``--model`` (and ``--seq-len`` against it) before anything is
built; `build` builds it as a `BuiltModel`: the module, its decoder layers (the units of
FSDP2, activation checkpointing and compile), how to get logits from tokens, and what an
HF export needs. The loop and `dmuon.train.parallelize` see nothing else of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dmuon_recipe_contract as contract
import torch
from torch import Tensor, nn

from dmuon.train.models.hf import (
    HFModelInfo,
    build_hf_model,
    decoder_layers,
    inspect_model_dir,
    materialize_hf,
    meta_hf_model,
)
from dmuon.train.models.preset import (
    PRESETS,
    ModelConfig,
    Transformer,
    build_model,
    hf_config,
    hf_key_map,
    init_sharded,
    lm_loss,
    meta_model,
)

__all__ = [
    "PRESETS",
    "BuiltModel",
    "ModelConfig",
    "ModelSource",
    "Transformer",
    "build",
    "build_model",
    "lm_loss",
    "resolve_model",
]


@dataclass(frozen=True)
class ModelSource:
    """``--model`` checked: a preset or a model directory, with its vocabulary and limits.

    Attributes:
        name: the preset name, or the resolved directory.
        vocab_size: rows of the input embedding; token ids must stay below it.
        max_positions: the longest sequence the model takes (None: no limit known).
        hf: the directory's `HFModelInfo` (None for a preset).
    """

    name: str
    vocab_size: int
    max_positions: int | None
    hf: HFModelInfo | None = None

    @property
    def is_preset(self) -> bool:
        """Whether this is a byte-level preset."""
        return self.hf is None


def resolve_model(model: str, seq_len: int) -> ModelSource:
    """Check ``--model`` and ``--seq-len`` without building anything.

    Raises:
        ValueError: not a preset nor a usable model directory (see `inspect_model_dir`).
    """
    if model in contract.PRESETS:
        return ModelSource(model, contract.PRESETS[model].vocab_size, None)
    info = inspect_model_dir(model, seq_len)
    return ModelSource(str(info.path), info.vocab_size, info.max_positions, info)


@dataclass
class BuiltModel:
    """A built model and what the recipe needs to train and export it.

    Attributes:
        module: the ``nn.Module`` (a `Transformer` or a transformers ``*ForCausalLM``).
        layers: its decoder layers, in order.
        source: the `ModelSource` it was built from.
        hf_config: the ``config.json`` an HF export writes (for a preset, of the
            architecture it maps onto).
        hf_keys: ``{parameter name: HF name}`` where the names differ (presets), else
            empty.
        matmul_params: the weights a token's matrix products use (`flops_per_token`).
    """

    module: nn.Module
    layers: list[nn.Module]
    source: ModelSource
    hf_config: dict[str, Any]
    hf_keys: dict[str, str] = field(default_factory=dict)
    matmul_params: float = 0.0
    #: Built on the meta device: `materialize` after dedicating and sharding it.
    on_meta: bool = False
    #: A Hugging Face model built on the meta device: on rank 0, the model built whole
    #: whose weights `materialize` loads (None elsewhere).
    rank0_whole: nn.Module | None = None

    def materialize(self, device: torch.device, seed: int) -> None:
        """Give a model built on the meta device (and dedicated, sharded) memory on
        ``device`` and its weights (call on every rank): a preset's seed's weights one
        layer at a time; a Hugging Face model's from rank 0, which built it whole."""
        if not self.on_meta:
            return
        if self.source.is_preset:
            self.module.to_empty(device=device)
            init_sharded(self.module, seed)  # type: ignore[arg-type]
        else:
            materialize_hf(self.module, self.rank0_whole, device)
            self.rank0_whole = None
        self.on_meta = False

    def logits(self, tokens: Tensor) -> Tensor:
        """Logits (batch, seq, vocab) of token ids (batch, seq)."""
        if self.source.is_preset:
            return self.module(tokens)
        return self.module(input_ids=tokens, use_cache=False).logits

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: ``6 N + 12 L d T`` (forward and backward).

        ``N`` = `matmul_params`; ``12 L d T`` counts the attention score and value
        products of ``L`` layers of width ``d`` over ``T`` positions.
        """
        cfg = self.hf_config
        layers = int(cfg.get("num_hidden_layers") or cfg.get("n_layer") or len(self.layers))
        width = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
        return 6.0 * self.matmul_params + 12.0 * layers * width * seq_len


def _matmul_params(module: nn.Module, hf_config: dict[str, Any]) -> float:
    """Weights of the matrix products one token goes through (call before sharding).

    Every parameter of two or more dimensions except the input embedding; the output head
    counts, tied to the embedding or not; an expert stack counts the share of its experts
    a token is routed to (``num_experts_per_tok`` of them).
    """
    embed = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    embed_weight = getattr(embed if embed is not None else getattr(module, "embed", None),
                           "weight", None)  # fmt: skip
    top_k = hf_config.get("num_experts_per_tok")
    total = 0.0
    for param in module.parameters():
        if param.ndim < 2 or param is embed_weight:
            continue
        share = min(1.0, top_k / param.shape[0]) if param.ndim == 3 and top_k else 1.0
        total += param.numel() * share
    head = getattr(module, "lm_head", None)
    if head is not None and embed_weight is not None and head.weight is embed_weight:
        total += embed_weight.numel()
    return total


def build(source: ModelSource, *, seed: int, seq_len: int, device: torch.device,
          dtype: torch.dtype, meta: bool = False) -> BuiltModel:  # fmt: skip
    """Build ``source`` on ``device`` in ``dtype``: identical on every rank for one seed.

    With ``meta`` (under a process group) the model is built on the meta device instead
    (``on_meta``): dedicate and shard it, then `BuiltModel.materialize` gives it memory
    and the same weights. A preset's come from its seed layer by layer; a Hugging Face
    model is built whole on rank 0 alone (from its weights or its seed), which sends
    every other rank its part.
    """
    if source.hf is None:
        if meta:
            module = meta_model(source.name, max_seq_len=seq_len, dtype=dtype)
        else:
            module = build_model(source.name, seed=seed, max_seq_len=seq_len, device=device,
                                 dtype=dtype)  # fmt: skip
        config = module.config
        preset_config = hf_config(config)
        preset_config["max_position_embeddings"] = max(
            seq_len, contract.PRESETS[source.name].max_seq_len
        )
        return BuiltModel(
            module,
            list(module.layers),
            source,
            preset_config,
            hf_key_map(config),
            _matmul_params(module, preset_config),
            on_meta=meta,
        )
    whole = None
    if meta:
        if torch.distributed.get_rank() == 0:
            whole = build_hf_model(source.hf, seed=seed, dtype=dtype)
        module = meta_hf_model(source.hf, dtype=dtype)
    else:
        module = build_hf_model(source.hf, seed=seed, dtype=dtype).to(device)
    layers = decoder_layers(module)
    if not layers:
        raise ValueError(
            f"--model {source.name}: found no decoder layers in {type(module).__name__} "
            "(neither its _no_split_modules classes nor a layers/h/blocks module list)"
        )
    hf = module.config.to_dict()
    return BuiltModel(
        module, layers, source, hf, {}, _matmul_params(module, hf), on_meta=meta, rank0_whole=whole
    )
