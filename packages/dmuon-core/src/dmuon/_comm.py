"""The only place DMuon issues collectives, and the audit of what it sent.

One code path, two transports. Every collective is issued asynchronously and returns a
`Pending` handle that is waited on where the data is needed:

- CPU / gloo: the work handle of an ``async_op=True`` collective.
- CUDA / NCCL: the collective is issued from a dedicated communication stream after an
  event recorded on the compute stream (so it sees the producer's writes); waiting makes
  the compute stream wait on the collective, without blocking the host.

Averages are SUM followed by a division on the receiving side: gloo's AVG is not reliable
across versions.

With ``check_collectives`` (``dedicate_params(..., check_collectives=True)`` or the
environment variable ``DMUON_CHECK_COLLECTIVES=1``) every collective is preceded by a small
all-gather of its signature (sequence number, kind, size, root), and every rank raises the
same error at the first collective on which the ranks disagree, instead of mixing data or
hanging. It costs one extra synchronous collective each, so it is for debugging.

A hook boundary's matrices travel in one call per direction whatever the number of their
owners (`Communicator.all_gather_pieces`, `Communicator.reduce_scatter_pieces`): each
owner's pieces are one part of an all-gather or reduce-scatter of uneven parts, which NCCL
runs as one group of broadcasts or reduces.

On a 2-D ``(replicate, shard)`` mesh (HSDP) these run inside the shard group, and the
owners of a matrix (one per replica, at the same shard rank) sum its gradient with one
reduce-scatter over the replicate group, into the one replica that updates it, and
all-gather the step's updates after the optimizer step. The audit keeps
the two dimensions apart: `StepComm.by_kind` and `StepComm.units` describe the shard
dimension (the whole traffic of a 1-D mesh), `StepComm.replicate` the replicate dimension.

Checkpoint transfers (`Communicator.scatter_rows`, `gather_rows`, `send`, `recv`,
`broadcast_now`, `all_gather_codes`) are synchronous and are not part of the per-step
audit: they move state between owners and state-dict layouts, not training traffic.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from dmuon._comm_audit import CONTROL, REPLICATE, SHARD, TENSOR, CommAudit
from dmuon._comm_blocks import BlockCollectives
from dmuon._comm_collectives import check_signatures, uneven_all_gather
from dmuon._comm_pending import (
    RECENT_WORK_KEPT,
    Pending,
    joined,
    scatter_into,
)


def all_reduce_plain(
    tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup
) -> None:
    """All-reduce ``tensor`` over ``group`` and wait, for a model without a dedication (no
    communicator to check or audit it)."""
    dist.all_reduce(tensor, op=op, group=group)


def separate_group(group: dist.ProcessGroup, other: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group``, or a new process group over its ranks when it shares ranks with ``other``.

    ``group``'s members call this, all at the same point of their schedule. A group of
    every rank is made as the default group's members make any group; a smaller one by
    its members alone (``use_local_synchronization``), which torch names from how many
    groups each member has made, so ranks that made different numbers of groups of their
    own (a user's subgroup) would not meet there.
    """
    ranks = dist.get_process_group_ranks(group)
    if not set(ranks) & set(dist.get_process_group_ranks(other)):
        return group
    every_rank = len(ranks) == dist.get_world_size()
    return dist.new_group(ranks=ranks, use_local_synchronization=not every_rank)


