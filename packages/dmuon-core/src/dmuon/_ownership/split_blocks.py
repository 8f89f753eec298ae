"""The process groups of the blocks of ranks that share Newton-Schulz iterations
(``dedicate_params(ns_split=g)``; the plan is `dmuon._ownership.split_iterations`')."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dmuon._ownership.planner import OwnerPlan
from dmuon._ownership.split_iterations import SplitBlock, block_of


def make_split_block(
    plan: OwnerPlan,
    mesh: DeviceMesh | None,
    group: dist.ProcessGroup | None,
    comm_rank: int,
    replica_rank: int,
) -> SplitBlock | None:
    """This rank's block of ranks sharing iterations, where the plan splits a matrix
    stepped in it.

    Every rank makes the process group of every block of the mesh, in block order, as
    ``DeviceMesh`` makes its groups, so every rank counts as many groups made and as many
    it belongs to (one): torch names a group made by its members alone from that count,
    and counts apart would pair ranks wrongly in a later group (DDP's, for one). So the
    mesh must hold every rank of the default process group.
    """
    if plan.ns_split == 1 or group is None:
        return None
    ranks = mesh.mesh.flatten().tolist() if mesh is not None else list(range(dist.get_world_size()))
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            f"ns_split={plan.ns_split} needs the mesh to hold every rank of the default process "
            f"group ({len(ranks)} of {dist.get_world_size()} here, as under pipeline "
            "parallelism): every rank makes the blocks' process groups. Pass ns_split=1 on a "
            "sub-mesh"
        )
    if not plan.split:
        return None
    size, mine = plan.shard_size, replica_rank * plan.shard_size + comm_rank
    used = {
        block_of(plan.workers[n] * size + plan.owners[n], plan.ns_split).start for n in plan.split
    }
    own = None
    for first in range(0, len(ranks), plan.ns_split):
        members = tuple(int(ranks[p]) for p in range(first, first + plan.ns_split))
        made = dist.new_group(list(members))
        if first <= mine < first + plan.ns_split and first in used:
            own = SplitBlock(made, members, first)
    return own
