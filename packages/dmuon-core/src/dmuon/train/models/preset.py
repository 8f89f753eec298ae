"""A small decoder-only transformer with Llama naming, used by the reference recipe.

Parameter names follow Llama (Hugging Face style), because ``dmuon.dedicate_params``'
default predicate and hook boundaries rely on them:

```text
embed.weight                               nn.Embedding  (AdamW)
layers.N.attn_norm.weight                  RMSNorm       (AdamW)
layers.N.attn.{q,k,v,o}_proj.weight        nn.Linear     (Muon, dedicated)
layers.N.mlp_norm.weight                   RMSNorm       (AdamW)
layers.N.mlp.{gate,up,down}_proj.weight    nn.Linear     (Muon, dedicated)
norm.weight                                RMSNorm       (AdamW)
lm_head.weight                             nn.Linear     (AdamW, untied from embed)
```

Blocks are pre-norm with rotary position embeddings (RoPE) on queries and keys, causal
scaled-dot-product attention, a SwiGLU MLP, no biases and no dropout. The vocabulary is
256 (raw bytes).

A config with ``n_experts > 0`` (the ``moe`` preset) replaces every dense MLP by a
mixture of experts, laid out as transformers lays out Mixtral's, so that the default
predicate of ``dmuon.dedicate_params`` selects the expert stacks and leaves the router
to AdamW:

```text
layers.N.mlp.gate.weight                   nn.Linear     (AdamW: the router, experts x dim)
layers.N.mlp.experts.gate_up_proj          3-D stack     (Muon, dedicated: experts x 2ffn x dim)
layers.N.mlp.experts.down_proj             3-D stack     (Muon, dedicated: experts x dim x ffn)
```

Each token goes to the ``top_k`` experts of highest router probability, weighted by
those probabilities renormalized to sum to one; there is no auxiliary load-balancing loss.

Presets (``PRESETS``; parameter counts for vocabulary 256, all parameters included;
``ffn`` is the width of one expert in ``moe``):

| preset | layers | dim | heads | ffn  | experts  | parameters              |
|--------|--------|-----|-------|------|----------|-------------------------|
| tiny   | 2      | 64  | 4     | 192  | -        | 0.14 M  (139,584)       |
| small  | 4      | 256 | 4     | 768  | -        | 3.54 M  (3,541,248)     |
| base   | 8      | 512 | 8     | 1536 | -        | 27.5 M  (27,533,824)    |
| moe    | 2      | 64  | 4     | 128  | 4, top 2 | 0.26 M  (262,976)       |

(``tests/core/test_model.py`` checks the table against ``ModelConfig.num_params``.)

Every preset maps exactly onto a Hugging Face architecture, which is what ``--export-hf``
writes: the dense presets onto ``LlamaForCausalLM`` (same rotary convention, RMSNorm,
SwiGLU, no biases, untied head) and ``moe`` onto ``MixtralForCausalLM`` (softmax router,
top-k renormalized, fused ``gate_up_proj``/``down_proj`` stacks). `hf_config` gives the
config and `hf_key_map` the parameter names.

Initialization is a pure function of the seed: the model is built on the meta device and
then filled from a private ``torch.Generator``, so every rank that builds it with the same
seed holds bit-identical weights before sharding, and the global RNG is left untouched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import dmuon_recipe_contract as contract
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmuon.optim import record_attention_logits

__all__ = [
    "MLP",
    "PRESETS",
    "Attention",
    "Block",
    "Experts",
    "MoE",
    "ModelConfig",
    "Transformer",
    "build_model",
    "hf_config",
    "hf_key_map",
    "lm_loss",
]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a `Transformer`.

    Attributes:
        n_layers: number of transformer blocks (``layers.0`` .. ``layers.{n-1}``).
        dim: residual stream width.
        n_heads: attention heads; ``dim`` must be divisible by it and the head dimension
            must be even (rotary embeddings rotate pairs).
        ffn_dim: hidden width of the SwiGLU MLP.
        vocab_size: 256 for raw bytes.
        max_seq_len: longest sequence the rotary tables cover.
        rope_theta: rotary base frequency.
        norm_eps: RMSNorm epsilon.
        n_experts: 0 for a dense SwiGLU MLP; otherwise the number of experts of the
            mixture-of-experts MLP of every block (``ffn_dim`` is then one expert's width).
        top_k: experts per token (mixture of experts only); at most ``n_experts``.
    """

    n_layers: int
    dim: int
    n_heads: int
    ffn_dim: int
    vocab_size: int = 256
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    n_experts: int = 0
    top_k: int = 2

    def __post_init__(self) -> None:
        for name in ("n_layers", "dim", "n_heads", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_experts < 0:
            raise ValueError(f"ModelConfig.n_experts must be >= 0, got {self.n_experts}")
        if self.n_experts > 0 and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"ModelConfig.top_k must be between 1 and n_experts ({self.n_experts}), "
                f"got {self.top_k}"
            )
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head dimension dim/n_heads = {self.head_dim} must be even for rotary "
                "embeddings; choose another n_heads"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def num_params(self) -> int:
        """Total parameter count (embedding, blocks, final norm, untied head)."""
        mlp = 3 * self.dim * self.ffn_dim
        if self.n_experts > 0:  # the experts and the router
            mlp = self.n_experts * (mlp + self.dim)
        per_layer = 4 * self.dim * self.dim + mlp + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim


