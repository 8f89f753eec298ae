"""Which owned matrices a Muon step takes: none without a gradient anywhere, and none
with a NaN or infinite one (raised on every rank alike, or skipped and counted).

A non-finite gradient is seen by the rank that owns the matrix only. With
``nonfinite="raise"`` every rank must raise, or none: a rank that raised while the others
stepped would skip the step's collectives (the updates between replicas, the next
forward's gathers) and leave the others waiting. :func:`agree_on_nonfinite` settles it
with one all-reduce of one number per mesh dimension, before anything changes."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon._comm import Communicator
from dmuon._ownership.gradients import is_absent
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.runtime import DedicationRuntime
from dmuon.optim._muon_step import owned_gradients
from dmuon.optim._tensor_parallel import agree


class NonFiniteGradientError(FloatingPointError):
    """A Muon gradient holds NaN or infinity, so the step would corrupt the weights."""


def finite_only(
    pairs: list[tuple[DedicatedParam, Tensor]],
    buffers: dict[tuple[int, torch.device], Tensor],
    comm: Communicator,
) -> tuple[list[tuple[DedicatedParam, Tensor]], list[str]]:
    """Drop matrices no rank had a gradient for, and those whose gradient is not finite.

    ``buffers`` keeps the norm buffers between steps (one per count and device); ``comm``
    sums the norms of matrices split by tensor parallelism over their tp group (so every
    rank of a tp group finds the same ones). Returns the pairs to step and the names of
    the matrices left out for a NaN or infinite gradient (``nonfinite`` is applied by the
    caller, after :func:`agree_on_nonfinite`).
    """
    if not pairs:
        return pairs, []
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
        return pairs, []
    bad = [dp.fqn for (dp, _), ok in zip(pairs, finite, strict=True) if not ok]
    return [pair for pair, ok in zip(pairs, finite, strict=True) if ok], bad


def agree_on_nonfinite(bad: list[str], comm: Communicator, groups: list[dist.ProcessGroup]) -> None:
    """Raise on every rank of ``groups`` (whose product spans the ranks that step) when
    any of them found a non-finite gradient in a ``nonfinite="raise"`` group; ``bad`` is
    what this rank found. One all-reduce of one number per group, issued by every rank
    whatever its gradients hold.

    Raises:
        NonFiniteGradientError: some rank found one; nothing was changed on any rank.
    """
    anywhere = bool(bad)
    if groups:  # alone, this rank's own finding is everyone's: no tensor, no host sync
        found = torch.tensor([float(len(bad))], device=comm.device)
        for group in groups:
            comm.all_reduce_control(found, dist.ReduceOp.MAX, group)
        anywhere = anywhere or found.item() > 0
    if anywhere:
        if bad:
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            which = f"the gradients of {bad[:5]}{more} hold"
        else:
            which = "another rank found Muon gradients that hold"
        raise NonFiniteGradientError(
            f"{which} NaN or infinity, so this step would turn their weights into NaN; "
            "nothing was changed, on any rank. Lower the learning rate, clip gradients, or "
            "create dmuon.Muon(..., nonfinite='skip') to skip such updates."
        )


def muon_gradients(
    param_groups: list[dict[str, Any]],
    dedicated: dict[int, DedicatedParam],
    runtime: DedicationRuntime,
    buffers: dict[tuple[int, torch.device], Tensor],
    groups: list[dist.ProcessGroup],
) -> tuple[dict[int, list[tuple[DedicatedParam, Tensor]]], int]:
    """Each Muon group's owned matrices with a finite averaged gradient here, by group
    index, and how many were skipped (``nonfinite="skip"``).

    Where a group has ``nonfinite="raise"``, every rank of ``groups`` agrees first (see
    :func:`agree_on_nonfinite`), so that the error is raised on all of them or none.

    Raises:
        NonFiniteGradientError: some rank found a NaN or infinite gradient in a
            ``"raise"`` group; nothing was changed on any rank.
    """
    out: dict[int, list[tuple[DedicatedParam, Tensor]]] = {}
    to_raise: list[str] = []
    skipped = 0
    raising = False
    for i, group in enumerate(param_groups):
        if group["algorithm"] != "muon":
            continue
        pairs = owned_gradients(group["params"], dedicated, runtime)
        out[i], bad = finite_only(pairs, buffers, runtime.comm)
        if group["nonfinite"] == "raise":
            raising = True
            to_raise += bad
        else:
            skipped += len(bad)
    if raising:
        agree_on_nonfinite(to_raise, runtime.comm, groups)
    return out, skipped
