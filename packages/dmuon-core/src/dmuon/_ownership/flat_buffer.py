"""`FlatBuffer`: the one buffer behind a hook boundary's dedicated matrices.

A flat buffer holds, during forward and backward, the full values of the dedicated
records (`DedicatedParam`) of one hook boundary, and reduces their gradients. Its layout
is described by three lists:

- **entries**: one per record, its slice of the buffer (records are laid out back to back);
- **spans**: the runs of consecutive entries with one owner, who sends them in forward and
  receives their SUM-reduced gradient in backward;
- **views**: what the modules hold while the boundary runs, each a slice of the buffer
  covering one or more entries, registered on ``module.<attr>`` and held between forwards
  by the *holder* (the record's registered parameter).

A boundary's whole matrices come first, grouped by owner (one span per owner, one view
per record: the holder is the record's master on its owner, a placeholder elsewhere),
then each stack split by experts, its ranges in expert order (one span per run of ranges
with one owner, one view of the whole stack: the holder is the stack's placeholder).

Whatever the number of owners, the buffer is **one collective call per direction**: in
forward (and again before backward in Z3) every owner's spans reach every rank in one
all-gather of uneven pieces (a broadcast when one rank owns them all), and in backward
every rank's gradients are summed into their owners in one reduce-scatter of uneven
pieces (a reduce for one owner); see `dmuon._comm.Communicator.all_gather_pieces`. So a
step issues as many calls as FSDP2 issues for the same layers, however many ranks own
them.

The buffer's storage is allocated before use and freed after, while the views into it
survive (as FSDP2 does for its unsharded parameters): autograd keeps references to the
views, and re-filling the storage before backward makes them valid again.

A rank without a gradient for a record (an expert that saw no token) still takes part in
the reduction, with a slice of *negative* zeros, and a rank with one contributes its
gradient plus ``+0.0`` (which turns any ``-0.0`` into ``+0.0``). IEEE sums give ``-0.0``
only when every term is ``-0.0``, so the owner's averaged gradient is all ``-0.0`` exactly
when no rank had a gradient for the record: the optimizer then leaves it alone, as torch's
optimizers leave a ``.grad`` of ``None`` (see `gradients.is_absent`), while a gradient of
zeros is still a gradient. The signal costs no extra element on the wire.

Only the methods here and `dmuon._ownership.gradients` write gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
from torch import nn

from dmuon._comm import Communicator, Pending
from dmuon._ownership import aliasing, gradients, one_process_reduce
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.tp_integration import local_grad


class BufferState(Enum):
    """Where a flat buffer's values stand (the forward / backward side)."""

    #: No storage; the views point at no memory.
    FREED = "freed"
    #: Storage, but not the owners' current values (they changed since the broadcast).
    STALE = "stale"
    #: A broadcast of the owners' values is in flight.
    UNSHARDING = "unsharding"
    #: Holds the owners' current values.
    VALID = "valid"


class ReduceState(Enum):
    """Where a flat buffer's gradient reduction stands (the backward side)."""

    #: Nothing in flight.
    IDLE = "idle"
    #: The SUM-reduce to the owners is in flight.
    REDUCING = "reducing"
    #: Owners sum across replicas (HSDP): the reduce-scatter is in flight.
    AVERAGING = "averaging"


@dataclass(eq=False)
class Entry:
    """One record's slice ``[lo, hi)`` of the buffer, inside span ``span``."""

    record: DedicatedParam
    lo: int
    hi: int
    span: int = 0


@dataclass(eq=False)
class Span:
    """One collective: entries ``entries`` (indices), data ``[lo, hi)``, owned by ``owner``."""

    owner: int
    lo: int
    hi: int
    entries: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of the span's data."""
        return self.hi - self.lo


