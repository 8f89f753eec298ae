"""Handing each step's updates from the replica that computed them to the other replicas.

On a 2-D (HSDP) mesh every replica's owner of a matrix holds its master, but only one of
them, in the matrix's ``update_replica``, received its averaged gradient, keeps its
momentum and ran Newton-Schulz (see `dmuon.plan_owners`). What it sends the other
replicas' owners is not the new master but what they need to step their own copy the same
way: the orthogonalized update in the dtype the optimizer produced it in (the
Newton-Schulz iteration's, bfloat16 on GPUs, so half the bytes of float32 values; the
weights' own for NorMuon, whose normalization runs there), and a header of scalars:

* the weight decay factor ``1 - lr * weight_decay``,
* the step's multiplier of the update per output row (``-lr`` times the shape's learning
  rate adjustment; the parts of a split matrix may differ),
* QK-clip's factor per output row (1 where no head was clipped).

Every owner applies them with the same elementwise operations, each rounded once, that the
stepping owner ran on its own master (`UpdateSlot.apply`), so the replicas stay
bit-identical and each iteration still runs once in the whole world. A matrix the step
left alone (no gradient anywhere, a skipped non-finite one, a frozen one) keeps the
header's defaults (decay 1, multiplier -0.0, factor 1, update 0), which change no bit.

Masters live once per world where the forward runs in a narrower dtype than the masters
(``param_dtype=torch.bfloat16``, or a narrower ``broadcast_dtype``): before the first
forward (`ReplicaUpdates.hold_narrow`) the owners of a matrix in the replicas that do not
step it replace their float32 master with a copy in that dtype, which is all their
forward broadcasts need. Such a matrix's record carries no header and no update but the
stepping owner's new values in that dtype, cast from its master after the whole step
(QK-clip included): the same bits every replica's forward would have cast, and as many
bytes as a bfloat16 update. Only the stepping owner keeps the float32 master and the
momentum; `ReplicaUpdates.exact_master` hands the master to the others' state dicts.

The messages are issued when the step ends and waited for only where the values are read:
each hook boundary's forward pre-hook waits for the chunks holding its matrices and the
next boundary's (the one it prefetches), in forward order, so the transfer overlaps the
next forward, as FSDP2's HSDP all-reduce overlaps backward. Every other read or write of
the masters waits for all of them first (the next step, state dicts, loads,
`dmuon.parameters_updated`, `dmuon.wait_for_updates`).

They travel as bytes, in chunks of at most `CHUNK_BYTES` (a record larger than that is a
chunk of its own), in dedication order: one collective call per chunk (a broadcast when
one replica stepped the whole chunk). In a chunk each replica's section holds its
records' headers, then their updates (`record_nbytes` is one record's share).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon._comm import Communicator, Pending
from dmuon._comm_audit import REPLICATE
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.step_arithmetic import (
    add_updates_,
    decay_masters_,
    header_dtype,
    scale_update_,
)

#: Bytes per chunk of updates (256 MiB).
CHUNK_BYTES = 2**28

#: Every header and update starts at a multiple of this many bytes (any dtype views it).
_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def header_length(out_features: int) -> int:
    """Elements of a record's header: the decay, then a multiplier and a QK-clip factor
    per output row."""
    return 1 + 2 * out_features


def _record_parts(
    numel: int, out_features: int, update_dtype: torch.dtype, master_dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes of one record's header and of its update in its chunk, each aligned."""
    header = header_length(out_features) * header_dtype(master_dtype).itemsize
    return _aligned(header), _aligned(numel * update_dtype.itemsize)


def record_nbytes(
    numel: int, out_features: int, update_dtype: torch.dtype, master_dtype: torch.dtype
) -> int:
    """Bytes one record takes in its chunk: its header and its update, each aligned.
    `dmuon.plan` counts the traffic between replicas with this function too."""
    return sum(_record_parts(numel, out_features, update_dtype, master_dtype))


def values_nbytes(numel: int, itemsize: int) -> int:
    """Bytes a record held narrow off its stepping replica takes in its chunk: its new
    values in the forward's dtype (``itemsize`` bytes each), aligned, with no header.
    `dmuon.plan` counts the traffic between replicas with this function too."""
    return _aligned(numel * itemsize)


