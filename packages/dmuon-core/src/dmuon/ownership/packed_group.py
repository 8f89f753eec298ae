"""One packed buffer: the dedicated matrices of one owner inside one hook boundary.

The buffer's storage is allocated before use and freed after, while the per-matrix views
into it survive (as FSDP2 does for its unsharded parameters): autograd keeps references
to the views, and re-filling the storage before backward makes them valid again.
"""

from __future__ import annotations

import torch
from torch import nn

from dmuon.comm import Communicator, Pending
from dmuon.ownership.param import DedicatedParam


def accumulate_into(holder: nn.Parameter, grad: torch.Tensor) -> None:
    """Add ``grad`` (as float32) to ``holder._accumulated_grad``, the ``no_sync`` total."""
    grad = grad.detach().to(torch.float32)
    acc = getattr(holder, "_accumulated_grad", None)
    if acc is None:
        holder._accumulated_grad = grad
    else:
        acc.add_(grad)


def merge_into(piece: torch.Tensor, grad: torch.Tensor | None, holder: nn.Parameter) -> None:
    """Fill the zeroed flat ``piece`` with the local ``grad`` plus the holder's accumulated
    gradient, and clear the accumulation. With neither, ``piece`` stays zero."""
    if grad is not None:
        piece.copy_(grad.detach().reshape(-1))
    acc = getattr(holder, "_accumulated_grad", None)
    if acc is not None:
        piece.add_(acc.reshape(-1))
        holder._accumulated_grad = None


def release_reduce_input(flat: torch.Tensor | None) -> None:
    """Free a finished reduce's input now: its work handle, kept a little longer by the
    `Communicator` (see `dmuon.comm.Pending`), would otherwise keep the memory too."""
    if flat is not None:
        flat.untyped_storage().resize_(0)


def add_reduced(param: nn.Parameter, piece: torch.Tensor) -> None:
    """Add an averaged gradient to ``param._reduced_grad``, what the optimizer steps on."""
    current = getattr(param, "_reduced_grad", None)
    if current is None:
        param._reduced_grad = piece
    else:
        current.add_(piece)


