"""A tiny mixture-of-experts language model whose routing can leave experts idle.

Experts are separate ``nn.Linear`` modules (the layout DMuon's default predicate selects).
Routing is by token id (``token % n_experts``), so a test decides which experts see tokens
on which rank by choosing the tokens; an expert without tokens is skipped in forward and
gets no gradient on that rank, exactly what data-dependent routing does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class MoELayer(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(Expert(dim, hidden, bias) for _ in range(n_experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        mixed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if chosen.any():  # data-dependent: an idle expert is not in the graph
                mixed = mixed.index_put((chosen,), expert(h[chosen]))
        return x + mixed


class TinyMoE(nn.Module):
    """Embedding, MoE layers (one hidden size per layer), norm, output head.

    With ``expert_bias`` the experts have biases, which stay with FSDP2 and AdamW: FSDP2
    then needs ``set_reduce_scatter_unused_params(True)`` for experts idle on some ranks.
    """

    def __init__(
        self, vocab: int, dim: int, hiddens: list[int], n_experts: int, expert_bias: bool = False
    ) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            MoELayer(dim, hidden, n_experts, expert_bias) for hidden in hiddens
        )
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        route = tokens % self.n_experts
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, route=route)
        logits = self.lm_head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
