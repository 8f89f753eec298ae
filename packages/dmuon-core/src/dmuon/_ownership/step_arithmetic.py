"""The elementwise arithmetic of applying a step to a master, in one place.

The rank that steps a matrix and every other replica's owner (HSDP) apply the step through
these functions, with the same scalars in the same dtype, so their bits cannot differ on
any device. Each scalar is a one-element 1-D tensor (or a tensor of one value per row) in
`header_dtype`: a 16-bit master's product is then computed in float32 and rounded once,
on CPU and CUDA alike. A 0-dim tensor would not do: CUDA's kernels (and its foreach path)
round a 0-dim float32 factor to a bfloat16 operand's dtype first (0.998 becomes
0.99609375), while CPU's read it whole.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def header_dtype(master_dtype: torch.dtype) -> torch.dtype:
    """The dtype the step's scalars are kept and applied in: float32 (float64 for float64
    weights)."""
    return torch.promote_types(master_dtype, torch.float32)


def step_scalar(value: float, master_dtype: torch.dtype, device: torch.device) -> Tensor:
    """``value`` as the factor `decay_masters_` and `scale_update_` take: a one-element
    1-D tensor of `header_dtype` on ``device``, filled there (on CUDA a fill kernel, not a
    copy from the host that would wait for the stream)."""
    return torch.full((1,), value, dtype=header_dtype(master_dtype), device=device)


def decay_masters_(masters: Iterable[Tensor], factor: Tensor) -> None:
    """Multiply each master by ``factor`` (a `step_scalar`) in place, rounded once."""
    for master in masters:
        master.mul_(factor)


def scale_update_(update: Tensor, multiplier: Tensor) -> Tensor:
    """Multiply ``update`` (in its master's dtype) in place by ``multiplier``: a
    `step_scalar`, or one value per output row shaped to broadcast; returns it."""
    return update.mul_(multiplier)


def add_updates_(masters: list[Tensor], updates: list[Tensor]) -> None:
    """Add each scaled update to its master in place (one rounding each)."""
    torch._foreach_add_(masters, updates)
