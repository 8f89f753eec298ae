"""The module tree of a standard decoder from its config fields alone, without transformers.

Planning Llama-3-70B needs only its parameters' names and shapes and where its layers
are, yet importing transformers' model code takes several seconds before any planning.
For the families whose layout is the plain Llama one (``llama``, ``mistral``, ``qwen2``,
``qwen3``), `decoder_meta_model` builds the same tree on the meta device from the
``config.json`` fields: the same parameter names, shapes, tied weights and ``ModuleList``
of layers as ``AutoModelForCausalLM.from_config`` (tests hold the two equal, family by
family). A config with a field this module does not know, or without a field it needs,
gets ``None`` and the caller builds the model through transformers instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Fields every supported config must give (their defaults differ between families).
REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)

#: Fields that change no parameter's name or shape in these families.
SHAPELESS_FIELDS = frozenset(
    {
        "_name_or_path", "architectures", "attention_dropout", "bos_token_id",
        "eos_token_id", "pad_token_id", "hidden_act", "initializer_range",
        "max_position_embeddings", "rms_norm_eps", "rope_scaling", "rope_theta",
        "rope_parameters", "torch_dtype", "dtype", "transformers_version", "use_cache",
        "pretraining_tp", "sliding_window", "use_sliding_window", "max_window_layers",
        "layer_types", "output_attentions", "output_hidden_states", "return_dict",
    }
)  # fmt: skip

_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
_QK_NORM_TP_PLAN = {
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}


@dataclass(frozen=True)
class _Family:
    """How one family turns its config into shapes. A bias is ``True``/``False`` where
    the family fixes it, or the name of the config flag that sets it (default off)."""

    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False
    #: ``head_dim`` when the config gives none; ``None``: hidden size / attention heads.
    head_dim: int | None = None
    tp_plan: Mapping[str, str] = field(default_factory=lambda: dict(_TP_PLAN))


FAMILIES: dict[str, _Family] = {
    "llama": _Family(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": _Family(),
    "qwen2": _Family(qkv_bias=True),
    "qwen3": _Family(
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        head_dim=128,
        tp_plan={**_TP_PLAN, **_QK_NORM_TP_PLAN},
    ),
}


@dataclass(frozen=True)
class DecoderConfig:
    """The fields of a decoder's config the planner reads, under transformers' names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    base_model_tp_plan: Mapping[str, str]


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def decoder_config(fields: Mapping[str, Any]) -> DecoderConfig | None:
    """The `DecoderConfig` of ``config.json``'s fields, or ``None`` where this module does
    not describe the model (another family, a field it does not know, one missing)."""
    family = FAMILIES.get(str(fields.get("model_type")))
    if family is None:
        return None
    flags = {f for f in (family.qkv_bias, family.o_bias, family.mlp_bias) if isinstance(f, str)}
    known = SHAPELESS_FIELDS | set(REQUIRED_FIELDS) | flags
    known |= {"model_type", "head_dim", "tie_word_embeddings"}
    if set(fields) - known:
        return None
    sizes = [fields.get(name) for name in REQUIRED_FIELDS]
    # A head_dim given as anything but a size is left to transformers too.
    given_head_dim = [fields["head_dim"]] if "head_dim" in fields else []
    if not all(_is_size(s) for s in sizes + given_head_dim):
        return None
    vocab, hidden, ffn, layers, heads, kv_heads = sizes
    head_dim = fields.get("head_dim") or family.head_dim or hidden // heads

    def bias(setting: bool | str) -> bool:
        return bool(fields.get(setting, False)) if isinstance(setting, str) else setting

    return DecoderConfig(
        model_type=str(fields["model_type"]),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        qkv_bias=bias(family.qkv_bias),
        o_bias=bias(family.o_bias),
        mlp_bias=bias(family.mlp_bias),
        qk_norm=family.qk_norm,
        base_model_tp_plan=dict(family.tp_plan),
    )


class _Norm(nn.Module):
    """An RMSNorm's parameter (its computation is not needed to plan)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))


class _Attention(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, heads, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(heads, hidden, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = _Norm(config.head_dim)
            self.k_norm = _Norm(config.head_dim)


class _MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hidden, ffn = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, ffn, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, ffn, bias=config.mlp_bias)
        self.down_proj = nn.Linear(ffn, hidden, bias=config.mlp_bias)


class _Layer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)
        self.input_layernorm = _Norm(config.hidden_size)
        self.post_attention_layernorm = _Norm(config.hidden_size)


class _Body(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        # A given weight skips Embedding's random init (on meta it loads torch's compiler).
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = _Norm(config.hidden_size)


class DecoderForPlanning(nn.Module):
    """A causal LM's parameters laid out as transformers lays them out; ``config`` is its
    `DecoderConfig`. It has no forward: it is only planned."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def decoder_meta_model(fields: Mapping[str, Any]) -> DecoderForPlanning | None:
    """The decoder of ``config.json``'s ``fields`` on the meta device, or ``None`` where
    `decoder_config` does not describe it."""
    config = decoder_config(fields)
    if config is None:
        return None
    with torch.device("meta"):
        return DecoderForPlanning(config)
