"""Which owned matrices a Muon step takes: none without a gradient anywhere, and none
with a NaN or infinite one (raised on every rank alike, or skipped and counted).

A non-finite gradient is seen by the rank that owns the matrix only. With
``nonfinite="raise"`` every rank must raise, or none: a rank that raised while the others
stepped would skip the step's collectives (the updates between replicas, the next
forward's gathers) and leave the others waiting. :func:`muon_gradients` settles it with
one all-reduce of one number per mesh dimension, before anything changes, read from the
device together with the gradients' norms."""

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


def _norms_and_firsts(
    pairs: list[tuple[DedicatedParam, Tensor]], kept: Tensor, comm: Communicator
) -> None:
    """Write each gradient's float32 norm into ``kept[:count]`` and its first element into
    ``kept[count:]``, on the device; the norms of matrices split by tensor parallelism are
    summed over their tp group (so every rank of a tp group finds the same ones)."""
    count = len(pairs)
    for i, (_, grad) in enumerate(pairs):
        if grad.device == kept.device:
            torch.linalg.vector_norm(grad, dtype=torch.float32, out=kept[i])
        else:
            kept[i].copy_(torch.linalg.vector_norm(grad, dtype=torch.float32))
        kept[count + i].copy_(grad.reshape(-1)[0])
    sharded = [i for i, (dp, _) in enumerate(pairs) if dp.tp_sharded]
    if sharded:  # whole matrices' norms, the same on every tp rank
        index = torch.tensor(sharded, device=kept.device)
        norms, firsts = kept[index], kept[count + index]
        agree([pairs[i][0] for i in sharded], norms, firsts, comm)
        kept[index], kept[count + index] = norms, firsts


def finite_only(
    pairs: list[tuple[DedicatedParam, Tensor]], values: list[float]
) -> tuple[list[tuple[DedicatedParam, Tensor]], list[str]]:
    """Drop matrices no rank had a gradient for, and those whose gradient is not finite.

    ``values`` are the pairs' norms then their first elements, as `_norms_and_firsts`
    wrote them. Returns the pairs to step and the names of the matrices left out for a
    NaN or infinite gradient (``nonfinite`` is applied by the caller: see
    :func:`raise_if_found`).
    """
    count = len(pairs)
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


def raise_if_found(bad: list[str], found_anywhere: bool) -> None:
    """Raise, on every rank alike, when some rank found a non-finite gradient in a
    ``nonfinite="raise"`` group; ``bad`` is what this rank found.

    Raises:
        NonFiniteGradientError: some rank found one; nothing was changed on any rank.
    """
    if not (bad or found_anywhere):
        return
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
    buffers: dict[tuple[tuple[int, ...], torch.device], Tensor],
    groups: list[dist.ProcessGroup],
) -> tuple[dict[int, list[tuple[DedicatedParam, Tensor]]], int]:
    """Each Muon group's owned matrices with a finite averaged gradient here, by group
    index, and how many were skipped (``nonfinite="skip"``).

    Every group's norms and first elements go into one kept buffer (one per layout and
    device: the hot path allocates nothing). Where a group has ``nonfinite="raise"``, the
    count of non-finite norms in those groups is all-reduced (MAX) over ``groups`` (whose
    product spans the ranks that step) on the device, issued by every rank whatever its
    gradients hold, and read with the norms: one host read per step, alone or not.

    Raises:
        NonFiniteGradientError: some rank found a NaN or infinite gradient in a
            ``"raise"`` group; nothing was changed on any rank.
    """
    muon = [i for i, group in enumerate(param_groups) if group["algorithm"] == "muon"]
    pairs_of = {i: owned_gradients(param_groups[i]["params"], dedicated, runtime) for i in muon}
    raising = [i for i in muon if param_groups[i]["nonfinite"] == "raise"]
    agreeing = bool(raising and groups)
    counts = tuple(len(pairs_of[i]) for i in muon)
    if not any(counts) and not agreeing:
        return {i: [] for i in muon}, 0
    device = next((p[0][1].device for p in pairs_of.values() if p), runtime.comm.device)
    key = (counts, device)
    if key not in buffers:
        buffers[key] = torch.empty(2 * sum(counts) + 1, dtype=torch.float32, device=device)
    kept = buffers[key]
    offsets, offset = {}, 0
    for i in muon:
        offsets[i] = offset
        _norms_and_firsts(pairs_of[i], kept[offset : offset + 2 * len(pairs_of[i])], runtime.comm)
        offset += 2 * len(pairs_of[i])
    if agreeing:
        found = kept[offset:]
        found.zero_()
        for i in raising:  # a gradient no rank had has norm 0: never counted
            norms = kept[offsets[i] : offsets[i] + len(pairs_of[i])]
            found.add_(norms.isfinite().logical_not().sum())
        for group in groups:
            runtime.comm.all_reduce_control(found, dist.ReduceOp.MAX, group)
    values = kept.tolist()
    out: dict[int, list[tuple[DedicatedParam, Tensor]]] = {}
    to_raise: list[str] = []
    skipped = 0
    for i in muon:
        pairs = pairs_of[i]
        out[i], bad = finite_only(pairs, values[offsets[i] : offsets[i] + 2 * len(pairs)])
        if param_groups[i]["nonfinite"] == "raise":
            to_raise += bad
        else:
            skipped += len(bad)
    if raising:
        raise_if_found(to_raise, agreeing and values[-1] > 0)
    return out, skipped