def from_stepping_replica(
    comm: Communicator, dp: DedicatedParam, held: Tensor | None, dtype: torch.dtype
) -> Tensor:
    """``held``, a tensor of ``dp``'s shape that the owner stepping ``dp`` keeps (a master, a
    momentum), in ``dtype`` on every replica's owner of ``dp``: one broadcast over the
    replicate group, so every owner of ``dp`` calls this alike (in the same order)."""
    if dp.updates_here:
        assert held is not None, f"{dp.name}: the replica that steps it holds nothing"
        buffer = held.detach().to(comm.device, dtype).contiguous()
    else:
        buffer = torch.empty(dp.shape, dtype=dtype, device=comm.device)
    comm.broadcast_replicas_now(buffer, dp.update_replica)
    return buffer


def update_chunks(
    records: list[tuple[int, int]], replicas: int, cap: int | None = None
) -> list[list[list[int]]]:
    """Split a rank's owned records into the chunks their updates travel in.

    ``records`` are ``(bytes, update replica)`` in dedication order (which is forward
    order: the chunks arrive in the order the next forward needs them). They are cut, in
    that order, into consecutive chunks of at most ``cap`` bytes (default `CHUNK_BYTES`; a
    record larger than ``cap`` alone). Returns, per chunk, per replica, the indices (into
    ``records``) of the records that replica sends. `dmuon.plan` counts its calls with
    this function too.
    """
    chunks: list[list[list[int]]] = []
    for start, stop in chunk_bounds([nbytes for nbytes, _ in records], cap):
        chunk: list[list[int]] = [[] for _ in range(replicas)]
        for index in range(start, stop):
            chunk[records[index][1]].append(index)
        chunks.append(chunk)
    return chunks


def chunk_bounds(sizes: list[int], cap: int | None = None) -> list[tuple[int, int]]:
    """``(start, stop)`` of each chunk `update_chunks` cuts records of these byte sizes
    into: consecutive, at most ``cap`` bytes (default `CHUNK_BYTES`), a larger record
    alone."""
    cap = CHUNK_BYTES if cap is None else cap
    bounds: list[tuple[int, int]] = []
    filled = cap
    for index, nbytes in enumerate(sizes):
        if not bounds or filled + nbytes > cap:
            bounds.append((index, index))
            filled = 0
        bounds[-1] = (bounds[-1][0], index + 1)
        filled += nbytes
    return bounds


def out_features(dp: DedicatedParam) -> int:
    """Output rows of each of ``dp``'s matrices as it stores them."""
    return int(dp.shape[-1] if dp.transposed else dp.shape[-2])


def along_out(vector: Tensor, dp: DedicatedParam) -> Tensor:
    """``vector`` (one value per output row) shaped to broadcast over ``dp``'s tensor."""
    shape = [1] * len(dp.shape)
    shape[-1 if dp.transposed else -2] = vector.numel()
    return vector.view(shape)


@dataclass(eq=False)
class UpdateSlot:
    """Where one record's step travels: its header and its update (views of a chunk)."""

    dp: DedicatedParam
    header: Tensor
    update: Tensor

    @property
    def decay(self) -> Tensor:
        """The weight decay factor (one element)."""
        return self.header[:1]

    @property
    def multipliers(self) -> Tensor:
        """The update's multiplier per output row."""
        return self.header[1 : 1 + out_features(self.dp)]

    @property
    def factors(self) -> Tensor:
        """QK-clip's factor per output row."""
        return self.header[1 + out_features(self.dp) :]

    def apply(self) -> None:
        """Step this owner's master as the stepping owner stepped its own: decay, then the
        scaled update added, then the QK-clip factors, each product and sum rounded once
        in the master's dtype (so the result is the same bits)."""
        master = self.dp.param.detach()
        decay_masters_([master], self.decay)
        step = scale_update_(self.update.to(master.dtype), along_out(self.multipliers, self.dp))
        add_updates_([master], [step])
        master.mul_(along_out(self.factors, self.dp).to(master.dtype))


def _reset_header(header: Tensor, out: int) -> None:
    header[0] = 1.0
    header[1 : 1 + out] = -0.0
    header[1 + out :] = 1.0


@dataclass
class _Chunk:
    """One chunk's layout: per replica, its records and the byte ranges of its section."""

    records: list[list[DedicatedParam]]
    #: Per replica: (start, headers' end, end) of its section in the chunk's bytes.
    sections: list[tuple[int, int, int]]
    #: Per record name: (header offset, update offset) in bytes.
    offsets: dict[str, tuple[int, int]]
    nbytes: int


