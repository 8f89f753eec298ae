"""Handing the updated masters from the replica that stepped them to the other replicas.

On a 2-D (HSDP) mesh every replica's owner of a matrix holds its master, but only one of
them, in the matrix's ``update_replica``, received its averaged gradient, keeps its
momentum and ran Newton-Schulz (see `dmuon.plan_owners`). After the optimizer step the
owners of the same matrices (one per replica) all-gather the new values over the
replicate group, each replica sending those it stepped, and copy them into their masters:
every replica then holds the same values, exactly as if each had stepped the matrix
itself, and each iteration ran once in the whole world.

The all-gathers are issued when the step ends and waited for only where the values are
read: each hook boundary's forward pre-hook waits for the chunks holding its matrices and
the next boundary's (the one it prefetches), in forward order, so the transfer overlaps
the next forward, as FSDP2's HSDP all-reduce overlaps backward. Every other read or write
of the masters waits for all of them first (the next step, state dicts, loads,
`dmuon.parameters_updated`, `dmuon.wait_for_updates`).

The values travel in float32, in chunks of at most `CHUNK_ELEMENTS` elements (a matrix
larger than that is a chunk of its own), in dedication order: one collective call per
chunk (a broadcast when one replica stepped the whole chunk).
"""

from __future__ import annotations

import itertools
from collections import deque

from dmuon._comm import Communicator, Pending
from dmuon._comm_audit import REPLICATE
from dmuon._ownership.param import DedicatedParam

#: Elements of float32 values per chunk (256 MiB).
CHUNK_ELEMENTS = 2**26


def update_chunks(
    records: list[tuple[int, int]], replicas: int, cap: int | None = None
) -> list[list[list[int]]]:
    """Split a rank's owned records into the chunks its updated values travel in.

    ``records`` are ``(elements, update replica)`` in dedication order (which is forward
    order: the chunks arrive in the order the next forward needs them). They are cut, in
    that order, into consecutive chunks of at most ``cap`` elements (default
    `CHUNK_ELEMENTS`; a record larger than ``cap`` alone). Returns, per chunk, per replica,
    the indices (into ``records``) of the records that replica sends. `dmuon.plan` counts
    its calls with this function too.
    """
    cap = CHUNK_ELEMENTS if cap is None else cap
    chunks: list[list[list[int]]] = []
    filled = cap
    for index, (elements, replica) in enumerate(records):
        if not chunks or filled + elements > cap:
            chunks.append([[] for _ in range(replicas)])
            filled = 0
        chunks[-1][replica].append(index)
        filled += elements
    return chunks


class ReplicaUpdates:
    """The all-gathers that bring every replica's masters up to date after a step,
    waited for as late as each value is needed (see the module docstring)."""

    def __init__(
        self, params: list[DedicatedParam], comm: Communicator, boundaries: list[str]
    ) -> None:
        self.comm = comm
        owned = [dp for dp in params if dp.is_owned] if comm.replicas > 1 else []
        chunks = update_chunks([(dp.numel, dp.update_replica) for dp in owned], comm.replicas)
        #: Per chunk, per replica, the records whose new values that replica sends.
        self.chunks = [[[owned[i] for i in part] for part in chunk] for chunk in chunks]
        # needed[b]: the chunks up to needed[b] hold every matrix of boundaries 0..b.
        position = {name: b for b, name in enumerate(boundaries)}
        last = [-1] * len(boundaries)
        for c, chunk in enumerate(self.chunks):
            for records in chunk:
                for dp in records:
                    last[position[dp.boundary]] = c
        self._needed = list(itertools.accumulate(last, max)) if last else []
        self._in_flight: deque[Pending] = deque()
        self._waited = 0

    @property
    def pending(self) -> bool:
        """Whether updated values are still on their way."""
        return bool(self._in_flight)

    def share(self) -> None:
        """Issue the all-gather of every chunk's new masters (not waited for here)."""
        self.wait_all()  # a step with the last one's values still on their way
        for chunk in self.chunks:
            first = next(records[0] for records in chunk if records)
            what = f", updated values of {first.name} and more"
            pieces = [[dp.param.detach() for dp in records] for records in chunk]
            self._in_flight.append(self.comm.all_gather_pieces(pieces, what, REPLICATE))
        self._waited = 0

    def wait_for_boundary(self, index: int) -> None:
        """Wait for the chunks holding the matrices of boundaries ``0..index``."""
        if self._in_flight and self._needed:
            self._wait_until(self._needed[min(index, len(self._needed) - 1)])

    def wait_all(self) -> None:
        """Wait for every chunk still on its way."""
        while self._in_flight:
            self._in_flight.popleft().wait()
            self._waited += 1

    def _wait_until(self, chunk: int) -> None:
        while self._in_flight and self._waited <= chunk:
            self._in_flight.popleft().wait()
            self._waited += 1