PRESETS: dict[str, ModelConfig] = {
    name: ModelConfig(
        n_layers=shape.n_layers,
        dim=shape.dim,
        n_heads=shape.n_heads,
        ffn_dim=shape.ffn_dim,
        vocab_size=shape.vocab_size,
        max_seq_len=shape.max_seq_len,
        n_experts=shape.n_experts,
        top_k=shape.top_k,
    )
    for name, shape in contract.PRESETS.items()
}
"""Named model sizes for ``--model`` (from `dmuon_recipe_contract.PRESETS`); see the module
docstring for the table."""


def _rope_tables(config: ModelConfig, device: torch.device) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables of shape ``(max_seq_len, head_dim // 2)``."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(half, dtype=torch.float64, device=device) / half)
    )
    pos = torch.arange(config.max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)
    return angles.cos().float(), angles.sin().float()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs ``(x[..., :h], x[..., h:])`` of ``x`` (B, H, T, D) by position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings (``q/k/v/o_proj``)."""

    def __init__(self, config: ModelConfig) -> None:
        """Create the four projections, without bias."""
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attend causally over ``x`` of shape (batch, seq, dim)."""
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        record_attention_logits(self, q, k)  # for dmuon.Muon(qk_clip=...); else nothing
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        """Create the three projections, without bias."""
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gated MLP to ``x`` of shape (..., dim)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """The experts of a mixture-of-experts MLP, as two fused 3-D stacks.

    ``gate_up_proj`` (experts, 2 * ffn, dim) holds every expert's gate and up projections
    concatenated along the output dimension, ``down_proj`` (experts, dim, ffn) its down
    projection; each expert's matrix is stored ``(out, in)``, as ``nn.Linear`` stores it.
    This is transformers' layout for Mixtral and Qwen2/3-MoE experts.
    """

    def __init__(self, config: ModelConfig) -> None:
        """Create the two stacks (uninitialized; `Transformer.init_weights` fills them)."""
        super().__init__()
        experts, dim, ffn = config.n_experts, config.dim, config.ffn_dim
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ffn, dim))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, ffn))

    def forward(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """Mix the chosen experts' SwiGLU outputs for the tokens ``x`` (tokens, dim).

        ``chosen`` (tokens, k) holds expert indices and ``weights`` (tokens, k) their
        mixing weights. An expert that no token chose is skipped; its slice of the
        stacks then gets a zero gradient.
        """
        out = torch.zeros_like(x)
        for expert in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(chosen == expert)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out


class MoE(nn.Module):
    """Mixture-of-experts MLP: a router (``gate``) picks ``top_k`` experts per token."""

    def __init__(self, config: ModelConfig) -> None:
        """Create the router and the expert stacks."""
        super().__init__()
        self.top_k = config.top_k
        self.gate = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: Tensor) -> Tensor:
        """Route every token of ``x`` (..., dim) to its experts and mix their outputs."""
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(flat.dtype)
        return self.experts(flat, chosen, weights).view_as(x)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(attn_norm(x))``, then ``+ mlp(mlp_norm(.))``."""

    def __init__(self, config: ModelConfig) -> None:
        """Create the two norms, the attention and the MLP."""
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp: nn.Module = MoE(config) if config.n_experts > 0 else MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Run one block on ``x`` of shape (batch, seq, dim)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only byte-level language model; ``forward`` maps tokens to logits.

    Build it with `build_model`, which also initializes the weights. Constructing
    the class directly leaves weights as ``nn.Linear``'s default initialization would
    (or uninitialized on the meta device); call `init_weights` afterwards.
    """

    def __init__(self, config: ModelConfig) -> None:
        """Create the embedding, ``config.n_layers`` blocks, final norm and head."""
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rope_tables(config, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter and buffer deterministically from ``seed``.

        Linear and embedding weights, routers and ``gate_up_proj`` stacks are normal with
        std 0.02; the residual output projections (``o_proj``, ``down_proj``, a
        ``down_proj`` stack too) use ``0.02 / sqrt(2 * n_layers)``; norm weights are one.
        Uses a private generator on the CPU (then copies), so the result does not depend
        on the device or on the global RNG state.
        """
        params = dict(self.named_parameters())
        for name, values in initial_values(self.config, seed):
            params[name].copy_(values.to(dtype=params[name].dtype))
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Fill the rotary tables (buffers no state dict holds)."""
        cos, sin = _rope_tables(self.config, torch.device("cpu"))
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens: Tensor) -> Tensor:
        """Return logits of shape (batch, seq, vocab) for ``tokens`` of shape (batch, seq)."""
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's max_seq_len "
                f"{self.config.max_seq_len}; build the model with a larger max_seq_len"
            )
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def lm_loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Next-token cross-entropy between ``logits`` (B, T, V) and ``targets`` (B, T).

    Half-precision logits are upcast to float32 first; float32/float64 are kept.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction
    )


