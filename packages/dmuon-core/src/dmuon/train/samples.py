"""Samples during training (``--sample-every``): what the model writes after a prompt.

Every rank runs the same forwards (FSDP2 and DMuon gather weights collectively), greedily:
the most likely next token each time, so the text is a pure function of the weights. The
prompt and the sample share one window of ``len(prompt) + tokens`` positions, filled from
the left; since attention is causal, the logits at a filled position do not depend on the
positions after it, so every forward has the same shape (one compiled graph under
``--compile``) whatever has been generated so far.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["greedy_continuation", "prompt_ids"]


def prompt_ids(ids: list[int], tokens: int, window: int) -> list[int]:
    """The prompt's last ids that leave room for ``tokens`` in a ``window`` (at least one)."""
    room = max(1, window - tokens)
    return ids[-room:] if ids else []


@torch.no_grad()
def greedy_continuation(
    logits_of: Callable[[Tensor], Tensor], prompt: list[int], tokens: int, device: torch.device
) -> list[int]:
    """The ``tokens`` ids that follow ``prompt``, each the argmax of the logits before it.

    Raises:
        ValueError: an empty prompt (the first token needs a position to follow).
    """
    if not prompt:
        raise ValueError("the sample prompt encodes to no token; give a non-empty --sample-prompt")
    window = torch.zeros(1, len(prompt) + tokens, dtype=torch.long, device=device)
    window[0, : len(prompt)] = torch.tensor(prompt, dtype=torch.long, device=device)
    for position in range(len(prompt), len(prompt) + tokens):
        logits = logits_of(window)
        window[0, position] = logits[0, position - 1].argmax()
    return window[0, len(prompt) :].tolist()
