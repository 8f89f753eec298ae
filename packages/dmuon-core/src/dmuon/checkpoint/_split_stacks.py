"""Stacks split by experts in a state dict: saved and loaded as the whole stack.

A state dict holds a split stack exactly as it holds an unsplit one (one entry under the
stack's name, in the same layout), so checkpoints move freely between split and unsplit
runs. The state-dict code works on *items*: every unsplit dedicated parameter as it is,
and for each split stack one stand-in record of the whole stack whose owner is the owner
of its first range (the *lead*). `collect_on_lead` assembles the ranges' tensors on the
lead before saving; `owner_pieces` hands a loaded stack's experts back to the ranges'
owners. Both move ranges point to point between the lead and each other owner, in
expert order, so every rank takes part in the same transfers whatever the values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from dmuon._comm import Communicator
from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.param import DedicatedParam


def ranges_by_stack(state: DedicationState) -> dict[str, list[DedicatedParam]]:
    """``{fqn: range records in expert order}`` of every split stack."""
    return ranges_of(state.params)


def ranges_of(params: list[DedicatedParam]) -> dict[str, list[DedicatedParam]]:
    """``{fqn: range records in expert order}`` of the split stacks among ``params``."""
    ranges: dict[str, list[DedicatedParam]] = {}
    for dp in params:
        if dp.is_range:
            ranges.setdefault(dp.fqn, []).append(dp)
    for records in ranges.values():
        records.sort(key=lambda dp: dp.experts or (0, 0))
    return ranges


def checkpoint_items(state: DedicationState | list[DedicatedParam]) -> list[DedicatedParam]:
    """One record per state-dict entry, in parameter order (the same on every rank).

    ``state`` may be a list of records in the dedication's order instead of the dedication.
    """
    params = state.params if isinstance(state, DedicationState) else state
    items: list[DedicatedParam] = []
    ranges = ranges_of(params)
    for dp in params:
        if not dp.is_range:
            items.append(dp)
        elif dp is ranges[dp.fqn][0]:
            assert dp.registered is not None and dp.stack_shape is not None
            lead = dp.owner
            items.append(
                replace(
                    dp,
                    owner=lead,
                    shape=dp.stack_shape,
                    param=dp.registered,
                    is_owned=dp.is_owned,
                    experts=None,
                    registered=None,
                    stack_shape=None,
                )
            )
    return items


def collect_on_lead(
    comm: Communicator,
    ranges: list[DedicatedParam],
    piece_of: Callable[[DedicatedParam], torch.Tensor | None],
) -> torch.Tensor | None:
    """The whole stack on the lead (float32), from each range owner's ``piece_of(dp)``.

    Returns ``None`` on every other rank. Every owner must hold its piece.
    """
    lead = ranges[0].owner
    stack_shape = ranges[0].stack_shape
    assert stack_shape is not None
    full = None
    if comm.rank == lead:
        full = torch.empty(stack_shape, dtype=torch.float32, device=comm.device)
    for dp in ranges:
        assert dp.experts is not None
        start, stop = dp.experts
        if dp.owner == lead:
            if full is not None:
                piece = piece_of(dp)
                assert piece is not None, f"{dp.name}: its owner has no value"
                full[start:stop].copy_(piece)
        elif dp.is_owned:
            piece = piece_of(dp)
            assert piece is not None, f"{dp.name}: its owner has no value"
            comm.send(piece.detach().to(comm.device, torch.float32).contiguous(), lead)
        elif full is not None:
            comm.recv(full[start:stop], dp.owner)
    return full


def owner_pieces(
    comm: Communicator,
    state: DedicationState | list[DedicatedParam],
    loaded: dict[str, torch.Tensor | None],
) -> dict[str, torch.Tensor | None]:
    """``{record name: its values on its owner}`` from ``loaded`` (``{fqn: full on owner}``).

    An unsplit parameter's value is passed through; a split stack's full value, held by
    its lead, is cut into ranges and sent to their owners. Stacks absent from ``loaded``
    are skipped (``loaded`` has the same keys on every rank). ``state`` may be a list of
    records in the dedication's order (with the shapes of the tensors to move).
    """
    params = state.params if isinstance(state, DedicationState) else state
    pieces: dict[str, torch.Tensor | None] = {}
    for dp in params:
        if not dp.is_range and dp.fqn in loaded:
            pieces[dp.name] = loaded[dp.fqn]
    for fqn, ranges in ranges_of(params).items():
        if fqn not in loaded:
            continue
        lead = ranges[0].owner
        full = loaded[fqn] if comm.rank == lead else None
        for dp in ranges:
            assert dp.experts is not None
            start, stop = dp.experts
            if dp.owner == lead:
                pieces[dp.name] = full[start:stop].clone() if full is not None else None
            elif comm.rank == lead:
                assert full is not None
                comm.send(full[start:stop].contiguous(), dp.owner)
            elif dp.is_owned:
                piece = torch.empty(dp.shape, dtype=torch.float32, device=comm.device)
                comm.recv(piece, lead)
                pieces[dp.name] = piece
    return pieces
