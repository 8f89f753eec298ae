"""The model part: torch's state dict for everything FSDP2 holds, plus the dedicated matrices."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_sd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.fsdp import FSDPModule
from torch.nn.modules.module import _IncompatibleKeys

from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.param import DedicatedParam
from dmuon.checkpoint._dedicated_values import gather_to_owners
from dmuon.checkpoint._layout import DedicatedLayout
from dmuon.checkpoint._split_stacks import (
    checkpoint_items,
    collect_on_lead,
    owner_pieces,
    ranges_by_stack,
)


def reshard_fsdp(model: nn.Module) -> None:
    """Put FSDP2 modules left unsharded by a forward (Z2, or the root) back into shards.

    A state dict then holds DTensor shards, and loading copies into shards, whatever
    forward ran last.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def included(state: DedicationState, options: StateDictOptions) -> list[Any]:
    """The dedicated entries a state dict with ``options`` holds (the same on every rank).

    A stack split by experts is one entry (see `dmuon.checkpoint._split_stacks`).
    """
    items = checkpoint_items(state)
    if options.ignore_frozen_params:
        return [dp for dp in items if dp.param.requires_grad]
    return items


def get_dedicated_model_state_dict(
    model: nn.Module, state: DedicationState, options: StateDictOptions
) -> dict[str, Any]:
    """torch's model state dict with every dedicated matrix in the layout ``options`` asks."""
    reshard_fsdp(model)
    result = torch_sd.get_model_state_dict(model, options=options)
    layout = DedicatedLayout(state)
    rank0_only = options.full_state_dict and options.cpu_offload
    ranges = ranges_by_stack(state)
    # Under HSDP with a narrower forward dtype, the replicas that do not step a matrix
    # hold only a copy in that dtype: every owner exports the stepping owner's master.
    exact = state.runtime.replica_updates.exact_master
    for dp in included(state, options):
        if dp.fqn in ranges:
            pieces = {r.name: exact(r) for r in ranges[dp.fqn] if r.is_owned}
            owned = collect_on_lead(layout.comm, ranges[dp.fqn], lambda r, p=pieces: p[r.name])
        else:
            owned = exact(dp) if dp.is_owned else None
        value = layout.export(dp, owned, options.full_state_dict, rank0_only)
        if value is not None:
            result[dp.fqn] = value
        else:
            result.pop(dp.fqn, None)
    return result


def set_dedicated_model_state_dict(
    model: nn.Module,
    state: DedicationState,
    model_state_dict: dict[str, Any],
    options: StateDictOptions,
) -> _IncompatibleKeys:
    """Load the dedicated matrices into their owners' masters and the rest through torch."""
    reshard_fsdp(model)
    remaining = dict(model_state_dict)
    layout = DedicatedLayout(state)
    comm = layout.comm
    wanted = included(state, options)
    dedicated_names = {dp.fqn for dp in state.params}

    split = set(ranges_by_stack(state))

    def land(dp: DedicatedParam, value: torch.Tensor) -> bool:
        """A whole matrix goes into its owner's master as soon as it arrives (a stack split
        by experts reaches its ranges' owners below)."""
        if dp.fqn in split or not dp.is_owned:
            return False
        with torch.no_grad():
            dp.param.copy_(value)
        return True

    loaded = gather_to_owners(
        layout,
        wanted,
        lambda dp: remaining.get(dp.fqn),
        options.broadcast_from_rank0,
        "model",
        land,
    )
    for name in dedicated_names:
        remaining.pop(name, None)

    # Keys torch would report in strict mode; with broadcast_from_rank0 only rank 0 knows
    # them, so it tells the others (every rank then raises alike).
    missing_elsewhere: list[str] = []
    unexpected: list[str] = []
    if options.strict and (not options.broadcast_from_rank0 or comm.is_rank0):
        expected = set(
            torch_sd.get_model_state_dict(
                model,
                options=replace(
                    options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False
                ),
            ).keys()
        )
        expected -= dedicated_names
        missing_elsewhere = sorted(expected - set(remaining))
        unexpected = sorted(set(remaining) - expected)
    if options.broadcast_from_rank0 and options.strict and comm.total_ranks > 1:
        missing_elsewhere, unexpected = comm.broadcast_object_from_rank0(  # type: ignore[misc]
            (missing_elsewhere, unexpected)
        )
    missing_dedicated = sorted(dp.fqn for dp in wanted if dp.fqn not in loaded)
    missing = missing_dedicated + missing_elsewhere
    if options.strict and (missing or unexpected):
        raise RuntimeError(
            "Error(s) in loading state_dict for the dedicated model: "
            f"missing keys {missing[:10]}, unexpected keys {unexpected[:10]}. Pass "
            "StateDictOptions(strict=False) to load a partial state dict."
        )

    torch_keys = torch_sd.set_model_state_dict(
        model, remaining, options=replace(options, strict=False)
    )
    pieces = owner_pieces(comm, state, loaded)
    wanted_names = {dp.fqn for dp in wanted}
    with torch.no_grad():
        for dp in state.params:
            value = pieces.get(dp.name)
            if dp.fqn in wanted_names and dp.is_owned and value is not None:
                dp.param.copy_(value)
    state.runtime.invalidate_buffers()
    torch_missing = [k for k in torch_keys.missing_keys if k not in dedicated_names]
    if options.broadcast_from_rank0:
        torch_missing = missing_elsewhere
    return _IncompatibleKeys(
        sorted(set(torch_missing) | set(missing_dedicated)),
        sorted(set(torch_keys.unexpected_keys) | set(unexpected)),
    )
