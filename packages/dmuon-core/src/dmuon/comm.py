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

Checkpoint transfers (`Communicator.scatter_rows`, `gather_rows`, `send`, `recv`,
`broadcast_now`, `all_gather_codes`) are synchronous and are not part of the per-step
audit: they move state between owners and state-dict layouts, not training traffic.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_KIND_CODES = {
    "broadcast": 1,
    "reduce": 2,
    "all_gather": 3,
    "reduce_scatter": 4,
    "all_reduce": 5,
    "scatter": 6,
    "gather": 7,
}

#: How many "units" one collective of E elements costs, in units of (N-1)/N x E.
_UNITS_PER_ELEMENT = {
    "broadcast": 1,
    "reduce": 1,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all_reduce": 2,
}


@dataclass
class CollectiveTally:
    """Count, elements and bytes of one kind of collective."""

    count: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class StepComm:
    """Collectives issued for dedicated parameters during one optimizer step."""

    dedicated_elements: int
    by_kind: dict[str, CollectiveTally] = field(
        default_factory=lambda: defaultdict(CollectiveTally)
    )

    @property
    def units(self) -> float:
        """Traffic in units of (N-1)/N x P_M elements, P_M = all dedicated elements."""
        if self.dedicated_elements == 0:
            return 0.0
        moved = sum(_UNITS_PER_ELEMENT[kind] * t.elements for kind, t in self.by_kind.items())
        return moved / self.dedicated_elements

    def count(self, kind: str) -> int:
        """Number of collectives of ``kind`` (``"broadcast"``, ``"reduce"``, ...)."""
        return self.by_kind[kind].count if kind in self.by_kind else 0

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly summary: per-kind tallies and the total in units."""
        return {
            "units": self.units,
            "dedicated_elements": self.dedicated_elements,
            "collectives": {
                kind: {"count": t.count, "elements": t.elements, "bytes": t.bytes}
                for kind, t in sorted(self.by_kind.items())
            },
        }


class CommAudit:
    """Per-optimizer-step record of the collectives DMuon issued for dedicated parameters.

    ``current`` collects what was sent since the last optimizer step; ``Muon.step()`` closes
    it into ``steps`` (one `StepComm` per optimizer step). ``total`` counts everything.
    """

    def __init__(self, dedicated_elements: int) -> None:
        self.dedicated_elements = dedicated_elements
        self.current = StepComm(dedicated_elements)
        self.total = StepComm(dedicated_elements)
        self.steps: list[StepComm] = []

    def record(self, kind: str, tensor: torch.Tensor) -> None:
        """Add one collective of ``kind`` that moved ``tensor``."""
        for tally in (self.current.by_kind[kind], self.total.by_kind[kind]):
            tally.count += 1
            tally.elements += tensor.numel()
            tally.bytes += tensor.numel() * tensor.element_size()

    def close_step(self) -> StepComm:
        """End the current optimizer step; return its record."""
        finished, self.current = self.current, StepComm(self.dedicated_elements)
        self.steps.append(finished)
        return finished

    def last_step(self) -> StepComm:
        """The record of the most recent finished optimizer step."""
        if not self.steps:
            raise ValueError("no optimizer step has finished yet; call optimizer.step() first")
        return self.steps[-1]


class Pending:
    """A collective in flight. ``wait()`` makes its result visible to the caller."""

    def __init__(self, work: dist.Work | None = None) -> None:
        self._work = work

    def wait(self) -> None:
        """Block (gloo) or order the current CUDA stream (NCCL) after the collective."""
        if self._work is not None:
            self._work.wait()
            self._work = None


class Communicator:
    """Collectives over one process group, device aware, audited.

    With no process group (one process) every call is a no-op that returns a finished
    `Pending`, so the single-process path runs the same code.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        audit: CommAudit,
        check_collectives: bool = False,
    ) -> None:
        self.group = group
        self.device = device
        self.audit = audit
        self.check_collectives = check_collectives
        self._sequence = 0
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world_size = dist.get_world_size(group) if group is not None else 1
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _global(self, group_rank: int) -> int:
        assert self.group is not None
        return dist.get_global_rank(self.group, group_rank)

    def _check_same_everywhere(self, kind: str, tensor: torch.Tensor, root: int) -> None:
        """All-gather this collective's signature; raise on every rank if ranks disagree."""
        self._sequence += 1
        mine = torch.tensor(
            [self._sequence, _KIND_CODES[kind], tensor.numel(), root],
            dtype=torch.int64,
            device=self.device,
        )
        every = torch.empty(self.world_size * 4, dtype=torch.int64, device=self.device)
        dist.all_gather_single(every, mine, group=self.group)
        rows = every.view(self.world_size, 4).tolist()
        if any(row != rows[0] for row in rows):
            names = {code: name for name, code in _KIND_CODES.items()}
            lines = "; ".join(
                f"rank {r}: #{seq} {names.get(code, code)} of {numel} elements, root {root}"
                for r, (seq, code, numel, root) in enumerate(rows)
            )
            raise RuntimeError(
                "DMuon's ranks are about to issue different collectives (" + lines + "). "
                "Something rank-local changed the schedule: make every rank run the same "
                "forwards and backwards (same hook boundaries, same no_sync blocks)."
            )

    def _issue(self, kind: str, tensor: torch.Tensor, root: int, call) -> Pending:
        if self.check_collectives:
            self._check_same_everywhere(kind, tensor, root)
        self.audit.record(kind, tensor)
        if self._stream is None:
            return Pending(call())
        ready = torch.cuda.Event()
        ready.record()
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            work = call()
        return Pending(work)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        """Broadcast ``tensor`` in place from group rank ``src`` to every rank."""
        if self.world_size == 1:
            return Pending()
        return self._issue(
            "broadcast",
            tensor,
            src,
            lambda: dist.broadcast(tensor, self._global(src), group=self.group, async_op=True),
        )

    def reduce_sum(self, tensor: torch.Tensor, dst: int) -> Pending:
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
        )

    # ----- checkpoint transfers: synchronous, not audited ---------------------------------
    def _checked(self, kind: str, tensor: torch.Tensor, root: int) -> None:
        if self.check_collectives:
            self._check_same_everywhere(kind, tensor, root)

    def scatter_rows(self, chunks: list[torch.Tensor] | None, out: torch.Tensor, src: int) -> None:
        """Scatter equally sized ``chunks`` (given on group rank ``src`` only) into ``out``."""
        self._checked("scatter", out, src)
        dist.scatter(out, chunks, src=self._global(src), group=self.group)

    def gather_rows(self, chunk: torch.Tensor, chunks: list[torch.Tensor] | None, dst: int) -> None:
        """Gather every rank's equally sized ``chunk`` into ``chunks`` on group rank ``dst``."""
        self._checked("gather", chunk, dst)
        dist.gather(chunk, chunks, dst=self._global(dst), group=self.group)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to group rank ``dst`` (point to point)."""
        dist.send(tensor, self._global(dst), group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive ``tensor`` in place from group rank ``src`` (point to point)."""
        dist.recv(tensor, self._global(src), group=self.group)

    def broadcast_now(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` from group rank ``src`` and wait for it."""
        self._checked("broadcast", tensor, src)
        dist.broadcast(tensor, self._global(src), group=self.group)

    def broadcast_object(self, obj: object, src: int) -> object:
        """Broadcast a picklable object from group rank ``src``; every rank gets it."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

    def all_gather_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """All-gather a 1-D int64 tensor; returns a ``(world_size, len)`` tensor."""
        codes = codes.to(self.device)
        self._checked("all_gather", codes, 0)
        out = [torch.empty_like(codes) for _ in range(self.world_size)]
        dist.all_gather(out, codes, group=self.group)
        return torch.stack(out).cpu()
