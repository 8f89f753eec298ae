"""In one process, a hook boundary's masters *are* its flat buffer.

With nobody to gather from (one rank, one replica), a buffer in the masters' own dtype
and device would only be a second copy of them, refilled before every forward (and
before every backward in Z3). Instead each master becomes a view of its slice of the
buffer, and the buffer is never freed: the forward reads the masters' memory, the
optimizer's in-place step writes it, and the model costs what the plain model costs.

A buffer qualifies when this rank owns every record, each record is a whole matrix held
by its own master (no split expert stack, no tensor-parallel shard), and the buffer
computes in the masters' dtype on their device (no ``param_dtype``, FSDP2 policy or
``broadcast_dtype`` of another dtype). A master given new storage afterwards (a state
dict loaded by assigning ``.data``, a move) is pointed back at its slice when the buffer
is next invalidated (every path that changes weights does that).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from dmuon._comm import Communicator


class FlatBuffer(Protocol):
    """What aliasing reads and writes of `dmuon._ownership.flat_buffer.FlatBuffer`."""

    comm: Communicator
    broadcast_dtype: torch.dtype | None
    views: list[Any]
    entries: list[Any]
    buffer: torch.Tensor
    numel: int
    aliased: bool
    state: Any

    def free(self) -> None: ...


def qualifies(flat: FlatBuffer) -> bool:
    """Whether ``flat``'s masters can be views of it (see the module docstring)."""
    comm = flat.comm
    if comm.world_size != 1 or comm.replicas != 1 or flat.broadcast_dtype is not None:
        return False
    for view in flat.views:
        if len(view.entries) != 1:
            return False
        record = flat.entries[view.entries[0]].record
        param = record.param
        if view.holder is not param or not record.is_owned or record.tp is not None:
            return False
        if param.dtype != flat.buffer.dtype or param.device != flat.buffer.device:
            return False
    return bool(flat.views)


def _slice(flat: FlatBuffer, index: int) -> torch.Tensor:
    entry = flat.entries[index]
    return flat.buffer[entry.lo : entry.hi].view(entry.record.param.shape)


def alias(flat: FlatBuffer) -> None:
    """Make ``flat``'s masters views of it when it qualifies (their values move in)."""
    if flat.aliased or not qualifies(flat):
        return
    flat.buffer.untyped_storage().resize_(flat.numel * flat.buffer.element_size())
    with torch.no_grad():
        for index, entry in enumerate(flat.entries):
            place = _slice(flat, index)
            place.copy_(entry.record.param.detach())
            entry.record.param.data = place
    flat.aliased = True
    flat.state = type(flat.state).VALID  # the buffer holds the masters' values, always


def realias(flat: FlatBuffer) -> None:
    """Point back at their slices the masters that were given other storage since."""
    with torch.no_grad():
        for index, entry in enumerate(flat.entries):
            param = entry.record.param
            place = _slice(flat, index)
            if param.data_ptr() != place.data_ptr():
                place.copy_(param.detach())
                param.data = place


def unalias(flat: FlatBuffer) -> None:
    """Give ``flat``'s masters storage of their own again (before it changes dtype or
    device) and release the buffer's."""
    if not flat.aliased:
        return
    with torch.no_grad():
        for entry in flat.entries:
            entry.record.param.data = entry.record.param.detach().clone()
    flat.aliased = False
    flat.free()