def initial_values(config: ModelConfig, seed: int) -> Iterator[tuple[str, Tensor]]:
    """Each parameter's initial values (float32, on the CPU), in parameter order, one at
    a time: what `Transformer.init_weights` writes (see there), drawn from one generator
    so that a model initialised piece by piece (sharded on the meta device, say) gets the
    same weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out_std = 0.02 / math.sqrt(2 * config.n_layers)
    with torch.device("meta"):
        shapes = [(name, p.shape) for name, p in Transformer(config).named_parameters()]
    for name, shape in shapes:
        if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            yield name, torch.randn(shape, generator=gen) * out_std
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape)
        else:
            yield name, torch.randn(shape, generator=gen) * 0.02


def build_model(
    preset: str | ModelConfig = "small",
    *,
    seed: int = 0,
    max_seq_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """Build and deterministically initialize a `Transformer`.

    Args:
        preset: a name in `PRESETS` (``tiny``, ``small``, ``base``, ``moe``) or a config.
        seed: initialization seed; equal seeds give bit-identical weights on any rank.
        max_seq_len: override the preset's rotary table length (must cover ``--seq-len``).
        device: where the parameters live.
        dtype: parameter dtype; the initial values are drawn in float32 either way, so
            a float64 model starts from exactly the float32 model's weights.

    Raises:
        ValueError: for an unknown preset name.
    """
    model = meta_model(preset, max_seq_len=max_seq_len)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.to(dtype=dtype)


def meta_model(
    preset: str | ModelConfig = "small",
    *,
    max_seq_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A `Transformer` on the meta device (no memory): to dedicate and shard before
    giving it memory (``to_empty``) and weights (`init_sharded`, or `init_weights`).

    Raises:
        ValueError: for an unknown preset name.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        config = PRESETS[preset]
    else:
        config = preset
    if max_seq_len is not None:
        config = replace(config, max_seq_len=max_seq_len)
    with torch.device("meta"):
        return Transformer(config).to(dtype=dtype)


@torch.no_grad()
def init_sharded(model: Transformer, seed: int) -> None:
    """Give a model that was dedicated and sharded on the meta device, then given memory
    (``to_empty``), the weights `build_model` gives for ``seed``, bit for bit.

    The values are made one decoder layer at a time (the embedding and head alone) and
    loaded with `dmuon.set_model_state_dict` as a full state dict: each rank keeps its
    shards and owned matrices, and never holds more than one layer whole besides them.
    Call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from dmuon.checkpoint import set_model_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False)
    dtype = next(model.parameters()).dtype

    def load(part: dict[str, Tensor]) -> None:
        if part:
            set_model_state_dict(model, part, options=options)

    part: dict[str, Tensor] = {}
    unit = None
    for name, values in initial_values(model.config, seed):
        here = ".".join(name.split(".")[:2]) if name.startswith("layers.") else name
        if here != unit:
            load(part)
            part, unit = {}, here
        part[name] = values.to(dtype=dtype)
    load(part)
    model.init_buffers()


def hf_config(config: ModelConfig) -> dict[str, object]:
    """The Hugging Face ``config.json`` of the architecture a preset maps onto exactly.

    Dense presets are ``LlamaForCausalLM``; a mixture of experts is ``MixtralForCausalLM``
    (no sliding window, no router jitter). Together with `hf_key_map` it lets
    ``transformers`` load a preset's weights and compute the same logits.
    """
    common: dict[str, object] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if config.n_experts == 0:
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common,
                "mlp_bias": False}  # fmt: skip
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        **common,
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
    }


def hf_key_map(config: ModelConfig) -> dict[str, str]:
    """``{preset parameter name: Hugging Face name}`` for every parameter of a preset."""
    keys = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}  # fmt: skip
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        keys[ours + "attn_norm.weight"] = theirs + "input_layernorm.weight"
        keys[ours + "mlp_norm.weight"] = theirs + "post_attention_layernorm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            keys[f"{ours}attn.{proj}.weight"] = f"{theirs}self_attn.{proj}.weight"
        if config.n_experts == 0:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                keys[f"{ours}mlp.{proj}.weight"] = f"{theirs}mlp.{proj}.weight"
        else:
            keys[ours + "mlp.gate.weight"] = theirs + "mlp.gate.weight"
            for stack in ("gate_up_proj", "down_proj"):
                keys[f"{ours}mlp.experts.{stack}"] = f"{theirs}mlp.experts.{stack}"
    return keys
