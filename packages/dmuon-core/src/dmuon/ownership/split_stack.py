"""One expert stack split across owners: one stack-wide buffer, one collective per range.

The planner may cut a large 3-D expert stack into contiguous ranges of experts owned by
different ranks. Forward and backward still need the whole stack on every rank, so the
stack gets one buffer of its full shape; each range is a contiguous slice of it (experts
are the leading dimension), broadcast by the range's owner and, in backward, SUM-reduced
to that owner. Every rank issues these collectives range by range, in expert order, at
the same point of the schedule as the packed groups of its boundary, whatever routing
did (an expert without a local gradient contributes zeros).

Local accumulation under `no_sync` covers the whole stack on every rank; it is kept on
the stack's registered placeholder (``_accumulated_grad``), which ``zero_grad`` clears
like any dedicated gradient.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from dmuon.comm import Communicator, Pending
from dmuon.ownership.packed_group import (
    accumulate_into,
    add_reduced,
    merge_into,
    release_reduce_input,
)
from dmuon.ownership.param import DedicatedParam


class SplitStack:
    """Broadcast buffer and gradient reduction for the ranges of one split expert stack."""

    def __init__(
        self,
        ranges: list[DedicatedParam],
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
    ) -> None:
        self.params = sorted(ranges, key=lambda dp: dp.experts or (0, 0))
        first = self.params[0]
        assert first.registered is not None and first.stack_shape is not None
        self.module, self.attr = first.module, first.attr
        self.registered = first.registered
        self.shape = first.stack_shape
        self.comm = comm
        self.numel = self.shape.numel()
        per_expert = self.numel // int(self.shape[0])
        self.bounds = [
            (dp.experts[0] * per_expert, dp.experts[1] * per_expert)
            for dp in self.params
            if dp.experts is not None
        ]
        self.buffer = torch.empty(self.numel, dtype=dtype, device=device)
        self.leaf = nn.Parameter(
            self.buffer.view(self.shape), requires_grad=self.registered.requires_grad
        )
        self._nbytes = self.numel * self.buffer.element_size()
        self.buffer.untyped_storage().resize_(0)
        self.valid = False
        self._broadcasts: list[Pending] = []
        self._reduces: list[Pending] = []
        self._replica_reduces: list[Pending] = []
        self._reduce_flat: torch.Tensor | None = None
        self._broadcast_versions: dict[int, int] = {}

    # ----- what the boundary registers ----------------------------------------------------
    def views(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """``(module, attribute, full-stack view)`` for forward and backward."""
        return [(self.module, self.attr, self.leaf)]

    def placeholders(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """``(module, attribute, registered placeholder)`` between forwards."""
        return [(self.module, self.attr, self.registered)]

    def grad_leaves(self) -> list[tuple[str, nn.Parameter]]:
        """``(fqn, leaf)`` whose gradients this group reduces."""
        return [(self.params[0].fqn, self.leaf)]

    # ----- forward / backward parameters -------------------------------------------------
    @property
    def allocated(self) -> bool:
        """Whether the buffer currently holds storage."""
        return self.buffer.untyped_storage().size() > 0

    def unshard_async(self) -> None:
        """Issue one broadcast per range, from its owner, into the stack-wide buffer."""
        if self.valid or self._broadcasts:
            return
        if not self.allocated:
            self.buffer.untyped_storage().resize_(self._nbytes)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.buffer):
            for index, (dp, (lo, hi)) in enumerate(zip(self.params, self.bounds, strict=True)):
                if dp.is_owned:
                    self.buffer[lo:hi].copy_(dp.param.reshape(-1))
                    self._broadcast_versions[index] = dp.param._version
            self._broadcasts = [
                self.comm.broadcast(self.buffer[lo:hi], dp.owner)
                for dp, (lo, hi) in zip(self.params, self.bounds, strict=True)
            ]

    def wait_unshard(self) -> None:
        """Wait for the broadcasts issued by `unshard_async`."""
        if self._broadcasts:
            for pending in self._broadcasts:
                pending.wait()
            self._broadcasts = []
            self.valid = True

    def free(self) -> None:
        """Release the buffer's storage; the view stays, pointing at no memory."""
        self.wait_unshard()
        self.buffer.untyped_storage().resize_(0)
        self.valid = False

    def changed_since_broadcast(self) -> list[str]:
        """Owned ranges edited in place while their broadcast values are still in use."""
        if not self.valid:
            return []
        return [
            self.params[index].name
            for index, version in self._broadcast_versions.items()
            if self.params[index].param._version != version
        ]

    def invalidate(self) -> None:
        """The owners' values changed: the next use must broadcast again."""
        self.wait_unshard()
        self.valid = False

    # ----- gradients -----------------------------------------------------------------------
    def _take_local_grad(self) -> torch.Tensor | None:
        grad, self.leaf.grad = self.leaf.grad, None
        return grad

    def accumulate_locally(self) -> None:
        """``no_sync``: add this backward's stack gradient to the local accumulation."""
        grad = self._take_local_grad()
        if grad is not None:
            accumulate_into(self.registered, grad)

    def reduce_async(self) -> None:
        """Merge local and accumulated gradients; SUM-reduce each range to its owner."""
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.buffer.device)
        merge_into(flat, self._take_local_grad(), self.registered)
        self._reduce_flat = flat
        self._reduces = [
            self.comm.reduce_sum(flat[lo:hi], dp.owner)
            for dp, (lo, hi) in zip(self.params, self.bounds, strict=True)
        ]

    def finish_reduce(self) -> None:
        """Wait for the reduces; each owner starts averaging its range across replicas."""
        if not self._reduces:
            return
        for pending in self._reduces:
            pending.wait()
        self._reduces = []
        assert self._reduce_flat is not None
        self._replica_reduces = [
            self.comm.all_reduce_replicas(self._reduce_flat[lo:hi])
            for _, lo, hi in self._owned_ranges()
        ]
        if not self._replica_reduces:
            release_reduce_input(self._reduce_flat)
            self._reduce_flat = None

    def finish_replica_reduce(self) -> None:
        """Wait for the cross-replica sums; each owner averages into ``_reduced_grad``."""
        if not self._replica_reduces:
            return
        for pending in self._replica_reduces:
            pending.wait()
        self._replica_reduces = []
        flat, self._reduce_flat = self._reduce_flat, None
        assert flat is not None
        divisor = self.comm.world_size * self.comm.replicas
        for dp, lo, hi in self._owned_ranges():
            # A copy: a view would keep the whole stack's gradient alive on the owner.
            add_reduced(dp.param, flat[lo:hi].div(divisor).view(dp.shape))
        release_reduce_input(flat)

    def _owned_ranges(self) -> Iterator[tuple[DedicatedParam, int, int]]:
        """``(range, start, stop)`` in the flat stack, for the ranges this rank owns."""
        for dp, (lo, hi) in zip(self.params, self.bounds, strict=True):
            if dp.is_owned:
                yield dp, lo, hi
