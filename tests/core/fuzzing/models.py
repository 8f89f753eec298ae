"""The generated models: small Llama-like and GPT-2-like decoders built from a `ModelSpec`.

Every layer has causal attention (``nn.Linear`` projections in the Llama family, fused
``Conv1D`` ``c_attn`` / ``c_proj`` in the GPT-2 family) and one of three MLPs:

- ``dense``: SwiGLU (Llama) or GELU (GPT-2) with the family's linear layers;
- ``experts``: a mixture of separate experts, each two linear layers, routed by token id
  through a fixed table; experts outside the table never see a token (idle everywhere),
  and any expert may see none on some rank;
- ``fused``: the same routing into a fused experts module holding 3-D ``gate_up_proj``
  ``(experts, 2 * hidden, dim)`` and ``down_proj`` ``(experts, dim, hidden)`` stacks, as
  transformers' Mixtral stores them, mixed by a learned router (``gate``) that stays with
  AdamW.

Routing by token id (not by the router's top-k) keeps the choice of experts identical in
the distributed run and the one-process oracle whatever rounding does to the router.

`muon_matrices` says, independently of DMuon's predicate, which parameters are the Muon
matrices and their ``(out, in)`` shape: what the oracle trains with Muon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its MLP kind and sizes."""

    mlp: str = "dense"
    hidden: int = 8
    experts: int = 0
    top_k: int = 1
    #: Experts no token is ever routed to (the last ``idle`` ones).
    idle: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """A generated decoder: family, sizes, layers, tying."""

    family: str = "llama"
    vocab: int = 16
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 4
    layers: tuple[LayerSpec, ...] = (LayerSpec(),)
    tied: bool = False
    attn_bias: bool = False

    @property
    def dim(self) -> int:
        """The model width."""
        return self.heads * self.head_dim

    @property
    def container(self) -> str:
        """The name of the layers' ``ModuleList`` (a DMuon hook-boundary container)."""
        return "layers" if self.family == "llama" else "h"


MAX_POSITIONS = 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal attention; head counts follow the (possibly tensor-parallel local) widths."""
    b, t, _ = q.shape
    q = q.reshape(b, t, -1, head_dim).transpose(1, 2)
    k = k.reshape(b, t, -1, head_dim).transpose(1, 2)
    v = v.reshape(b, t, -1, head_dim).transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(b, t, -1)


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        dim, kv = spec.dim, spec.kv_heads * spec.head_dim
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(dim, dim, bias=spec.attn_bias)
        # No key bias: softmax is shift-invariant, so its gradient is rounding noise, which
        # AdamW would turn into full-size steps that no two summation orders agree on.
        self.k_proj = nn.Linear(dim, kv, bias=False)
        self.v_proj = nn.Linear(dim, kv, bias=spec.attn_bias)
        self.o_proj = nn.Linear(dim, dim, bias=spec.attn_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.head_dim)
        return self.o_proj(y)


class GPT2Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.c_attn = Conv1D(3 * spec.dim, spec.dim)
        # Its key third has no gradient (see LlamaAttention): frozen, as if it had none.
        self.c_attn.bias.requires_grad_(False)
        self.c_proj = Conv1D(spec.dim, spec.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(_attend(q, k, v, self.head_dim).contiguous())


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GPT2MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, biases: bool = True) -> None:
        super().__init__()
        self.c_fc = Conv1D(hidden, dim)
        self.c_proj = Conv1D(dim, hidden)
        if not biases:
            # An expert's biases would be FSDP2's and DDP's parameters that idle ranks do
            # not use (they need set_reduce_scatter_unused_params / find_unused_parameters,
            # which turn a missing gradient into zeros that AdamW steps on); DMuon's part,
            # the matrices, is what the experts are here for.
            self.c_fc.bias.requires_grad_(False)
            self.c_proj.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


def routing_table(vocab: int, layer: LayerSpec, seed: int) -> torch.Tensor:
    """``(vocab, top_k)`` expert indices per token id, among the non-idle experts."""
    active = layer.experts - layer.idle
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(vocab, active, generator=gen)
    return scores.topk(min(layer.top_k, active), dim=-1).indices


class RoutedExperts(nn.Module):
    """Separate experts (two linear layers each), mixed with equal weights."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, table: torch.Tensor) -> None:
        super().__init__()
        dim, hidden = spec.dim, layer.hidden
        self.register_buffer("table", table, persistent=False)
        self.experts = nn.ModuleList(
            GPT2MLP(dim, hidden, biases=False) if spec.family == "gpt2" else SwiGLU(dim, hidden)
            for _ in range(layer.experts)
        )

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        chosen = self.table[tokens]  # (b, t, k)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            mask = (chosen == index).any(-1)
            if mask.any():  # data-dependent: an idle expert is not in the graph
                out = out.index_put((mask,), expert(x[mask]))
        return out / chosen.shape[-1]


