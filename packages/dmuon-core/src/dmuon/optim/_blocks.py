"""Memory and products the Newton-Schulz workspaces are made of: one `Arena` block that
every bucket's buffers are carved from, and `SymmetricProduct`, a symmetric matrix product
computed by blocks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

DEFAULT_MAX_WORKSPACE_BYTES: int = 2 * 1024**3
"""`dmuon.Muon`'s default cap on its Newton-Schulz buffers: 2 GiB."""


def check_max_workspace_bytes(value: object) -> None:
    """Raise unless ``value`` is a positive number of bytes."""
    if isinstance(value, bool) or not (isinstance(value, int) and value > 0):
        raise ValueError(
            "max_workspace_bytes must be a positive number of bytes, such as 2**31 "
            f"(2 GiB), got {value!r}"
        )


Allocate = Callable[[tuple[int, ...], torch.dtype], Tensor]
"""``allocate(shape, dtype)``: a new uninitialized tensor."""


class Arena:
    """One block of memory that the workspaces of an optimizer carve their buffers from.

    The optimizer orthogonalizes its buckets of same-shape matrices one after the other,
    and a bucket's buffers are read before the next bucket runs, so every bucket's
    workspace may start at the same place: the block holds the largest workspace, not the
    sum of all of them. `carver` hands out one workspace's buffers from the start of the
    block, 64-byte aligned; `measure` gives the bytes a workspace will need.
    """

    ALIGN = 64

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.block = torch.empty(0, dtype=torch.uint8, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes the block holds."""
        return self.block.numel()

    def reserve(self, nbytes: int) -> None:
        """Make the block hold at least ``nbytes``.

        The old block is dropped before the new one is allocated, so the two are never
        alive together: drop every view carved from it first (`Workspaces` does)."""
        if nbytes <= self.block.numel():
            return
        self.block = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def carver(self, measure_only: bool = False) -> tuple[Allocate, Callable[[], int]]:
        """``(allocate, used)``: buffers from the block's start on (meta tensors with
        ``measure_only``), and the bytes handed out so far."""
        offset = 0

        def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
            nonlocal offset
            start = -(-offset // self.ALIGN) * self.ALIGN
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            offset = start + nbytes
            if measure_only:
                return torch.empty(shape, dtype=dtype, device="meta")
            return self.block[start : start + nbytes].view(dtype).view(shape)

        return allocate, lambda: offset


class SymmetricProduct:
    """``out = beta·add + alpha·rows·rowsᵀ`` for 2-D ``rows``, with a quarter less work.

    The product is symmetric, so with ``rows`` split into two row blocks ``R₁, R₂`` only the
    blocks ``R₁R₁ᵀ``, ``R₁R₂ᵀ`` and ``R₂R₂ᵀ`` are multiplied; the fourth is the transpose
    of the second, copied. ``add`` must be symmetric (it is ``rows`` itself in the
    Newton-Schulz step ``B = bA + cA·A``). The diagonal blocks are written into ``out`` in
    place, which 2-D products do for any row stride; the off-diagonal one goes through
    ``scratch`` (``R₁``'s rows x ``R₂``'s rows, contiguous) and its transpose through
    ``scratch_t``, because torch copies a transpose fast only between contiguous tensors.
    Every view is made once, here: a step makes none.
    """

    def __init__(
        self,
        out: Tensor,
        rows: Tensor,
        scratch: Tensor,
        scratch_t: Tensor,
        add: Tensor | None = None,
    ) -> None:
        h = rows.shape[0] // 2
        top, bottom = rows[:h], rows[h:]
        self._products = [
            (top, top.mT, out[:h, :h], None if add is None else add[:h, :h]),
            (top, bottom.mT, scratch, None if add is None else add[:h, h:]),
            (bottom, bottom.mT, out[h:, h:], None if add is None else add[h:, h:]),
        ]
        self._copies = [(out[:h, h:], scratch), (scratch_t, scratch.mT), (out[h:, :h], scratch_t)]

    def __call__(self, beta: float = 0.0, alpha: float = 1.0) -> None:
        """Compute the product into ``out``."""
        for left, right, out, add in self._products:
            if add is None:
                torch.mm(left, right, out=out)
            else:
                torch.addmm(add, left, right, beta=beta, alpha=alpha, out=out)
        for dst, src in self._copies:
            dst.copy_(src)
