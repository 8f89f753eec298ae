"""Handing the updated masters from the replica that stepped them to the other replicas.

On a 2-D (HSDP) mesh every replica's owner of a matrix holds its master, but only one of
them, in the matrix's ``update_replica``, received its averaged gradient, keeps its
momentum and ran Newton-Schulz (see `dmuon.plan_owners`). After the optimizer step the
owners of the same matrices (one per replica) all-gather the new values over the
replicate group, each replica sending those it stepped, and copy them into their masters:
every replica then holds the same values, exactly as if each had stepped the matrix
itself, and each iteration ran once in the whole world.

The values travel in float32, in chunks of at most `CHUNK_ELEMENTS` elements (a matrix
larger than that is a chunk of its own): one collective call per chunk (a broadcast when
one replica stepped the whole chunk), at most `IN_FLIGHT` in flight, so the staging
memory stays a bounded fraction of the masters and the calls stay few.
"""

from __future__ import annotations

from collections import deque

from dmuon._comm import Communicator, Pending
from dmuon._comm_audit import REPLICATE
from dmuon._ownership.param import DedicatedParam

#: Chunks of updated values in flight at once (each with its staging buffer).
IN_FLIGHT = 2

#: Elements of float32 values per chunk (256 MiB): at most `IN_FLIGHT` chunks of staging.
CHUNK_ELEMENTS = 2**26


def update_chunks(
    records: list[tuple[int, int]], replicas: int, cap: int | None = None
) -> list[list[list[int]]]:
    """Split a rank's owned records into the chunks its updated values travel in.

    ``records`` are ``(elements, update replica)`` in dedication order. The records are
    taken by replica, then in that order, and cut into consecutive chunks of at most
    ``cap`` elements (default `CHUNK_ELEMENTS`; a record larger than ``cap`` alone).
    Returns, per chunk, per replica, the indices (into ``records``) of the records that
    replica sends. `dmuon.plan` counts its calls with this function too.
    """
    cap = CHUNK_ELEMENTS if cap is None else cap
    order = sorted(range(len(records)), key=lambda i: (records[i][1], i))
    chunks: list[list[list[int]]] = []
    filled = cap
    for index in order:
        elements, replica = records[index]
        if not chunks or filled + elements > cap:
            chunks.append([[] for _ in range(replicas)])
            filled = 0
        chunks[-1][replica].append(index)
        filled += elements
    return chunks


class ReplicaUpdates:
    """The all-gathers that bring every replica's masters up to date after a step."""

    def __init__(self, params: list[DedicatedParam], comm: Communicator) -> None:
        self.comm = comm
        owned = [dp for dp in params if dp.is_owned] if comm.replicas > 1 else []
        chunks = update_chunks([(dp.numel, dp.update_replica) for dp in owned], comm.replicas)
        #: Per chunk, per replica, the records whose new values that replica sends.
        self.chunks = [[[owned[i] for i in part] for part in chunk] for chunk in chunks]

    def share(self) -> None:
        """All-gather the new masters of each chunk from the replicas that stepped them."""
        in_flight: deque[Pending] = deque()
        for chunk in self.chunks:
            first = next(records[0] for records in chunk if records)
            what = f", updated values of {first.name} and more"
            pieces = [[dp.param.detach() for dp in records] for records in chunk]
            in_flight.append(self.comm.all_gather_pieces(pieces, what, REPLICATE))
            if len(in_flight) > IN_FLIGHT:
                in_flight.popleft().wait()
        while in_flight:
            in_flight.popleft().wait()