@dataclass(eq=False)
class View:
    """What ``module.<attr>`` holds while the boundary runs: ``leaf``, buffer ``[lo, hi)``.

    ``holder`` is the parameter the module holds between forwards; ``entries`` the
    indices of the entries the view covers, in order.
    """

    module: nn.Module
    attr: str
    holder: nn.Parameter
    leaf: nn.Parameter
    lo: int
    hi: int
    entries: list[int]
    name: str


#: Wraps a slice of the buffer (shaped like the view) into the parameter a module uses,
#: given ``requires_grad`` and the view's first record (a DTensor under tensor parallelism).
LeafFactory = Callable[[torch.Tensor, bool, DedicatedParam], nn.Parameter]


def plain_leaf(view: torch.Tensor, requires_grad: bool, _record: DedicatedParam) -> nn.Parameter:
    """A plain parameter over ``view`` (the layouts without tensor parallelism)."""
    return nn.Parameter(view, requires_grad=requires_grad)


class FlatBuffer:
    """Broadcast buffer and gradient reduction for a list of spans (see the module doc)."""

    def __init__(
        self,
        entries: list[Entry],
        spans: list[Span],
        views: list[View],
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
        reduce_dtype: torch.dtype = torch.float32,
        broadcast_dtype: torch.dtype | None = None,
    ) -> None:
        self.entries = entries
        #: The dtype gradients are summed in on the wire (the accumulation stays float32).
        self.reduce_dtype = reduce_dtype
        #: The dtype matrices are broadcast in (``None``: the buffer's).
        self.broadcast_dtype = None if broadcast_dtype in (None, dtype) else broadcast_dtype
        self._requested_broadcast_dtype = broadcast_dtype
        self._make_leaf: LeafFactory = plain_leaf
        self._staging: torch.Tensor | None = None
        self.spans = spans
        self.views = views
        self.comm = comm
        self.numel = spans[-1].hi if spans else 0
        self.buffer = torch.empty(self.numel, dtype=dtype, device=device)
        self._nbytes = self.numel * self.buffer.element_size()
        self.state = BufferState.STALE
        #: One process: the masters are views of this buffer (`dmuon._ownership.aliasing`).
        self.aliased = False
        self.reduce_state = ReduceState.IDLE
        self._gathers: list[Pending] = []
        self._reduces: list[Pending] = []
        self._reduce_flat: torch.Tensor | None = None
        #: Where this rank's sums land (its spans back to back) once the reduce completes.
        self._received: torch.Tensor | None = None
        #: The averaged values that landed here and the entries they hold, back to back
        #: (none, or one pair: this rank's records).
        self._landed: list[tuple[torch.Tensor, list[int]]] = []
        #: The reduce input's layout: where each entry that needs gradients starts, and
        #: each span's ``(lo, hi)`` (see `reduce_async`).
        self._packed_lo: dict[int, int] = {}
        self._packed_spans: list[tuple[int, int]] = []
        #: Whether this backward's sums go on across replicas (HSDP); ``False`` under
        #: ``no_sync(model, scope="replicas")``: they wait, summed, in `_replica_sums`.
        self.replica_sync = True
        #: Per entry this rank owns: the sums inside its replica of the micro-batches whose
        #: crossing between replicas waits for the step's last one (float32).
        self._replica_sums: dict[int, torch.Tensor] = {}
        self._broadcast_versions: dict[int, int] = {}
        #: Named in errors: the hook boundary and its matrices.
        self.label = ""
        if entries:
            first = entries[0].record
            more = f" and {len(entries) - 1} more" if len(entries) > 1 else ""
            self.label = f", hook boundary {first.boundary or '<root>'!r}: {first.name}{more}"

    @classmethod
    def build(
        cls,
        records: list[DedicatedParam],
        views: list[tuple[nn.Module, str, nn.Parameter, list[int], str]],
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
        make_leaf: LeafFactory = plain_leaf,
        reduce_dtype: torch.dtype = torch.float32,
        broadcast_dtype: torch.dtype | None = None,
    ) -> FlatBuffer:
        """Lay ``records`` out back to back; one span per run of records with one owner.

        ``views`` lists ``(module, attr, holder, record indices, name)``: each view covers
        consecutive records, shaped like the holder's full tensor (the records' shape, or a
        split stack's whole shape).
        """
        entries: list[Entry] = []
        spans: list[Span] = []
        offset = 0
        for index, record in enumerate(records):
            entry = Entry(record, offset, offset + record.numel)
            if not spans or spans[-1].owner != record.owner:
                spans.append(Span(record.owner, offset, offset))
            spans[-1].hi = entry.hi
            spans[-1].entries.append(index)
            entry.span = len(spans) - 1
            entries.append(entry)
            offset = entry.hi
        flat = cls(entries, spans, [], dtype, device, comm, reduce_dtype, broadcast_dtype)
        flat._make_leaf = make_leaf
        for module, attr, holder, covered, name in views:
            lo, hi = entries[covered[0]].lo, entries[covered[-1]].hi
            flat.views.append(
                View(module, attr, holder, flat._leaf_over(lo, hi, holder, covered[0]),
                     lo, hi, list(covered), name)
            )  # fmt: skip
        flat.free()  # the views were made on the storage; they stay when it goes
        aliasing.alias(flat)
        return flat

    def _leaf_over(self, lo: int, hi: int, holder: nn.Parameter, first: int) -> nn.Parameter:
        record = self.entries[first].record
        view = self.buffer[lo:hi].view(record.view_shape)
        return self._make_leaf(view, holder.requires_grad, record)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the forward computes with (the views')."""
        return self.buffer.dtype

    def retype(
        self, dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        """Compute in ``dtype``, reduce in ``reduce_dtype``, on ``device`` (default: here),
        holding no values or gradient yet; the views are made again over the new storage."""
        aliasing.unalias(self)
        if self.state is not BufferState.FREED or any(v.leaf.grad is not None for v in self.views):
            raise RuntimeError(f"a flat buffer{self.label} can change dtype only before use")
        self.reduce_dtype = reduce_dtype
        requested = self._requested_broadcast_dtype
        self.broadcast_dtype = None if requested in (None, dtype) else requested
        if (dtype, device or self.buffer.device) == (self.buffer.dtype, self.buffer.device):
            return aliasing.alias(self)
        self.buffer = torch.empty(self.numel, dtype=dtype, device=device or self.buffer.device)
        self._nbytes = self.numel * self.buffer.element_size()
        for view in self.views:
            view.leaf = self._leaf_over(view.lo, view.hi, view.holder, view.entries[0])
        self.state = BufferState.STALE
        self.free()
        aliasing.alias(self)

    # ----- what the boundary registers ----------------------------------------------------
    def sync_requires_grad(self) -> bool:
        """Give each leaf its holder's ``requires_grad`` (frozen and unfrozen since
        dedication); return whether any leaf needs a gradient."""
        needed = False
        for view in self.views:
            wanted = view.holder.requires_grad
            if view.leaf.requires_grad != wanted:
                view.leaf.requires_grad_(wanted)
            needed |= wanted
        return needed

    # ----- forward / backward parameters -------------------------------------------------
    @property
    def allocated(self) -> bool:
        """Whether the buffer currently holds storage."""
        return self.state is not BufferState.FREED

    def unshard_async(self) -> None:
        """Make sure a broadcast of the owners' current values is issued (or done)."""
        if self.state in (BufferState.VALID, BufferState.UNSHARDING):
            return
        if self.state is BufferState.FREED:
            self.buffer.untyped_storage().resize_(self._nbytes)
        # The buffer backs views that autograd saved; rewriting it must not count as an
        # in-place modification of those saved tensors.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.buffer):
            # With a broadcast dtype of its own, the values travel through a staging
            # buffer of that dtype, which every rank (the owners too) then copies in.
            wire = self.buffer
            if self.broadcast_dtype is not None:
                wire = self._staging = torch.empty(
                    self.numel, dtype=self.broadcast_dtype, device=self.buffer.device
                )
            for index, entry in enumerate(self.entries):
                record = entry.record
                if record.is_owned:
                    wire[entry.lo : entry.hi].copy_(record.param.reshape(-1))
                    self._broadcast_versions[index] = record.param._version
            ranges = [(span.lo, span.hi) for span in self.spans]
            self._gathers = [self.comm.all_gather_pieces(self._by_owner(wire, ranges), self.label)]
        self.state = BufferState.UNSHARDING

    def _by_owner(
        self, flat: torch.Tensor, ranges: list[tuple[int, int]]
    ) -> list[list[torch.Tensor]]:
        """``flat[lo:hi]`` of each span's range, listed under the span's owner (per rank of
        the group, in span order); empty ranges are left out."""
        pieces: list[list[torch.Tensor]] = [[] for _ in range(self.comm.world_size)]
        for span, (lo, hi) in zip(self.spans, ranges, strict=True):
            if hi > lo:
                pieces[span.owner].append(flat[lo:hi])
        return pieces

    def wait_unshard(self) -> None:
        """Wait for the gathers `unshard_async` issued (a broadcast where one rank owns all)."""
        if self.state is BufferState.UNSHARDING:
            # Stale until every broadcast is in: a failed one is raised once, not again by
            # the post-forward hook that frees the buffer.
            pending, self._gathers = self._gathers, []
            staging, self._staging = self._staging, None
            self.state = BufferState.STALE
            # Completing a collective may copy received pieces into the buffer.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.buffer):
                for each in pending:
                    each.wait()
                if staging is not None:
                    self.buffer.copy_(staging)
            self.state = BufferState.VALID

    def free(self) -> None:
        """Release the buffer's storage; the views stay, pointing at no memory."""
        self.wait_unshard()
        if self.state is not BufferState.FREED and not self.aliased:
            self.buffer.untyped_storage().resize_(0)
            self.state = BufferState.FREED

    def changed_since_broadcast(self) -> list[str]:
        """Owned records edited in place while their broadcast values are still in use."""
        if self.state is not BufferState.VALID or self.aliased:
            return []
        return [
            self.entries[index].record.name
            for index, version in self._broadcast_versions.items()
            if self.entries[index].record.param._version != version
        ]

    def invalidate(self) -> None:
        """The owners' values changed: the next use must broadcast again."""
        if self.aliased:  # the buffer is the masters; one may have been given new storage
            return aliasing.realias(self)
        self.wait_unshard()
        if self.state is BufferState.VALID:
            self.state = BufferState.STALE

    # ----- gradients -----------------------------------------------------------------------
    def _take_local_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for view in self.views:
            grad = view.leaf.grad
            view.leaf.grad = None
            grads.append(None if grad is None else local_grad(grad, view.leaf))
        return grads

    def accumulate_locally(self) -> None:
        """``no_sync``: add this backward's gradients to the holders' local totals."""
        for view, grad in zip(self.views, self._take_local_grads(), strict=True):
            if grad is not None:
                gradients.accumulate(view.holder, grad)

    def reduce_async(self) -> None:
        """Merge local and accumulated gradients; SUM-reduce them to their owners.

        Only the entries of views that need gradients travel (frozen matrices, such as an
        adapter's base weights, cost nothing): they are packed back to back, span by span,
        and a span with none is not reduced. ``requires_grad`` is the same on every rank,
        so the collectives are too. A record without a local gradient on this rank (an
        expert that saw no token) contributes negative zeros (see the module docstring):
        the collectives are the same on every rank whatever the data.
        """
        live = self._live_entries()
        grads = self._take_local_grads()
        if self.comm.total_ranks == 1 and one_process_reduce.applies(self, grads):
            one_process_reduce.take_as_averages(self, live, grads)
            self.reduce_state = ReduceState.IDLE
            return
        packed_numel = self._packed_spans[-1][1] if self._packed_spans else 0
        flat = torch.empty(packed_numel, dtype=self.reduce_dtype, device=self.buffer.device)
        for view, grad in zip(self.views, grads, strict=True):
            acc = gradients.take_accumulated(view.holder)
            gradients.mark(view.holder)
            if view.entries[0] not in live:
                continue
            lo = self._packed_lo[view.entries[0]]
            piece = flat[lo : lo + view.hi - view.lo]
            if grad is None and acc is None:
                piece.fill_(-0.0)
                continue
            if grad is None:
                piece.zero_()
            else:
                torch.add(grad.detach().reshape(-1), 0.0, out=piece)  # no -0.0 left
            if acc is not None:
                piece.add_(acc.reshape(-1))
        self._reduce_flat = flat
        pending, self._received = self.comm.reduce_scatter_pieces(
            self._by_owner(flat, self._packed_spans), self.label
        )
        self._reduces = [pending]
        self.reduce_state = ReduceState.REDUCING

    def _live_entries(self) -> set[int]:
        """The entries whose views need gradients; lays them out back to back in
        ``_packed_lo`` (per entry) and ``_packed_spans`` (per span, ``(lo, hi)``)."""
        live = {i for view in self.views if view.leaf.requires_grad for i in view.entries}
        self._packed_lo = {}
        self._packed_spans = []
        offset = 0
        for span in self.spans:
            start = offset
            for index in span.entries:
                if index in live:
                    self._packed_lo[index] = offset
                    offset += self.entries[index].hi - self.entries[index].lo
            self._packed_spans.append((start, offset))
        return live

    def finish_reduce(self) -> None:
        """Wait for the reduce; on a 2-D (HSDP) mesh owners then start summing across
        replicas.

        The sums of this rank's records are reduce-scattered over the replicate group by
        record: every record's sum lands on the owner in its ``update_replica`` alone (the
        one that steps it). `finish_replica_reduce` completes the step; the split lets
        every boundary's cross-replica reduce be in flight at once.
        """
        if self.reduce_state is not ReduceState.REDUCING:
            return
        for pending in self._reduces:
            pending.wait()
        self._reduces = []
        received, self._received = self._received, None
        mine = [
            index
            for span in self.spans
            if span.owner == self.comm.rank
            for index in span.entries
            if index in self._packed_lo
        ]
        self._landed = []
        if received is None or not mine:
            self._release_reduce_flat(None)
            self.reduce_state = ReduceState.IDLE
            return
        if self.comm.replicas == 1:
            self._landed.append((received, mine))
            self._release_reduce_flat(received)
        else:
            by_replica: list[list[int]] = [[] for _ in range(self.comm.replicas)]
            offsets, offset = {}, 0
            for index in mine:
                offsets[index] = offset
                offset += self.entries[index].hi - self.entries[index].lo
                by_replica[self.entries[index].record.update_replica].append(index)

            def values(index: int) -> torch.Tensor:
                lo = offsets[index]
                return received[lo : lo + self.entries[index].hi - self.entries[index].lo]

            if not self.replica_sync:
                hold_replica_sums(self._replica_sums, mine, values)
                self._release_reduce_flat(None)
                self.reduce_state = ReduceState.IDLE
                return
            add_held_sums(self._replica_sums, mine, values, self.entries)

            pieces = [
                torch.cat([values(i) for i in indices]) if indices else received[:0]
                for indices in by_replica
            ]
            here = by_replica[self.comm.replica_rank]
            landed = torch.empty_like(pieces[self.comm.replica_rank])
            self._reduces.append(self.comm.reduce_scatter_replicas(landed, pieces, self.label))
            self._landed.append((landed, here))
            self._release_reduce_flat(None)
        self.reduce_state = ReduceState.AVERAGING

    def drop_held_sums(self) -> None:
        """Forget the held sums (``zero_grad``)."""
        self._replica_sums.clear()

    def _release_reduce_flat(self, kept: torch.Tensor | None) -> None:
        """Free the reduce input unless ``kept`` (the averages' future home) lies in it."""
        self._reduce_flat = _released(self._reduce_flat, kept)

    def finish_replica_reduce(self) -> None:
        """Wait for the cross-replica sums; the updating owners average into
        ``_reduced_grad``."""
        if self.reduce_state is not ReduceState.AVERAGING:
            return
        for pending in self._reduces:
            pending.wait()
        self._reduces = []
        divisor = self.comm.world_size * self.comm.replicas
        holders = {index: view.holder for view in self.views for index in view.entries}
        # The averages are views of what landed here: this rank's records alone, in a
        # tensor of their own or in the reduce input of a buffer this rank owns whole.
        for values, indices in self._landed:
            if values.dtype != torch.float32:  # summed in a narrower dtype on the wire
                values = values.float()
            values.div_(divisor)
            offset = 0
            for index in indices:
                entry = self.entries[index]
                size = entry.hi - entry.lo
                piece = values[offset : offset + size].view(entry.record.shape)
                offset += size
                gradients.add_reduced(entry.record.param, piece, holders[index])
        landed = self._landed[0][0] if self._landed else None
        self._landed = []
        # Widened averages were copied out of the reduce input; float32 ones may be views
        # of it, which then hold its memory themselves.
        kept = landed if landed is not None and landed.dtype == torch.float32 else None
        self._release_reduce_flat(kept)
        self._reduce_flat = None
        self.reduce_state = ReduceState.IDLE


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def release_reduce_input(flat: torch.Tensor | None) -> None:
    """Free a finished reduce's input now: its work handle, kept a little longer by the
    `Communicator` (see `dmuon._comm.Pending`), would otherwise keep the memory too."""
    if flat is not None:
        flat.untyped_storage().resize_(0)


def hold_replica_sums(
    held: dict[int, torch.Tensor], mine: list[int], values: Callable[[int], torch.Tensor]
) -> None:
    """Keep a micro-batch's sums of entries ``mine`` inside the replica, added to the
    earlier ones in ``held``, for the step's last micro-batch to send across replicas (one
    float32 value per owned element: P_M / S on average). A first sum is kept as it came,
    so an entry no rank had a gradient for stays negative zero (see the module docstring).
    """
    for index in mine:
        kept = held.get(index)
        if kept is None:
            held[index] = values(index).float().clone()
        else:
            kept.add_(values(index))


def add_held_sums(
    held: dict[int, torch.Tensor],
    mine: list[int],
    values: Callable[[int], torch.Tensor],
    entries: list[Entry],
) -> None:
    """Add the sums ``held`` from the window's earlier micro-batches to this one's (and
    forget them); an entry held but not in ``mine`` stopped needing gradients mid-window:
    that raises."""
    if not held:
        return
    for index in mine:
        kept = held.pop(index, None)
        if kept is not None:
            values(index).add_(kept.to(values(index).dtype))
    if held:
        names = [entries[i].record.name for i in held]
        held.clear()
        raise RuntimeError(
            f"{names[:3]} stopped needing gradients (requires_grad) in the middle of an "
            "accumulation window run under dmuon.no_sync(model, scope='replicas'): their "
            "earlier micro-batches' gradients cannot be sent on. Freeze or unfreeze "
            "parameters between optimizer steps."
        )


def _released(flat: torch.Tensor | None, kept: torch.Tensor | None) -> torch.Tensor | None:
    """Free the reduce input ``flat`` unless ``kept`` lies in it; what is still held."""
    if flat is None:
        return None
    if kept is not None and _same_storage(kept, flat):
        return flat
    release_reduce_input(flat)
    return None
