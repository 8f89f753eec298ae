"""Collect state-dict entries of dedicated matrices onto their owners, on every rank alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dmuon._ownership.param import DedicatedParam
from dmuon.checkpoint._layout import BAD_SHAPE, MISSING, SHARDED, DedicatedLayout


def gather_to_owners(
    layout: DedicatedLayout,
    params: list[DedicatedParam],
    value_of: Callable[[DedicatedParam], Any],
    broadcast_from_rank0: bool,
    what: str,
    land: Callable[[DedicatedParam, torch.Tensor], bool] | None = None,
) -> dict[str, torch.Tensor | None]:
    """``{fqn: full tensor on the owner (None elsewhere)}`` for every matrix given anywhere.

    ``value_of(dp)`` is this rank's state-dict entry for ``dp`` (``None`` if absent). With
    ``broadcast_from_rank0`` only rank 0's entries count, and ``land(dp, value)``, given,
    may put each received value where it belongs as it arrives (returning True; the
    result then says ``None`` for it), so that an owner never holds more than one received
    matrix at once. A matrix missing from the result is missing from the state dict.
    Raises the same `ValueError` on every rank when the entries have the wrong shape or
    ranks disagree on whether an entry is sharded.
    """
    comm = layout.comm
    if broadcast_from_rank0:
        present = None
        bad: list[str] = []
        if comm.is_rank0:
            present = [dp.fqn for dp in params if value_of(dp) is not None]
            bad = [
                f"{dp.fqn}: {_shape(value_of(dp))} (the model has {tuple(dp.shape)})"
                for dp in params
                if layout.classify(dp, value_of(dp)) == BAD_SHAPE
            ]
        if comm.total_ranks > 1:
            present, bad = comm.broadcast_object_from_rank0((present, bad))  # type: ignore[misc]
        _raise_bad(bad, what)
        wanted = set(present or [])
        received: dict[str, torch.Tensor | None] = {}
        for dp in params:
            if dp.fqn not in wanted:
                continue
            value = layout.from_rank0(dp, value_of(dp) if comm.is_rank0 else None)
            if value is not None and land is not None and land(dp, value):
                value = None  # in place on its owner already
            received[dp.fqn] = value
        return received
    codes = layout.agree([layout.classify(dp, value_of(dp)) for dp in params])
    bad = []
    for i, dp in enumerate(params):
        column = codes[:, i].tolist()
        if BAD_SHAPE in column:
            ranks = [r for r, c in enumerate(column) if c == BAD_SHAPE]
            bad.append(f"{dp.fqn}: wrong shape on ranks {ranks} (the model has {tuple(dp.shape)})")
        elif SHARDED in column and any(c != SHARDED for c in column):
            ranks = [r for r, c in enumerate(column) if c != SHARDED]
            bad.append(
                f"{dp.fqn}: a DTensor on some ranks but not on ranks {ranks} (pass the state "
                "dict every rank got from get_*_state_dict and filled with dcp.load)"
            )
    _raise_bad(bad, what)
    result: dict[str, torch.Tensor | None] = {}
    for i, dp in enumerate(params):
        column = codes[:, i]
        if int(column[dp.owner]) == MISSING:
            continue
        result[dp.fqn] = layout.to_owner(dp, value_of(dp), column)
    return result


def _shape(value: Any) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _raise_bad(bad: list[str], what: str) -> None:
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(
            f"the {what} state dict does not fit the dedicated matrices: "
            + "; ".join(bad[:5])
            + more
        )
