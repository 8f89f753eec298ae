"""Tensor parallelism: dedicated matrices that torch's ``parallelize_module`` sharded.

On a mesh with dimensions ``("dp", "tp")``, ``parallelize_module(model, mesh["tp"], plan)``
turns the weights of ``ColwiseParallel`` layers into DTensors ``Shard(0)`` over the tp
mesh and those of ``RowwiseParallel`` layers into ``Shard(1)``. ``dedicate_params(model,
mesh["dp"])`` then dedicates each such matrix *per tensor-parallel shard*: in every tp
position the same data-parallel rank owns the local shard (the planner sees the global
shapes, the same in every tp position), broadcasts it over the dp group in forward,
receives its averaged gradient, and keeps its float32 master and momentum. Forward and
backward see the DTensor the plan made, built over DMuon's broadcast buffer.

Newton-Schulz needs the whole matrix: in ``optimizer.step()`` the owners of one matrix
(one per tp position, a tp group) gather their shards of the Nesterov input to one of
them (the matrix's *worker*, chosen so that every tp rank orthogonalizes about the same
share), which orthogonalizes it, scales it and scatters each owner its shard of the
update. That costs 2 units of the matrix over the tp group (a gather and a scatter)
instead of 1 for an all-gather, and orthogonalizes each matrix once instead of once per
tp rank.

A DTensor ``Replicate()`` over the tp mesh (a weight a plan leaves whole) is dedicated like
a plain matrix in every tp position, and handed to the module as the same DTensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dmuon._ownership.planner import newton_schulz_cost, spread_over_tp

__all__ = [
    "TensorParallel",
    "assign_workers",
    "leaf_for",
    "local_grad",
    "spread_over_tp",
    "tensor_parallel_of",
]


@dataclass(eq=False)
class TensorParallel:
    """How a dedicated matrix is laid out over the tensor-parallel mesh."""

    #: The 1-D tensor-parallel mesh of the matrix's DTensor.
    mesh: DeviceMesh
    #: Its placement over that mesh: ``Shard(0)``, ``Shard(1)`` or ``Replicate()``.
    placements: tuple[Placement, ...]
    #: The whole matrix's shape.
    global_shape: torch.Size
    #: The tp rank that orthogonalizes the matrix (set by `assign_workers`).
    worker: int = 0

    @property
    def shard_dim(self) -> int | None:
        """The tensor dimension the tp mesh splits, or ``None`` for a replicated matrix."""
        (placement,) = self.placements
        return placement.dim if isinstance(placement, Shard) else None

    @property
    def group(self) -> dist.ProcessGroup:
        """The tensor-parallel process group."""
        return self.mesh.get_group()

    @property
    def size(self) -> int:
        """Ranks of the tensor-parallel group."""
        return self.mesh.size()

    @property
    def rank(self) -> int:
        """This rank's position in the tensor-parallel group."""
        return self.mesh.get_local_rank()

    def bounds(self, position: int) -> tuple[int, int]:
        """``[start, stop)`` along `shard_dim` of the shard at tp ``position`` (as
        ``torch.chunk`` cuts it, which is how DTensor shards)."""
        assert self.shard_dim is not None
        length = int(self.global_shape[self.shard_dim])
        per = math.ceil(length / self.size)
        start = min(position * per, length)
        return start, min(start + per, length)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full matrix."""
        if self.shard_dim is None:
            return full
        start, stop = self.bounds(self.rank)
        return full.narrow(self.shard_dim, start, stop - start)

    @property
    def padded(self) -> int:
        """Length along `shard_dim` of every shard once padded to the largest."""
        assert self.shard_dim is not None
        return math.ceil(int(self.global_shape[self.shard_dim]) / self.size)


def tensor_parallel_of(fqn: str, param: nn.Parameter) -> TensorParallel | None:
    """The layout of a selected parameter that is a DTensor (``None`` for a plain tensor).

    Raises:
        ValueError: the DTensor spans several mesh dimensions, or is split in another way
            than one ``Shard`` or ``Replicate``, or it is a 3-D stack.
    """
    if not isinstance(param, DTensor):
        return None
    mesh = param.device_mesh
    placements = tuple(param.placements)
    if mesh.ndim != 1 or len(placements) != 1:
        raise ValueError(
            f"{fqn!r} is a DTensor on a {mesh.ndim}-D mesh with placements {placements}: "
            "dedicate_params takes matrices that tensor parallelism split over one mesh "
            "dimension (parallelize_module(model, mesh['tp'], plan) before dedicate_params, "
            "and fully_shard after it). Tensor parallelism with HSDP (a 3-D mesh) is not "
            "supported; use a (dp, tp) mesh."
        )
    (placement,) = placements
    valid = isinstance(placement, Replicate) or (
        isinstance(placement, Shard) and placement.dim in (0, 1) and param.ndim == 2
    )
    if not valid:
        raise ValueError(
            f"{fqn!r} is a DTensor with placement {placement} (shape {tuple(param.shape)}); "
            "dedicate_params supports tensor-parallel matrices split by rows (Shard(0), "
            "ColwiseParallel) or columns (Shard(1), RowwiseParallel), or replicated. Leave "
            "other layouts out of the predicate."
        )
    return TensorParallel(mesh, placements, param.shape)


def leaf_for(tp: TensorParallel | None, view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """The parameter a module uses in forward: ``view``, or a DTensor over it."""
    if tp is None:
        return nn.Parameter(view, requires_grad=requires_grad)
    stride = torch.empty(tp.global_shape, device="meta").stride()
    wrapped = DTensor.from_local(
        view, tp.mesh, tp.placements, run_check=False, shape=tp.global_shape, stride=stride
    )
    return nn.Parameter(wrapped, requires_grad=requires_grad)


def local_grad(grad: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """A gradient's local values in its parameter's layout (a DTensor gradient in another
    layout, such as a partial sum, is redistributed first: a collective over tp)."""
    if not isinstance(grad, DTensor):
        return grad
    placements = tuple(leaf.placements) if isinstance(leaf, DTensor) else None
    if placements is not None and tuple(grad.placements) != placements:
        grad = grad.redistribute(placements=placements)
    return grad.to_local()


def assign_workers(layouts: Sequence[tuple[TensorParallel, int]]) -> None:
    """Give each tp-sharded matrix the tp rank that orthogonalizes it.

    ``layouts`` lists ``(layout, owner)`` in dedication order. For each owner,
    its matrices go, largest Newton-Schulz cost first, to the least-loaded tp rank; every
    rank computes the same assignment from the same list (`spread_over_tp`).
    """
    by_owner: dict[int, list[TensorParallel]] = {}
    for tp, owner in layouts:
        if tp.shard_dim is not None:
            by_owner.setdefault(owner, []).append(tp)
    for items in by_owner.values():
        costs = [newton_schulz_cost(item.global_shape) for item in items]
        for item, worker in zip(items, spread_over_tp(costs, items[0].size), strict=True):
            item.worker = worker
