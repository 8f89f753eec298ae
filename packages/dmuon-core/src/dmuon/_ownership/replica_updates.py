"""Handing the updated masters from the replica that stepped them to the other replicas.

On a 2-D (HSDP) mesh every replica's owner of a matrix holds its master, but only one of
them, in the matrix's ``update_replica``, received its averaged gradient, keeps its
momentum and ran Newton-Schulz (see `dmuon.plan_owners`). After the optimizer step it
broadcasts the new values over the replicate group, and the other replicas' owners copy
them into their masters: every replica then holds the same values, exactly as if each
had stepped the matrix itself, and each iteration ran once in the whole world.

The broadcasts are one per replica that updated some of this rank's matrices, each
carrying all of them back to back in float32, issued in replica order by every owner of
the column; at most `IN_FLIGHT` are in flight, so the staging memory stays a fraction of
the masters.
"""

from __future__ import annotations

from collections import deque

import torch

from dmuon._comm import Communicator, Pending
from dmuon._ownership.param import DedicatedParam

#: Broadcasts of updated values in flight at once (each with its staging buffer).
IN_FLIGHT = 2


class ReplicaUpdates:
    """The broadcasts that bring every replica's masters up to date after a step."""

    def __init__(self, params: list[DedicatedParam], comm: Communicator) -> None:
        self.comm = comm
        groups: dict[int, list[DedicatedParam]] = {}
        if comm.replicas > 1:
            for dp in params:
                if dp.is_owned:
                    groups.setdefault(dp.update_replica, []).append(dp)
        #: ``(replica, records it updates)`` in replica order; empty on a 1-D mesh.
        self.groups = sorted(groups.items())

    def share(self) -> None:
        """Broadcast each updating replica's new masters to the other replicas' owners."""
        in_flight: deque[tuple[Pending, torch.Tensor, list[DedicatedParam], bool]] = deque()
        for replica, records in self.groups:
            sending = replica == self.comm.replica_rank
            staging = torch.empty(
                sum(dp.numel for dp in records), dtype=torch.float32, device=self.comm.device
            )
            if sending:
                offset = 0
                for dp in records:
                    staging[offset : offset + dp.numel].copy_(dp.param.detach().reshape(-1))
                    offset += dp.numel
            what = f", updated values of {records[0].name} and {len(records) - 1} more"
            pending = self.comm.broadcast_replicas(staging, replica, what)
            in_flight.append((pending, staging, records, sending))
            if len(in_flight) > IN_FLIGHT:
                _receive(*in_flight.popleft())
        while in_flight:
            _receive(*in_flight.popleft())


def _receive(
    pending: Pending, staging: torch.Tensor, records: list[DedicatedParam], sent: bool
) -> None:
    pending.wait()
    if sent:
        return
    offset = 0
    with torch.no_grad():
        for dp in records:
            dp.param.copy_(staging[offset : offset + dp.numel].view(dp.shape))
            offset += dp.numel
