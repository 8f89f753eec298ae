"""Global gradient-norm clipping over dedicated, FSDP2 and plain gradients.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` cannot see a dedicated
matrix's gradient: it lives on its owner as ``_reduced_grad``, and the parameter's ``.grad``
is ``None``. `clip_grad_norm_` covers every gradient the optimizer steps with, each element
counted once across ranks:

- dedicated matrices: the owner's ``_reduced_grad``;
- FSDP2 gradients (DTensors): each rank's shard, replicated dimensions and the ranks
  outside the gradient's mesh (tensor-parallel positions) counted once;
- any other gradient: a plain tensor every rank holds alike, counted once.

Partial sums are combined over the dedication's process group (the mesh passed to
`dmuon.dedicate_params`), with one scalar all-reduce; on a 2-D (HSDP) mesh with one over
the shard group and one over the replicate group.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon._comm import all_reduce_plain
from dmuon._ownership.dedication_state import DedicationState, get_dedication
from dmuon._ownership.fsdp_integration import is_dedicated

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def reduction_groups(model: nn.Module) -> tuple[list[dist.ProcessGroup], torch.device]:
    """The process groups whose product spans every rank, and the device to reduce on."""
    state = get_dedication(model)
    if state is not None:
        comm = state.runtime.comm
        groups = [g for g in (comm.group, comm.replicate_group) if g is not None]
        tp = _tensor_parallel_size(state)
        if tp is not None and tp[0] > 1:
            groups.append(tp[1])
        return groups, comm.device
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return [dist.group.WORLD], device
    return [], torch.device("cpu")


Parts = list[tuple[Tensor, float]]


def _tensor_parallel_size(state: DedicationState) -> tuple[int, dist.ProcessGroup] | None:
    """``(size, group)`` of the model's tensor-parallel mesh, if it has one."""
    tp = next((dp.tp for dp in state.params if dp.tp is not None), None)
    return (tp.size, tp.group) if tp is not None else None


def _local_parts(model: nn.Module, world: int) -> tuple[Parts, Parts]:
    """``(local gradient, how many ranks hold the same elements)`` of every gradient: the
    dedicated ones (on their owners), then the others."""
    state = get_dedication(model)
    dedicated = {id(dp.param): dp for dp in state.params} if state is not None else {}
    # A matrix's averaged gradient lives on one rank of the whole mesh (the owner that
    # steps it, in one replica under HSDP); under tensor parallelism on every tp position,
    # except for the shards of a split matrix.
    tp = _tensor_parallel_size(state) if state is not None else None
    tp_copies = float(tp[0]) if tp is not None else 1.0
    owned: Parts = []
    # Dedicated gradients come from the dedication's records (a stack split by experts
    # has one per range, each on its owner), not from the module's parameters.
    for dp in dedicated.values():
        assert state is not None
        grad = state.runtime.reduced_grad(dp) if dp.updates_here else None
        if grad is not None:
            owned.append((grad, 1.0 if dp.tp_sharded else tp_copies))
    parts: Parts = []
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen or id(param) in dedicated or is_dedicated(param):
            continue
        seen.add(id(param))
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            # Ranks outside the gradient's mesh (the tp positions of a gradient FSDP2
            # shards over the dp mesh only) hold the same elements too.
            replicas = world / grad.device_mesh.size()
            for dim, placement in enumerate(grad.placements):
                if placement.is_replicate():
                    replicas *= grad.device_mesh.size(dim)
            if any(placement.is_partial() for placement in grad.placements):
                raise ValueError(
                    "clip_grad_norm_ needs reduced gradients; call it after backward has "
                    "finished (outside no_sync), not on partial sums"
                )
            parts.append((grad.to_local(), float(replicas)))
        else:
            parts.append((grad, float(world)))
    return owned, parts


def _parts_and_groups(
    model: nn.Module,
) -> tuple[Parts, Parts, list[dist.ProcessGroup], torch.device]:
    groups, device = reduction_groups(model)
    world = math.prod(dist.get_world_size(g) for g in groups)
    return *_local_parts(model, world), groups, device


Reduce = Callable[[Tensor, dist.ReduceOp.RedOpType, dist.ProcessGroup], None]


def _reducer(model: nn.Module) -> Reduce:
    """How the norm is reduced: through the dedication's communicator (checked and
    audited as a control collective), or plainly for a model without one."""
    state = get_dedication(model)
    return state.runtime.comm.all_reduce_control if state is not None else all_reduce_plain