class ReplicaUpdates:
    """The messages that bring every replica's masters up to date after a step, waited
    for as late as each value is needed (see the module docstring)."""

    def __init__(
        self, params: list[DedicatedParam], comm: Communicator, boundaries: list[str]
    ) -> None:
        self.comm = comm
        self._owned = [dp for dp in params if dp.is_owned] if comm.replicas > 1 else []
        self._position = {name: b for b, name in enumerate(boundaries)}
        self._boundaries = len(boundaries)
        self._chunks: list[_Chunk] = []
        self._needed: list[int] = []
        self._templates: list[Tensor | None] = []
        self._wires: list[Tensor | None] = []
        self._slots: dict[str, UpdateSlot] = {}
        self._in_flight: deque[tuple[Pending, int]] = deque()
        self._dtype_of: dict[str, torch.dtype] = {}
        self._begun = False
        #: Records held narrow off their stepping replica: the dtype their values travel in.
        self._narrow: dict[str, torch.dtype] = {}
        self._master_dtype: dict[str, torch.dtype] = {}

    @property
    def pending(self) -> bool:
        """Whether updates are still on their way."""
        return bool(self._in_flight)

    def hold_narrow(self, wire_dtype: Callable[[DedicatedParam], torch.dtype]) -> None:
        """Masters once per world: where ``wire_dtype(dp)`` (what ``dp``'s owner packs for
        forward, the same on every rank) is narrower than the master, the owners in the
        replicas that do not step ``dp`` keep only a copy in that dtype from now on, and
        steps send them the stepping owner's new values in it. Called once, on every rank,
        before the first forward gathers anything."""
        self.wait_all()
        for dp in self._owned:
            dtype = wire_dtype(dp)
            master = dp.param.dtype
            if not dtype.is_floating_point or dtype.itemsize >= master.itemsize:
                continue
            self._narrow[dp.name] = dtype
            self._master_dtype[dp.name] = master
            if not dp.updates_here:
                with torch.no_grad():
                    dp.param.data = dp.param.data.to(dtype)
        self._dtype_of = {}  # lay the chunks out again

    def exact_master(self, dp: DedicatedParam) -> Tensor:
        """``dp``'s master as the owner that steps it holds it, on every replica's owner of
        ``dp``: for a record held narrow, one broadcast between them, so every owner of
        ``dp`` calls this alike (in the same order)."""
        if dp.name not in self._narrow:
            return dp.param.detach()
        self.wait_all()
        return from_stepping_replica(self.comm, dp, dp.param, self._master_dtype[dp.name])

    def resend_values(self) -> None:
        """Bring the copies held narrow to their stepping owners' masters (after the
        masters were changed by hand); the other records' defaults change nothing. Call on
        every rank alike."""
        if not self._narrow:
            return
        self.begin(lambda dp: self._dtype_of.get(dp.name, dp.param.dtype))
        self.share()
        self.wait_all()

    def begin(self, update_dtype: Callable[[DedicatedParam], torch.dtype]) -> None:
        """Open a step: ``update_dtype(dp)`` is the dtype ``dp``'s update travels in (the
        same on every rank; a record held narrow travels as values in its own). Lays out
        this step's chunks; this rank's sections start at the defaults that change
        nothing."""
        self.wait_all()
        self._slots = {}
        if not self._owned:
            return
        dtype_of = {dp.name: self._narrow.get(dp.name) or update_dtype(dp) for dp in self._owned}
        if dtype_of != self._dtype_of:
            self._lay_out(dtype_of)
        me = self.comm.replica_rank
        self._wires = []
        for chunk, template in zip(self._chunks, self._templates, strict=True):
            wire = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.comm.device)
            start, headers_end, end = chunk.sections[me]
            if template is not None:
                wire[start:headers_end].copy_(template)
                wire[headers_end:end].zero_()
            self._wires.append(wire)
            self._slots.update(
                (dp.name, self._slot(wire, chunk, dp))
                for dp in chunk.records[me]
                if dp.name not in self._narrow
            )
        self._begun = True

    def outgoing(self, dp: DedicatedParam) -> UpdateSlot | None:
        """Where the step of ``dp`` (which this rank steps) goes, if other replicas need it
        as an update (``None`` for a record held narrow: its values go at `share`)."""
        return self._slots.get(dp.name)

    def share(self) -> None:
        """Issue every chunk's message (not waited for here), with the new values of the
        records held narrow that this rank steps."""
        if not self._begun:
            return
        self._begun = False
        me = self.comm.replica_rank
        for index, (chunk, wire) in enumerate(zip(self._chunks, self._wires, strict=True)):
            assert wire is not None
            for dp in chunk.records[me]:
                if dp.name in self._narrow:
                    self._values(wire, chunk, dp).copy_(dp.param.detach())
            first = next(records[0] for records in chunk.records if records)
            what = f", updates of {first.name} and more"
            pieces = [[wire[start:end]] if end > start else [] for start, _, end in chunk.sections]
            values = sum(dp.numel for records in chunk.records for dp in records)
            pending = self.comm.all_gather_pieces(pieces, what, REPLICATE, values)
            self._in_flight.append((pending, index))
        self._slots = {}

    def wait_for_boundary(self, index: int) -> None:
        """Apply the chunks holding the matrices of boundaries ``0..index``."""
        if self._in_flight and self._needed:
            last = self._needed[min(index, len(self._needed) - 1)]
            while self._in_flight and self._in_flight[0][1] <= last:
                self._finish_next()

    def wait_all(self) -> None:
        """Apply every chunk still on its way."""
        while self._in_flight:
            self._finish_next()

    # ----- layout ---------------------------------------------------------------------------
    def _lay_out(self, dtype_of: dict[str, torch.dtype]) -> None:
        self._dtype_of = dtype_of
        parts_of = {
            dp.name: (0, values_nbytes(dp.numel, dtype_of[dp.name].itemsize))
            if dp.name in self._narrow
            else _record_parts(dp.numel, out_features(dp), dtype_of[dp.name], dp.param.dtype)
            for dp in self._owned
        }
        cut = update_chunks(
            [(sum(parts_of[dp.name]), dp.update_replica) for dp in self._owned],
            self.comm.replicas,
        )
        me = self.comm.replica_rank
        self._chunks, self._templates = [], []
        last = [-1] * self._boundaries
        for c, parts in enumerate(cut):
            records = [[self._owned[i] for i in part] for part in parts]
            headers: dict[str, int] = {}
            updates: dict[str, int] = {}
            sections = []
            position = 0
            for part in records:
                start = position
                for dp in part:
                    headers[dp.name] = position
                    position += parts_of[dp.name][0]
                headers_end = position
                for dp in part:
                    updates[dp.name] = position
                    position += parts_of[dp.name][1]
                    last[self._position[dp.boundary]] = c
                sections.append((start, headers_end, position))
            offsets = {name: (at, updates[name]) for name, at in headers.items()}
            chunk = _Chunk(records, sections, offsets, position)
            self._chunks.append(chunk)
            self._templates.append(self._header_template(chunk, records[me]))
        # needed[b]: the chunks up to needed[b] hold every matrix of boundaries 0..b.
        self._needed = list(itertools.accumulate(last, max)) if last else []

    def _header_template(self, chunk: _Chunk, mine: list[DedicatedParam]) -> Tensor | None:
        """This rank's headers at their defaults, as the bytes its section starts with."""
        if not mine:
            return None
        start, headers_end, _ = chunk.sections[self.comm.replica_rank]
        template = torch.zeros(headers_end - start, dtype=torch.uint8, device=self.comm.device)
        for dp in mine:
            if dp.name in self._narrow:
                continue
            offset = chunk.offsets[dp.name][0] - start
            header = self._typed(template, offset, header_length(out_features(dp)),
                                 header_dtype(dp.param.dtype))  # fmt: skip
            _reset_header(header, out_features(dp))
        return template

    @staticmethod
    def _typed(wire: Tensor, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
        return wire[offset : offset + numel * dtype.itemsize].view(dtype)

    def _slot(self, wire: Tensor, chunk: _Chunk, dp: DedicatedParam) -> UpdateSlot:
        header_at, update_at = chunk.offsets[dp.name]
        dtype = self._dtype_of[dp.name]
        header = self._typed(
            wire, header_at, header_length(out_features(dp)), header_dtype(dp.param.dtype)
        )
        update = self._typed(wire, update_at, dp.numel, dtype).view(dp.shape)
        return UpdateSlot(dp, header, update)

    def _values(self, wire: Tensor, chunk: _Chunk, dp: DedicatedParam) -> Tensor:
        """The new values of a record held narrow, in its chunk."""
        at = chunk.offsets[dp.name][1]
        return self._typed(wire, at, dp.numel, self._dtype_of[dp.name]).view(dp.shape)

    # ----- receiving ------------------------------------------------------------------------
    def _finish_next(self) -> None:
        pending, index = self._in_flight.popleft()
        pending.wait()
        chunk, wire = self._chunks[index], self._wires[index]
        assert wire is not None
        me = self.comm.replica_rank
        for replica, records in enumerate(chunk.records):
            if replica != me:
                for dp in records:
                    if dp.name in self._narrow:
                        dp.param.detach().copy_(self._values(wire, chunk, dp))
                    else:
                        self._slot(wire, chunk, dp).apply()
        self._wires[index] = None