class FusedExperts(nn.Module):
    """Expert stacks stored as transformers' Mixtral stores them (``(out, in)`` per expert)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * hidden, dim) / dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for index in range(self.gate_up_proj.shape[0]):
            rows, slot = torch.where(chosen == index)
            if rows.numel() == 0:
                continue
            gate, up = F.linear(x[rows], self.gate_up_proj[index]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[index])
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        return out


class FusedMoE(nn.Module):
    """A router (``gate``, AdamW) and a fused experts module (``experts``, Muon stacks)."""

    def __init__(self, spec: ModelSpec, layer: LayerSpec, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table, persistent=False)
        self.gate = nn.Linear(spec.dim, layer.experts, bias=False)
        self.experts = FusedExperts(spec.dim, layer.hidden, layer.experts)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen = self.table[tokens].reshape(flat.shape[0], -1)
        weights = self.gate(flat).softmax(-1).gather(-1, chosen)
        return self.experts(flat, chosen, weights).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: LayerSpec, table: torch.Tensor | None) -> None:
        super().__init__()
        llama = spec.family == "llama"
        norm = RMSNorm if llama else nn.LayerNorm
        self.attn_norm = norm(spec.dim)
        self.attn = LlamaAttention(spec) if llama else GPT2Attention(spec)
        self.mlp_norm = norm(spec.dim)
        self.routed = layer.mlp != "dense"
        if layer.mlp == "dense":
            self.mlp: nn.Module = (
                SwiGLU(spec.dim, layer.hidden) if llama else GPT2MLP(spec.dim, layer.hidden)
            )
        elif layer.mlp == "experts":
            assert table is not None
            self.mlp = RoutedExperts(spec, layer, table)
        else:
            assert table is not None
            self.mlp = FusedMoE(spec, layer, table)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + (self.mlp(h, tokens) if self.routed else self.mlp(h))


class Decoder(nn.Module):
    """Embedding (and GPT-2's positions), the layers, a final norm, the output head."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.spec = spec
        llama = spec.family == "llama"
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        if not llama:
            self.wpe = nn.Embedding(MAX_POSITIONS, spec.dim)
        tables = [
            routing_table(spec.vocab, layer, seed + 1 + i) if layer.mlp != "dense" else None
            for i, layer in enumerate(spec.layers)
        ]
        pairs = zip(spec.layers, tables, strict=True)
        blocks = nn.ModuleList(Block(spec, layer, table) for layer, table in pairs)
        setattr(self, spec.container, blocks)
        self.norm = RMSNorm(spec.dim) if llama else nn.LayerNorm(spec.dim)
        self.lm_head = nn.Linear(spec.dim, spec.vocab, bias=False)
        if spec.tied:
            self.lm_head.weight = self.embed.weight

    @property
    def blocks(self) -> nn.ModuleList:
        """The decoder layers (``layers`` or ``h``)."""
        return getattr(self, self.spec.container)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.spec.family == "gpt2":
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x, tokens)
        return self.lm_head(self.norm(x))


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``tokens`` (rows of ``SEQ + 1`` ids)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def muon_matrices(model: Decoder) -> dict[str, tuple[int, int]]:
    """``{name: (out, in)}`` of the Muon matrices, written out from the model's structure.

    The weights of the linear layers (``nn.Linear``, ``Conv1D``) inside the decoder layers
    and the fused expert stacks (per expert); never the router, the embeddings, the norms
    or the head. Independent of DMuon's predicate: the oracle trains these with Muon.
    """
    found: dict[str, tuple[int, int]] = {}
    prefix = model.spec.container + "."
    for name, module in model.named_modules():
        if not name.startswith(prefix):
            continue
        if isinstance(module, FusedMoE):
            continue  # its router stays with AdamW; its experts are visited below
        if isinstance(module, FusedExperts):
            for attr in ("gate_up_proj", "down_proj"):
                shape = getattr(module, attr).shape
                found[f"{name}.{attr}"] = (int(shape[1]), int(shape[2]))
        elif isinstance(module, nn.Linear) and not name.endswith(".gate"):
            found[f"{name}.weight"] = tuple(module.weight.shape)  # type: ignore[assignment]
        elif isinstance(module, Conv1D):
            rows, cols = module.weight.shape  # stored (in, out)
            found[f"{name}.weight"] = (int(cols), int(rows))
    return found


def tp_plan(model: Decoder) -> dict[str, object]:
    """torch's tensor-parallel plan for the Llama family's attention and dense MLPs.

    ``ColwiseParallel`` on the q, k, v, gate and up projections, ``RowwiseParallel`` on o
    and down. GPT-2's ``Conv1D`` and the experts are left whole (replicated over tp).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    if model.spec.family != "llama":
        return plan
    for i, layer in enumerate(model.spec.layers):
        base = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{base}.attn.{name}"] = ColwiseParallel()
        plan[f"{base}.attn.o_proj"] = RowwiseParallel()
        if layer.mlp == "dense":
            plan[f"{base}.mlp.gate_proj"] = ColwiseParallel()
            plan[f"{base}.mlp.up_proj"] = ColwiseParallel()
            plan[f"{base}.mlp.down_proj"] = RowwiseParallel()
    return plan