class PackedGroup:
    """Broadcast buffer and gradient reduction for one (boundary, owner) pair."""

    def __init__(
        self,
        params: list[DedicatedParam],
        owner: int,
        dtype: torch.dtype,
        device: torch.device,
        comm: Communicator,
    ) -> None:
        self.params = params
        self.owner = owner
        self.comm = comm
        self.is_owner = comm.rank == owner
        self.numel = sum(dp.numel for dp in params)
        self.offsets: list[int] = []
        self.buffer = torch.empty(self.numel, dtype=dtype, device=device)
        self.leaves: list[nn.Parameter] = []
        offset = 0
        for dp in params:
            self.offsets.append(offset)
            view = self.buffer[offset : offset + dp.numel].view(dp.shape)
            self.leaves.append(nn.Parameter(view, requires_grad=dp.param.requires_grad))
            offset += dp.numel
        self._nbytes = self.numel * self.buffer.element_size()
        self.buffer.untyped_storage().resize_(0)
        self.valid = False
        self._broadcast: Pending | None = None
        self._reduce: Pending | None = None
        self._reduce_flat: torch.Tensor | None = None
        self._replica_reduce: Pending | None = None
        self._broadcast_versions: list[int] = []

    # ----- what the boundary registers ----------------------------------------------------
    def views(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """``(module, attribute, full-matrix view)`` for forward and backward."""
        return [
            (dp.module, dp.attr, leaf) for dp, leaf in zip(self.params, self.leaves, strict=True)
        ]

    def placeholders(self) -> list[tuple[nn.Module, str, nn.Parameter]]:
        """``(module, attribute, registered parameter)`` between forwards."""
        return [(dp.module, dp.attr, dp.param) for dp in self.params]

    def grad_leaves(self) -> list[tuple[str, nn.Parameter]]:
        """``(fqn, leaf)`` whose gradients this group reduces."""
        return [(dp.fqn, leaf) for dp, leaf in zip(self.params, self.leaves, strict=True)]

    # ----- forward / backward parameters -------------------------------------------------
    @property
    def allocated(self) -> bool:
        """Whether the buffer currently holds storage."""
        return self.buffer.untyped_storage().size() > 0

    def unshard_async(self) -> None:
        """Make sure a broadcast of the owner's current values is issued (or done)."""
        if self.valid or self._broadcast is not None:
            return
        if not self.allocated:
            self.buffer.untyped_storage().resize_(self._nbytes)
        # The buffer backs views that autograd saved; rewriting it must not count as an
        # in-place modification of those saved tensors.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.buffer):
            if self.is_owner:
                for dp, offset in zip(self.params, self.offsets, strict=True):
                    self.buffer[offset : offset + dp.numel].copy_(dp.param.reshape(-1))
                self._broadcast_versions = [dp.param._version for dp in self.params]
            self._broadcast = self.comm.broadcast(self.buffer, self.owner)

    def wait_unshard(self) -> None:
        """Wait for the broadcast issued by `unshard_async`."""
        if self._broadcast is not None:
            self._broadcast.wait()
            self._broadcast = None
            self.valid = True

    def free(self) -> None:
        """Release the buffer's storage; the views stay, pointing at no memory."""
        self.wait_unshard()
        self.buffer.untyped_storage().resize_(0)
        self.valid = False

    def changed_since_broadcast(self) -> list[str]:
        """Owned matrices edited in place while their broadcast values are still in use."""
        if not (self.is_owner and self.valid):
            return []
        return [
            dp.fqn
            for dp, version in zip(self.params, self._broadcast_versions, strict=True)
            if dp.param._version != version
        ]

    def invalidate(self) -> None:
        """The owner's values changed: the next use must broadcast again."""
        self.wait_unshard()
        self.valid = False

    # ----- gradients -----------------------------------------------------------------------
    def _take_local_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for leaf in self.leaves:
            grads.append(leaf.grad)
            leaf.grad = None
        return grads

    def accumulate_locally(self) -> None:
        """``no_sync``: add this backward's gradients to ``_accumulated_grad`` (no comm)."""
        for dp, grad in zip(self.params, self._take_local_grads(), strict=True):
            if grad is not None:
                accumulate_into(dp.param, grad)

    def reduce_async(self) -> None:
        """Merge local and accumulated gradients and SUM-reduce them to the owner.

        A matrix without a local gradient (for example an expert that saw no token on this
        rank) contributes zeros: the collective is the same on every rank.
        """
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.buffer.device)
        for dp, offset, grad in zip(
            self.params, self.offsets, self._take_local_grads(), strict=True
        ):
            merge_into(flat[offset : offset + dp.numel], grad, dp.param)
        self._reduce_flat = flat
        self._reduce = self.comm.reduce_sum(flat, self.owner)

    def finish_reduce(self) -> None:
        """Wait for the reduce; an owner then starts averaging across replicas (HSDP).

        `finish_replica_reduce` completes the step; the split lets every group's
        cross-replica all-reduce be in flight at once.
        """
        if self._reduce is None:
            return
        self._reduce.wait()
        self._reduce = None
        if self.is_owner:
            assert self._reduce_flat is not None
            self._replica_reduce = self.comm.all_reduce_replicas(self._reduce_flat)
        else:
            release_reduce_input(self._reduce_flat)
            self._reduce_flat = None

    def finish_replica_reduce(self) -> None:
        """Wait for the cross-replica sum; the owner averages into ``_reduced_grad``."""
        if self._replica_reduce is None:
            return
        self._replica_reduce.wait()
        self._replica_reduce = None
        flat, self._reduce_flat = self._reduce_flat, None
        assert flat is not None
        flat.div_(self.comm.world_size * self.comm.replicas)
        for dp, offset in zip(self.params, self.offsets, strict=True):
            add_reduced(dp.param, flat[offset : offset + dp.numel].view(dp.shape))
