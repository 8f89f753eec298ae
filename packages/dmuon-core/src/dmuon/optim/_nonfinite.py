"""Which owned matrices a Muon step takes: none without a gradient anywhere, and none
with a NaN or infinite one (raised, or skipped and counted)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dmuon._comm import Communicator
from dmuon._ownership.gradients import is_absent
from dmuon._ownership.param import DedicatedParam
from dmuon.optim._tensor_parallel import agree


class NonFiniteGradientError(FloatingPointError):
    """A Muon gradient holds NaN or infinity, so the step would corrupt the weights."""


def finite_only(
    group: dict[str, Any],
    pairs: list[tuple[DedicatedParam, Tensor]],
    buffers: dict[tuple[int, torch.device], Tensor],
    comm: Communicator,
) -> tuple[list[tuple[DedicatedParam, Tensor]], int]:
    """Drop matrices no rank had a gradient for; apply ``nonfinite`` to the rest.

    ``buffers`` keeps the norm buffers between steps (one per count and device); ``comm``
    sums the norms of matrices split by tensor parallelism over their tp group. Returns
    the pairs to step and how many were skipped for a non-finite gradient.

    Raises:
        NonFiniteGradientError: A gradient holds NaN or infinity and ``nonfinite`` is
            ``"raise"``; nothing was changed.
    """
    if not pairs:
        return pairs, 0
    # Norms and first elements written into a kept buffer (one per count and device),
    # read with one sync: the hot path allocates nothing.
    device = pairs[0][1].device
    count = len(pairs)
    key = (count, device)
    if key not in buffers:
        buffers[key] = torch.empty(2 * count, dtype=torch.float32, device=device)
    kept = buffers[key]
    for i, (_, grad) in enumerate(pairs):
        torch.linalg.vector_norm(grad, dtype=torch.float32, out=kept[i])
        kept[count + i].copy_(grad.reshape(-1)[0])
    sharded = [i for i, (dp, _) in enumerate(pairs) if dp.tp_sharded]
    if sharded:  # whole matrices' norms, the same on every tp rank
        index = torch.tensor(sharded, device=device)
        norms, firsts = kept[index], kept[count + index]
        agree([pairs[i][0] for i in sharded], norms, firsts, comm)
        kept[index], kept[count + index] = norms, firsts
    values = kept.tolist()
    # A matrix no rank had a gradient for (an expert no token was routed to anywhere)
    # is left alone, as torch's optimizers leave a parameter whose .grad is None; a
    # gradient of zeros is a gradient, as in torch.
    kept_pairs = [
        not is_absent(first, norm)
        for norm, first in zip(values[:count], values[count:], strict=True)
    ]
    pairs = [pair for pair, keep in zip(pairs, kept_pairs, strict=True) if keep]
    norms = [norm for norm, keep in zip(values[:count], kept_pairs, strict=True) if keep]
    finite = [math.isfinite(norm) for norm in norms]
    if all(finite):
        return pairs, 0
    bad = [dp.fqn for (dp, _), ok in zip(pairs, finite, strict=True) if not ok]
    if group["nonfinite"] == "raise":
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise NonFiniteGradientError(
            f"the gradients of {bad[:5]}{more} hold NaN or infinity, so this "
            "step would turn their weights into NaN; nothing was changed. Lower the "
            "learning rate, clip gradients, or create dmuon.Muon(..., nonfinite='skip') to "
            "skip such updates."
        )
    return [pair for pair, ok in zip(pairs, finite, strict=True) if ok], len(bad)
