"""The collectives of a block of ranks sharing a matrix's Newton-Schulz iteration
(``dedicate_params(ns_split=...)``): part of `dmuon._comm.Communicator`, audited in the
split dimension (`dmuon._comm_audit.SPLIT`) and seen by the collective-order check."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dmuon._comm_audit import SPLIT
from dmuon._comm_pending import Pending


class BlockCollectives:
    """Synchronous scatter, all-reduce and gather over a block's process group."""

    _issue: Callable[..., Pending]

    def scatter_block(
        self,
        out: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        src: int,
        group: dist.ProcessGroup,
    ) -> None:
        """Scatter ``chunks`` (given on global rank ``src`` only) into each block member's
        ``out``, and wait; audited as ``out``'s elements over the split dimension."""
        self._issue(
            "scatter",
            out,
            src,
            lambda: dist.scatter(out, chunks, src=src, group=group, async_op=True),
            dim=SPLIT,
            group=group,
        ).wait()

    def all_reduce_block(self, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """SUM-all-reduce ``tensor`` over a block's ``group`` in place, and wait."""
        self._issue(
            "all_reduce",
            tensor,
            -1,
            lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True),
            dim=SPLIT,
            group=group,
        ).wait()

    def gather_block(
        self,
        tensor: torch.Tensor,
        chunks: list[torch.Tensor] | None,
        dst: int,
        group: dist.ProcessGroup,
    ) -> None:
        """Gather every block member's ``tensor`` into ``chunks`` on global rank ``dst``,
        and wait."""
        self._issue(
            "gather",
            tensor,
            dst,
            lambda: dist.gather(tensor, chunks, dst=dst, group=group, async_op=True),
            dim=SPLIT,
            group=group,
        ).wait()
