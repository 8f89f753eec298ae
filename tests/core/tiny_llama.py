"""A small Llama-style model for the distributed tests (independent of the recipe's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim // 2, bias=False)
        self.v_proj = nn.Linear(dim, dim // 2, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, hd = self.heads, d // self.heads
        q = self.q_proj(x).view(b, t, h, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, h // 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
        v = self.v_proj(x).view(b, t, h // 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, use_checkpoint: bool) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)
        self.use_checkpoint = use_checkpoint

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        if self.use_checkpoint:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)


@dataclass
class LMOutput:
    loss: torch.Tensor
    logits: torch.Tensor


class TinyLlama(nn.Module):
    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        heads: int = 4,
        hidden: int = 48,
        n_layers: int = 2,
        use_checkpoint: bool = False,
        dataclass_output: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Block(dim, heads, hidden, use_checkpoint) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.dataclass_output = dataclass_output

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | LMOutput:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return LMOutput(loss, logits) if self.dataclass_output else loss