class Communicator(BlockCollectives):
    """Collectives over one process group (and its replicate group under HSDP), audited.

    With no process group (one process) every call is a no-op that returns a finished
    `Pending`, so the single-process path runs the same code. ``replicate_group`` links
    this rank to the ranks at the same position of the other replicas of a 2-D mesh
    (``None``: one replica).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        audit: CommAudit,
        check_collectives: bool = False,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.replica_rank = dist.get_rank(replicate_group) if replicate_group is not None else 0
        self.device = device
        self.audit = audit
        self.check_collectives = check_collectives
        self._sequence: dict[str, int] = defaultdict(int)
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._recent_work: deque[dist.Work] = deque(maxlen=RECENT_WORK_KEPT)

    def move_to(self, device: torch.device) -> None:
        """Compute on ``device`` from now on (one process: nothing is sent)."""
        if device == self.device:
            return
        if self.group is not None or self.replicate_group is not None:
            raise ValueError(f"a communicator over a process group stays on {self.device}")
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def separate_from(self, other: dist.ProcessGroup) -> None:
        """Issue collectives on process groups of their own where this communicator's share
        ranks with ``other`` (the group of a DDP wrapper), so that neither schedule can
        interleave with the other. Every rank calls it at the same point."""
        if self.group is not None:
            self.group = separate_group(self.group, other)
        if self.replicate_group is not None:
            self.replicate_group = separate_group(self.replicate_group, other)

    def _global(self, group_rank: int) -> int:
        assert self.group is not None
        return dist.get_global_rank(self.group, group_rank)

    def _check_same_everywhere(
        self,
        kind: str,
        tensor: torch.Tensor,
        root: int,
        dim: str = SHARD,
        numel: int | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        """With ``check_collectives``, all-gather this collective's signature and raise on
        every rank if the ranks disagree (nothing otherwise).

        ``group`` is the collective's own group when it is not ``dim``'s (tensor
        parallelism's, or one of the groups a gradient norm is summed over)."""
        if not self.check_collectives:
            return
        if group is None:
            group = self.group if dim == SHARD else self.replicate_group
        # Each dimension counts its own collectives: only owners take part in the
        # replicate dimension's, so one counter would drift apart between shard ranks.
        self._sequence[dim] += 1
        signature = (self._sequence[dim], kind, tensor.numel() if numel is None else numel, root)
        check_signatures(signature, group, self.device)

    def _issue(
        self,
        kind: str,
        tensor: torch.Tensor,
        root: int,
        call: Callable[[], dist.Work | None],
        dim: str = SHARD,
        what: str = "",
        numel: int | None = None,
        group: dist.ProcessGroup | None = None,
        then: Callable[[], None] | None = None,
        values: int | None = None,
    ) -> Pending:
        self._check_same_everywhere(kind, tensor, root, dim, numel, group)
        if values is None:
            self.audit.record(kind, tensor, dim, numel)
        else:  # values packed as bytes: the audit counts the values and the bytes
            moved = (tensor.numel() if numel is None else numel) * tensor.element_size()
            self.audit.record(kind, tensor, dim, values, moved)
        elements = tensor.numel() if numel is None else numel
        rooted = f"root {root}, " if root >= 0 else ""
        label = f"{kind} of {elements} elements ({rooted}{dim} group{what})"
        if self._stream is None:
            return Pending(call(), self._recent_work, label, then)
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            work = call()
        return Pending(work, self._recent_work, label, then)

    def reduce_sum(self, tensor: torch.Tensor, dst: int, what: str = "") -> Pending:
        """Sum ``tensor`` over ranks into group rank ``dst`` (in place there)."""
        if self.world_size == 1:
            return Pending()
        return self._issue(
            "reduce",
            tensor,
            dst,
            lambda: dist.reduce(
                tensor, self._global(dst), op=dist.ReduceOp.SUM, group=self.group, async_op=True
            ),
            what=what,
        )

    def _group_of(self, dim: str) -> tuple[dist.ProcessGroup | None, int]:
        """The process group of mesh dimension ``dim`` and this rank's place in it."""
        if dim == SHARD:
            return self.group, self.rank
        return self.replicate_group, self.replica_rank

    def all_gather_pieces(
        self,
        pieces: Sequence[Sequence[torch.Tensor]],
        what: str = "",
        dim: str = SHARD,
        values: int | None = None,
    ) -> Pending:
        """Every rank's pieces to every rank, in one collective call.

        ``pieces[r]`` are the contiguous tensors rank ``r`` sends (on ``r``, their values;
        elsewhere, where they land); every rank passes pieces of the same sizes. ``values``,
        given, is how many values the pieces carry packed (the audit counts those, and the
        bytes that moved). This is a
        broadcast from every rank that has something to send: one ``broadcast`` when only
        one rank has, else one all-gather of uneven pieces (NCCL runs it as one group of
        broadcasts; gloo, which has none, as one all-to-all that moves the same elements).
        Nothing is issued when no rank has anything to send.
        """
        group, me = self._group_of(dim)
        sizes = [sum(p.numel() for p in part) for part in pieces]
        senders = [r for r, n in enumerate(sizes) if n]
        if len(pieces) == 1 or not senders:
            return Pending()
        if len(senders) == 1:
            root = senders[0]
            wire = joined(pieces[root], me == root, pieces[root][0])
            fill = None if len(pieces[root]) == 1 or me == root else (wire, pieces[root])
            return self._issue(
                "broadcast",
                wire,
                root,
                lambda: dist.broadcast(
                    wire, dist.get_global_rank(group, root), group=group, async_op=True
                ),
                dim=dim,
                what=what,
                then=None if fill is None else lambda: scatter_into(*fill),
                values=values,
            )
        send, call, then = uneven_all_gather(pieces, sizes, me, group)
        return self._issue(
            "all_gather",
            send,
            -1,
            call,
            dim=dim,
            what=what,
            numel=sum(sizes),
            then=then,
            values=values,
        )

    def reduce_scatter_pieces(
        self, pieces: Sequence[Sequence[torch.Tensor]], what: str = ""
    ) -> tuple[Pending, torch.Tensor | None]:
        """Sum every rank's ``pieces[r]`` into rank ``r``, in one collective call.

        ``pieces[r]`` are the contiguous tensors destined to rank ``r``; every rank passes
        pieces of the same sizes. Returns the pending collective and the tensor that holds
        this rank's sums (its pieces back to back) once it completes, or ``None`` when it
        receives nothing. One ``reduce`` when only one rank receives (in place there, on a
        single piece), else one reduce-scatter of uneven pieces (NCCL runs it as one group
        of reduces).
        """
        sizes = [sum(p.numel() for p in part) for part in pieces]
        receivers = [r for r, n in enumerate(sizes) if n]
        if not receivers:
            return Pending(), None
        like = pieces[receivers[0]][0]
        if len(pieces) == 1:
            return Pending(), joined(pieces[0], True, like)
        if len(receivers) == 1:
            root = receivers[0]
            wire = joined(pieces[root], True, like)
            return self.reduce_sum(wire, root, what), wire if self.rank == root else None
        inputs = [joined(mine, True, like) for mine in pieces]
        output = torch.empty_like(inputs[self.rank])
        pending = self._reduce_scatter(output, inputs, SHARD, what)
        return pending, output if sizes[self.rank] else None

    def _reduce_scatter(
        self, output: torch.Tensor, inputs: list[torch.Tensor], dim: str, what: str
    ) -> Pending:
        """SUM-reduce-scatter ``inputs`` (one per rank of ``dim``'s group) into ``output``."""
        group, _ = self._group_of(dim)
        return self._issue(
            "reduce_scatter",
            output,
            -1,
            lambda: dist.reduce_scatter(
                output, inputs, op=dist.ReduceOp.SUM, group=group, async_op=True
            ),
            dim=dim,
            what=what,
            numel=sum(piece.numel() for piece in inputs),
        )

    def reduce_scatter_replicas(
        self, output: torch.Tensor, inputs: list[torch.Tensor], what: str = ""
    ) -> Pending:
        """Sum ``inputs[r]`` over the replicate group into replica ``r``'s ``output``.

        The pieces may differ in size (one replica may get nothing): replica ``r`` passes
        an ``output`` of ``inputs[r]``'s size. Every replica passes pieces of the same sizes.
        """
        if self.replicas == 1:
            output.copy_(inputs[0])
            return Pending()
        return self._reduce_scatter(output, inputs, REPLICATE, what)

    def all_reduce_control(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp.RedOpType,
        group: dist.ProcessGroup,
        sequence: str = CONTROL,
    ) -> None:
        """Reduce a small control tensor (a gradient norm) over ``group`` and wait.

        Audited apart from the matrices' traffic (`StepComm.control`). ``sequence`` is the
        counter the collective-order check numbers it by: every rank of ``group`` must
        issue the same collectives counted there (`TENSOR` for a tp group's own)."""
        self._check_same_everywhere("all_reduce", tensor, 0, sequence, group=group)
        self.audit.record("all_reduce", tensor, CONTROL)
        dist.all_reduce(tensor, op=op, group=group)

    def gather_tensor_parallel(
        self,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        dst: int,
        group: dist.ProcessGroup,
        numel: int,
    ) -> Pending:
        """Gather ``tensor`` from the ranks of a tensor-parallel ``group`` into ``chunks`` on
        its rank ``dst``; audited as ``numel`` elements (the whole matrix) over tp."""
        return self._issue(
            "gather",
            tensor,
            dst,
            lambda: dist.gather(
                tensor, chunks, dst=dist.get_global_rank(group, dst), group=group, async_op=True
            ),
            dim=TENSOR,
            numel=numel,
            group=group,
        )

    def scatter_tensor_parallel(
        self,
        out: torch.Tensor,
        parts: list[torch.Tensor] | None,
        src: int,
        group: dist.ProcessGroup,
        numel: int,
    ) -> Pending:
        """Scatter ``parts`` (given on rank ``src`` of a tensor-parallel ``group``) into
        each rank's ``out``; audited as ``numel`` elements over tp."""
        return self._issue(
            "scatter",
            out,
            src,
            lambda: dist.scatter(
                out, parts, src=dist.get_global_rank(group, src), group=group, async_op=True
            ),
            dim=TENSOR,
            numel=numel,
            group=group,
        )

    # ----- checkpoint transfers: synchronous, not audited ---------------------------------
    def _checked(self, kind: str, tensor: torch.Tensor, root: int) -> None:
        self._check_same_everywhere(kind, tensor, root)

    def scatter_rows(self, chunks: list[torch.Tensor] | None, out: torch.Tensor, src: int) -> None:
        """Scatter equally sized ``chunks`` (given on group rank ``src`` only) into ``out``."""
        self._check_same_everywhere("scatter", out, src)
        dist.scatter(out, chunks, src=self._global(src), group=self.group)

    def gather_rows(self, chunk: torch.Tensor, chunks: list[torch.Tensor] | None, dst: int) -> None:
        """Gather every rank's equally sized ``chunk`` into ``chunks`` on group rank ``dst``."""
        self._check_same_everywhere("gather", chunk, dst)
        dist.gather(chunk, chunks, dst=self._global(dst), group=self.group)

    def gather_on(
        self,
        chunk: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        dst: int,
        group: dist.ProcessGroup,
    ) -> None:
        """Gather ``chunk`` into ``chunks`` on rank ``dst`` of another ``group`` (tensor
        parallelism's) and wait."""
        self._check_same_everywhere("gather", chunk, dst, TENSOR, group=group)
        dist.gather(chunk, chunks, dst=dist.get_global_rank(group, dst), group=group)

    def broadcast_on(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
        """Broadcast ``tensor`` from rank ``src`` of another ``group`` and wait."""
        self._check_same_everywhere("broadcast", tensor, src, TENSOR, group=group)
        dist.broadcast(tensor, dist.get_global_rank(group, src), group=group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst`` (point to point)."""
        dist.send(tensor, self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive ``tensor`` in place from group rank ``src`` (point to point)."""
        dist.recv(tensor, self._global(src), group=self.group)

    def broadcast_now(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` from group rank ``src`` and wait for it."""
        self._check_same_everywhere("broadcast", tensor, src)
        dist.broadcast(tensor, self._global(src), group=self.group)

    def broadcast_object(self, obj: object, src: int) -> object:
        """Broadcast a picklable object from group rank ``src``; every rank gets it."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    @property
    def is_rank0(self) -> bool:
        """Whether this is the first rank of the whole mesh (shard rank 0 of replica 0)."""
        return self.rank == 0 and self.replica_rank == 0

    @property
    def total_ranks(self) -> int:
        """Ranks of the whole mesh: shard group size x replicas."""
        return self.world_size * self.replicas

    def broadcast_object_from_rank0(self, obj: object) -> object:
        """Broadcast a picklable object from `is_rank0`'s rank to every rank of the mesh."""
        if self.rank == 0 and self.replicas > 1:
            box = [obj]
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.replicate_group, 0), group=self.replicate_group
            )
            obj = box[0]
        if self.world_size > 1:
            obj = self.broadcast_object(obj, 0)
        return obj

    def broadcast_from_rank0_now(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from `is_rank0`'s rank to every rank of the mesh, and wait."""
        if self.rank == 0 and self.replicas > 1:
            self.broadcast_replicas_now(tensor, 0)
        if self.world_size > 1:
            self.broadcast_now(tensor, 0)

    def broadcast_replicas_now(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` over the replicate group from replica ``src``, and wait."""
        if self.replicas == 1:
            return
        self._check_same_everywhere("broadcast", tensor, src, REPLICATE)
        dist.broadcast(
            tensor, dist.get_global_rank(self.replicate_group, src), group=self.replicate_group
        )

    def all_gather_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """All-gather a 1-D int64 tensor; returns a ``(world_size, len)`` tensor."""
        codes = codes.to(self.device)
        self._check_same_everywhere("all_gather", codes, 0)
        out = [torch.empty_like(codes) for _ in range(self.world_size)]
        dist.all_gather(out, codes, group=self.group)
        return torch.stack(out).cpu()
