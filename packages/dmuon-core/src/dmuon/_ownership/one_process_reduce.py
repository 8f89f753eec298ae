"""A boundary's reduce in one process: each gradient is its records' average as it stands.

With one process there is no one to sum with: the packed reduce's copy of the whole
boundary (and, after ``no_sync`` micro-batches, the accumulated totals beside it) would
only cost memory. Each gradient, with what ``no_sync`` accumulated added in place, becomes
its records' ``_reduced_grad``. The values are the packed path's: in float32, a sum of one
rank is its gradient (plus its total), divided by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from dmuon._ownership import gradients
from dmuon._ownership.param import DedicatedParam


class _Entry(Protocol):
    record: DedicatedParam
    lo: int
    hi: int


class _View(Protocol):
    holder: nn.Parameter
    lo: int
    hi: int
    entries: list[int]


class _Buffer(Protocol):
    """What is read of a `dmuon._ownership.flat_buffer.FlatBuffer`."""

    reduce_dtype: torch.dtype
    buffer: torch.Tensor

    @property
    def views(self) -> Sequence[_View]: ...

    @property
    def entries(self) -> Sequence[_Entry]: ...


def applies(flat: _Buffer, grads: Sequence[torch.Tensor | None]) -> bool:
    """Whether the gradients can be taken as they are: the reduce keeps float32, and so
    does every gradient and ``no_sync`` total, each contiguous."""
    totals = [gradients.accumulated(view.holder) for view in flat.views]
    wide = [t for t in (*grads, *totals) if t is not None]
    return flat.reduce_dtype == torch.float32 and all(
        t.dtype == torch.float32 and t.is_contiguous() for t in wide
    )


def take_as_averages(flat: _Buffer, live: set[int], grads: Sequence[torch.Tensor | None]) -> None:
    """Store each view's gradient (``grads``, in view order), plus its ``no_sync`` total,
    as the ``_reduced_grad`` of the records it covers; views outside ``live`` (frozen)
    only lose their totals."""
    for view, grad in zip(flat.views, grads, strict=True):
        acc = gradients.take_accumulated(view.holder)
        gradients.mark(view.holder)
        if view.entries[0] not in live:
            continue
        if acc is not None:
            total = acc if grad is None else acc.add_(grad.detach().view_as(acc))
        elif grad is not None:
            total = grad.detach()
            if total.untyped_storage().nbytes() != total.numel() * total.element_size():
                total = total.clone()  # a view of a larger block, which may be reused
        else:  # no gradient at all: what the packed path sends for a silent record
            total = torch.full((view.hi - view.lo,), -0.0, device=flat.buffer.device)
        values = total.reshape(-1)
        for index in view.entries:
            entry = flat.entries[index]
            piece = values[entry.lo - view.lo : entry.hi - view.lo].view(entry.record.shape)
            gradients.add_reduced(entry.record.param, piece, view.holder)