def _global_norm(
    parts: Parts,
    norm_type: float,
    groups: list[dist.ProcessGroup],
    device: torch.device,
    reduce: Reduce,
) -> Tensor:
    """Combine the local parts into the global norm (float64): one all-reduce per group."""
    norms = _part_norms(parts, norm_type, device)
    if norm_type == math.inf:
        total = torch.zeros((), dtype=torch.float64, device=device)
        for local in norms:
            total = torch.maximum(total, local)
        for group in groups:
            reduce(total, dist.ReduceOp.MAX, group)
        return total
    total = torch.zeros((), dtype=torch.float64, device=device)
    for local, (_, replicas) in zip(norms, parts, strict=True):
        total += local**norm_type / replicas
    for group in groups:
        reduce(total, dist.ReduceOp.SUM, group)
    return total ** (1.0 / norm_type)


def _part_norms(parts: Parts, norm_type: float, device: torch.device) -> list[Tensor]:
    """Each part's ``norm_type``-norm as a float64 scalar on ``device``: one
    ``torch._foreach_norm`` per device and dtype, accumulated in float32 (float64 for
    float64 gradients), so no gradient is copied into a wider dtype."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, (grad, _) in enumerate(parts):
        if grad.numel():
            by_kind.setdefault((grad.device, grad.dtype), []).append(index)
    norms = [torch.zeros((), dtype=torch.float64, device=device) for _ in parts]
    for (_, dtype), indices in by_kind.items():
        wide = torch.promote_types(dtype, torch.float32)
        grads = [parts[i][0].detach() for i in indices]
        for i, norm in zip(indices, torch._foreach_norm(grads, norm_type, dtype=wide), strict=True):
            norms[i] = norm.to(device, torch.float64)
    return norms


@torch.no_grad()
def total_grad_norm(model: nn.Module, norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all of ``model``'s gradients (float64), the same on every rank.

    A collective when several ranks take part: call it on every rank. See
    `clip_grad_norm_` for which gradients count.
    """
    owned, others, groups, device = _parts_and_groups(model)
    return _global_norm(owned + others, float(norm_type), groups, device, _reducer(model))


@torch.no_grad()
def clip_grad_norm_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """Clip the gradients of a DMuon model by their global norm, in place.

    The drop-in for ``torch.nn.utils.clip_grad_norm_`` on a model prepared with
    `dmuon.dedicate_params` (and FSDP2): the norm covers dedicated gradients on their
    owners, FSDP2 gradient shards and any other gradient, each element once across ranks,
    so it equals the single-process norm of the global-batch gradient. Call it on every
    rank after the last backward of the step (outside `dmuon.no_sync`) and before
    ``optimizer.step()``; for the 2-norm it issues one scalar all-reduce (two on a 2-D HSDP
    mesh: over the shard group, then over the replicate group).

    Args:
        model: The model (not its parameters: dedicated gradients are found through it).
        max_norm: Largest allowed norm.
        norm_type: Norm order, ``2.0`` by default; ``math.inf`` for the largest magnitude.
        error_if_nonfinite: Raise ``RuntimeError`` if the total norm is NaN or infinite
            (the same total, and so the same error, on every rank).
        foreach: ``False`` scales gradient by gradient; ``None`` or ``True`` scales each
            group of same device and dtype with one ``torch._foreach_mul_``.

    Returns:
        The total norm before clipping, as a tensor.
    """
    owned, others, groups, device = _parts_and_groups(model)
    # Returned in torch's dtype for float32 gradients.
    total = _global_norm(owned + others, float(norm_type), groups, device, _reducer(model)).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {float(norm_type)} of the gradients is non-finite "
            "({}), so they cannot be clipped. Set error_if_nonfinite=False to clip anyway, "
            "or find the NaN or infinity first (lower the learning rate, check the "
            "loss).".format(total.item())
        )
    coefficient = torch.clamp(float(max_norm) / (total.double() + 1e-6), max=1.0)
    state = get_dedication(model)
    if state is not None:
        state.runtime.scale_reduced_grads(coefficient)
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for grad, _ in others:
        if grad.numel():
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), same in by_kind.items():
        scale = coefficient.to(device, dtype)
        if foreach is False:
            for grad in same:
                grad.mul_(scale)
        else:
            torch._foreach_mul_(same, scale)
    return total
