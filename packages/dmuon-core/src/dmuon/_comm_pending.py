"""Collectives in flight (`Pending`) and the packing of uneven pieces into one tensor."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

RECENT_WORK_KEPT = 16
"""Finished collectives whose work handles a `Communicator` keeps referenced (see `Pending`)."""


class Pending:
    """A collective in flight. ``wait()`` makes its result visible to the caller.

    A finished work handle goes to ``recent`` (a bounded deque) instead of being dropped.
    gloo's worker thread still holds the work for a moment after ``wait()`` returns; if it
    dropped the last reference, the work's tensors would be freed on that thread, which
    must then take the GIL for any tensor whose Python object was already released. Near
    interpreter exit that aborts the process ("terminate called without an active
    exception"). Kept here, the last reference is dropped by Python, on a Python thread,
    some collectives later or at teardown.
    """

    def __init__(
        self,
        work: dist.Work | None = None,
        recent: deque[dist.Work] | None = None,
        what: str = "collective",
        then: Callable[[], None] | None = None,
    ):
        self._work = work
        self._recent = recent
        self.what = what
        #: Runs once the collective is complete (copies received pieces into place).
        self._then = then

    def wait(self) -> None:
        """Block (gloo) or order the current CUDA stream (NCCL) after the collective.

        Raises:
            CollectiveError: the collective failed or timed out (another rank died or
                stalled); the message names it.
        """
        if self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as error:
                raise CollectiveError(
                    f"DMuon's {self.what} did not complete on this rank: {error}. Another rank "
                    "probably died or stalled before it; look at the other ranks' logs. How long "
                    "a rank waits is the process group's timeout: "
                    "dist.init_process_group(..., timeout=datetime.timedelta(minutes=10))."
                ) from error
            if self._recent is not None:
                self._recent.append(self._work)
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def joined(pieces: Sequence[torch.Tensor], copy_in: bool, like: torch.Tensor) -> torch.Tensor:
    """``pieces`` as one flat tensor: the single piece itself, else a new one of ``like``'s
    dtype and device (holding their values when ``copy_in``; empty for no piece)."""
    if len(pieces) == 1:
        return pieces[0].view(-1)
    joined = torch.empty(sum(p.numel() for p in pieces), dtype=like.dtype, device=like.device)
    if copy_in:
        concat_into(pieces, joined)
    return joined


def adjacent(pieces: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor | None:
    """One 1-D view over every piece when they lie back to back in one storage, in rank
    order (then in their order); else ``None``."""
    flat = [piece for part in pieces for piece in part]
    first = flat[0]
    end = first.data_ptr()
    for piece in flat:
        if not piece.is_contiguous() or piece.data_ptr() != end:
            return None
        if piece.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += piece.numel() * piece.element_size()
    total = sum(piece.numel() for piece in flat)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (total,))


def concat_into(pieces: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy ``pieces`` back to back into the start of ``out``."""
    offset = 0
    for piece in pieces:
        out[offset : offset + piece.numel()].copy_(piece.reshape(-1))
        offset += piece.numel()


def scatter_into(source: torch.Tensor, pieces: Sequence[torch.Tensor]) -> None:
    """Copy ``source``'s leading elements, back to back, into ``pieces`` (parameters too)."""
    offset = 0
    with torch.no_grad():
        for piece in pieces:
            piece.view(-1).copy_(source[offset : offset + piece.numel()])
            offset += piece.numel()


class CollectiveError(RuntimeError):
    """A DMuon collective failed or timed out; the message names the collective."""
