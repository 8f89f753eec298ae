"""The optimizer part in torch's FQN-keyed format, for optimizers of a dedicated model.

``state[fqn]`` holds each parameter's state and ``param_groups[i]["params"]`` the FQNs of
group ``i``, as `torch.distributed.checkpoint.state_dict` gives them. A dedicated
matrix's Muon momentum (``momentum_buffer``) is stored under the matrix's FQN in the
matrix's layout (a ``Shard(0)`` DTensor by default); under NorMuon its second moment
(``second_moment_buffer``, ``(out, 1)`` per matrix) sits next to it in the same layout, so
it reshards the same way. AdamW moments and steps of FSDP2 parameters are the optimizer's
own DTensor shards and scalar tensors.

A checkpoint's Muon groups must have this optimizer's ``variant``: in strict mode a
different one is refused; with ``strict=False`` this optimizer keeps its variant, the
momenta load, and NorMuon's second moments start at zero (or are dropped, for Muon).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_sd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.planner import state_dict_name
from dmuon._ownership.replica_updates import from_stepping_replica
from dmuon.checkpoint._dedicated_values import gather_to_owners
from dmuon.checkpoint._layout import DedicatedLayout
from dmuon.checkpoint._split_stacks import (
    checkpoint_items,
    collect_on_lead,
    owner_pieces,
    ranges_by_stack,
    ranges_of,
)
from dmuon.optim._normuon import SECOND_MOMENT, second_moment_record

MOMENTUM = "momentum_buffer"

_FOREIGN_HINT = (
    "the optimizer state dict was written by other optimizers (its param groups have no "
    "'algorithm': torch.optim.Muon and torch.optim.AdamW, say), and it lacks state this "
    "optimizer keeps: {missing}. To fine-tune from it, either load it with "
    "dmuon.set_optimizer_state_dict(model, optimizer, state, "
    "options=StateDictOptions(strict=False)), which loads every Muon momentum and AdamW "
    "moment it holds and starts those it lacks at zero, or load only the model part "
    "(dmuon.set_model_state_dict) and start the optimizer fresh. Nothing was changed."
)


def _foreign_gaps(
    loaded: dict[str, dict[str, Any]],
    state: DedicationState,
    optimizers: tuple,
    names: dict[int, str],
) -> list[str]:
    """What a state dict of torch's optimizers lacks of this one's state: the dedicated
    matrices without a ``momentum_buffer``, the trainable AdamW parameters without moments
    (at most five of each, named)."""
    momenta = _unique([dp.fqn for dp in state.params if MOMENTUM not in loaded.get(dp.fqn, {})])
    dedicated = {id(dp.param) for dp in state.params}
    moments = [
        names[id(p)]
        for optim in optimizers
        for group in optim.param_groups
        if group.get("algorithm") != "muon"
        for p in group["params"]
        if id(p) not in dedicated
        and p.requires_grad
        and "exp_avg" not in loaded.get(names[id(p)], {})
    ]
    gaps = []
    if momenta:
        gaps.append(f"the Muon momentum of {len(momenta)} matrices ({momenta[:5]})")
    if moments:
        gaps.append(f"the AdamW moments of {len(moments)} parameters ({moments[:5]})")
    return gaps


def as_tuple(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> tuple:
    """``optimizers`` as a tuple, as torch's functions accept one or several."""
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    return tuple(optimizers)


def _names(model: nn.Module, state: DedicationState) -> dict[int, str]:
    """``{id(param): fqn}``; every range of a split stack goes by the stack's name."""
    names = {id(p): state_dict_name(name) for name, p in model.named_parameters()}
    names.update({id(dp.param): dp.fqn for dp in state.params})
    return names


def _unique(names: list[str]) -> list[str]:
    """``names`` without repeats (a split stack's ranges), in order."""
    return list(dict.fromkeys(names))


def _check_optimizers(state: DedicationState, optimizers: tuple) -> None:
    from dmuon.optim._muon import Muon

    dedicated = {id(dp.param) for dp in state.params}
    for optim in optimizers:
        holds = any(id(p) in dedicated for g in optim.param_groups for p in g["params"])
        if holds and not isinstance(optim, Muon):
            raise ValueError(
                f"{type(optim).__name__} holds dedicated parameters, whose state only "
                "dmuon.Muon knows how to place; step dedicated parameters with dmuon.Muon"
            )


def _ensure_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state if it has none, so a fresh optimizer can be loaded into."""
    from dmuon.optim._muon import Muon

    if isinstance(optim, Muon):
        optim.init_state()
    else:
        torch_sd._init_optim_state(optim)


def _normuon_records(
    state: DedicationState, optimizers: tuple, loading: set[int] | None = None
) -> list[DedicatedParam]:
    """The records of NorMuon groups with the second moment's shapes, in dedication order.

    ``loading`` restricts them to the parameters whose second moments are loaded.
    """
    ids = {
        id(p)
        for optim in optimizers
        for group in optim.param_groups
        if group.get("algorithm") == "muon" and group.get("variant", "muon") == "normuon"
        for p in group["params"]
    }
    if loading is not None:
        ids &= loading
    return [second_moment_record(dp) for dp in state.params if id(dp.param) in ids]


def _on_every_replica(
    layout: DedicatedLayout, records: list[DedicatedParam], values: dict[str, torch.Tensor]
) -> None:
    """Under HSDP, give every replica's owner of each record the optimizer state that the
    owner in its ``update_replica`` keeps (``values``, by record name), as the state-dict
    layouts take it from every replica's owner. Nothing to do on a 1-D mesh."""
    comm = layout.comm
    if comm.replicas == 1:
        return
    for dp in records:
        if dp.is_owned:
            dtype = torch.promote_types(dp.param.dtype, torch.float32)
            values[dp.name] = from_stepping_replica(comm, dp, values.get(dp.name), dtype)


def _full_value(value: Any, options: StateDictOptions) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if options.cpu_offload:
        value = value.cpu()
    return value


def get_dedicated_optimizer_state_dict(
    model: nn.Module,
    state: DedicationState,
    optimizers: tuple,
    options: StateDictOptions,
) -> dict[str, Any]:
    """The FQN-keyed optimizer state dict of ``optimizers`` on a dedicated model."""
    _check_optimizers(state, optimizers)
    names = _names(model, state)
    layout = DedicatedLayout(state)
    is_rank0 = layout.comm.is_rank0
    rank0_only = options.full_state_dict and options.cpu_offload
    result: dict[str, Any] = {"state": {}, "param_groups": []}
    momentum_of: dict[str, torch.Tensor] = {}  # by record name: ranges apart
    second_of: dict[str, torch.Tensor] = {}
    record_names = {id(dp.param): dp.name for dp in state.params}
    for optim in optimizers:
        _ensure_state(optim)
        params = [p for g in optim.param_groups for p in g["params"]]
        for p in params:
            if p in optim.state and MOMENTUM in optim.state[p] and id(p) in names:
                momentum_of[record_names.get(id(p), names[id(p)])] = optim.state[p][MOMENTUM]
            if p in optim.state and SECOND_MOMENT in optim.state[p] and id(p) in names:
                second_of[record_names.get(id(p), names[id(p)])] = optim.state[p][SECOND_MOMENT]
        raw = optim.state_dict()
        for index, entry in raw["state"].items():
            result["state"][names[id(params[index])]] = dict(entry)
        for group in raw["param_groups"]:
            named = {k: v for k, v in group.items() if k != "params"}
            named["params"] = _unique([names[id(params[i])] for i in group["params"]])
            result["param_groups"].append(named)
    in_muon = {
        id(p)
        for optim in optimizers
        for group in optim.param_groups
        if group.get("algorithm") == "muon"
        for p in group["params"]
    }
    _on_every_replica(layout, [dp for dp in state.params if id(dp.param) in in_muon], momentum_of)
    _on_every_replica(layout, _normuon_records(state, optimizers), second_of)
    dedicated_names = {dp.fqn for dp in state.params}
    if options.full_state_dict:
        for fqn, entry in result["state"].items():
            if fqn not in dedicated_names:
                result["state"][fqn] = {k: _full_value(v, options) for k, v in entry.items()}
    ranges = ranges_by_stack(state)
    for dp in checkpoint_items(state):
        if dp.fqn in ranges:
            owned = collect_on_lead(layout.comm, ranges[dp.fqn], lambda r: momentum_of.get(r.name))
        else:
            owned = momentum_of.get(dp.fqn) if dp.is_owned else None
        value = layout.export(dp, owned, options.full_state_dict, rank0_only)
        if value is not None:
            result["state"].setdefault(dp.fqn, {})[MOMENTUM] = value
        else:
            result["state"].pop(dp.fqn, None)
    # NorMuon's second moments: the same moves as the momenta, at their own shapes.
    records = _normuon_records(state, optimizers)
    second_ranges = ranges_of(records)
    for dp in checkpoint_items(records):
        if dp.fqn in second_ranges:
            owned = collect_on_lead(
                layout.comm, second_ranges[dp.fqn], lambda r: second_of.get(r.name)
            )
        else:
            owned = second_of.get(dp.fqn) if dp.is_owned else None
        value = layout.export(dp, owned, options.full_state_dict, rank0_only)
        if value is not None:
            result["state"].setdefault(dp.fqn, {})[SECOND_MOMENT] = value
    if rank0_only and not is_rank0:
        result = {"state": {}, "param_groups": []}
    if options.flatten_optimizer_state_dict:
        return torch_sd._flatten_optim_state_dict(result)
    return result


def _unflatten(flat: dict[str, Any], optimizers: tuple, names: dict[int, str]) -> dict[str, Any]:
    """Undo ``flatten_optimizer_state_dict``.

    Its keys are ``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>``.
    """
    state: dict[str, dict[str, Any]] = {}
    group_values: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        fqn, _, field = rest.rpartition(".")
        target = state if section == "state" else group_values
        target.setdefault(fqn, {})[field] = value
    groups = []
    for optim in optimizers:
        for group in optim.param_groups:
            fqns = [names[id(p)] for p in group["params"]]
            values = next((group_values[f] for f in fqns if f in group_values), {})
            groups.append(dict(values, params=fqns))
    return {"state": state, "param_groups": groups}


def _broadcast_tree(tree: Any, layout: DedicatedLayout) -> Any:
    """Rank 0's ``tree`` on every rank: its structure as one object, then each tensor."""
    comm = layout.comm
    if comm.total_ranks == 1:
        return tree
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return ("__tensor__", len(tensors) - 1, tuple(value.shape), value.dtype)
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    skeleton = comm.broadcast_object_from_rank0(strip(tree) if comm.is_rank0 else None)
    received: list[torch.Tensor] = []

    def fill(value: Any) -> Any:
        if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
            _, index, shape, dtype = value
            if comm.is_rank0:
                buffer = tensors[index].detach().to(comm.device).contiguous()
            else:
                buffer = torch.empty(shape, dtype=dtype, device=comm.device)
            comm.broadcast_from_rank0_now(buffer)
            received.append(buffer)
            return buffer
        if isinstance(value, dict):
            return {k: fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v) for v in value]
        return value

    return fill(skeleton)


def _local_value(param: torch.Tensor, value: Any) -> Any:
    """A state value in the layout of ``param`` (a DTensor shard for an FSDP2 parameter)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if isinstance(param, DTensor):
        if isinstance(value, DTensor):
            if value.device_mesh == param.device_mesh and value.placements == param.placements:
                return value
            value = value.full_tensor()
        return distribute_tensor(
            value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def set_dedicated_optimizer_state_dict(
    model: nn.Module,
    state: DedicationState,
    optimizers: tuple,
    optim_state_dict: dict[str, Any],
    options: StateDictOptions,
) -> None:
    """Load an FQN-keyed optimizer state dict into ``optimizers`` of a dedicated model."""
    _check_optimizers(state, optimizers)
    names = _names(model, state)
    layout = DedicatedLayout(state)
    osd = optim_state_dict
    if "state" not in osd and osd:
        osd = _unflatten(osd, optimizers, names)
    if options.broadcast_from_rank0:
        osd = _broadcast_tree(osd if layout.comm.is_rank0 else None, layout)
        options = replace(options, broadcast_from_rank0=False)
    loaded = _Loaded(osd.get("state", {}), osd.get("param_groups", []))
    # A state dict written by a torch optimizer (AdamW, say) has no "algorithm" in its
    # groups: its moments fit this optimizer's AdamW groups, and nothing fits Muon's.
    loaded.foreign = bool(loaded.groups) and all("algorithm" not in g for g in loaded.groups)
    if loaded.foreign and options.strict:
        # torch.optim.Muon + AdamW (a migration) hold everything this optimizer keeps but
        # its settings, which stay this optimizer's.
        gaps = _foreign_gaps(loaded.state, state, optimizers, names)
        if gaps:
            raise ValueError(_FOREIGN_HINT.format(missing="; ".join(gaps)))
    # Parameters whose groups have the checkpoint's variant (the same on every rank).
    same_variant = (
        set() if loaded.foreign else _same_variant(optimizers, loaded.groups, names, options)
    )
    loaded.momenta = _owner_state(
        layout, state.params, loaded.state, MOMENTUM, options, _MISSING_MOMENTUM
    )
    loaded.second_moments = _owner_state(
        layout,
        _normuon_records(state, optimizers, same_variant),
        loaded.state,
        SECOND_MOMENT,
        options,
        _MISSING_SECOND_MOMENT,
    )
    dedicated = {id(dp.param): dp for dp in state.params}
    for optim in optimizers:
        _load_optimizer(optim, names, dedicated, loaded, options)


_MISSING_MOMENTUM = (
    "the optimizer state dict has no Muon momentum for {missing}; it does not come from "
    "dmuon.get_optimizer_state_dict of this model. Pass options=StateDictOptions(strict=False) "
    "to start these momenta at zero (the rest loads), or load only the model part "
    "(dmuon.set_model_state_dict) and start the optimizer fresh."
)
_MISSING_SECOND_MOMENT = (
    "the optimizer state dict has no NorMuon second moment for {missing}; it does not come "
    "from dmuon.get_optimizer_state_dict of this model and optimizer. Pass "
    "options=StateDictOptions(strict=False) to start them at zero (the rest loads)."
)


@dataclass
class _Loaded:
    """An optimizer state dict being loaded: its per-FQN state, its groups, and the
    dedicated matrices' pieces each owner received."""

    state: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]
    foreign: bool = False
    momenta: dict[str, torch.Tensor | None] = field(default_factory=dict)
    second_moments: dict[str, torch.Tensor | None] = field(default_factory=dict)


def _owner_state(
    layout: DedicatedLayout,
    records: list,
    loaded_state: dict[str, dict[str, Any]],
    key: str,
    options: StateDictOptions,
    missing_message: str,
) -> dict[str, torch.Tensor | None]:
    """Send each record's ``key`` state to its owners; return this rank's pieces by name."""
    found = gather_to_owners(
        layout,
        checkpoint_items(records),
        lambda dp: loaded_state.get(dp.fqn, {}).get(key),
        False,
        "optimizer",
    )
    pieces = owner_pieces(layout.comm, records, found)
    missing = _unique([dp.fqn for dp in records if dp.fqn not in found])
    if missing and options.strict:
        raise ValueError(missing_message.format(missing=missing[:5]))
    return pieces


def _group_source(
    group: dict[str, Any], fqns: list[str], loaded: _Loaded, options: StateDictOptions
) -> dict[str, Any] | None:
    """The loaded group whose settings ``group`` takes; refuse one of another algorithm."""
    source = next((g for g in loaded.groups if fqns and fqns[0] in g["params"]), None)
    if loaded.foreign:  # this optimizer's own settings; the momenta and moments load
        source = {k: v for k, v in group.items() if k != "params"}
    if source is None and fqns:
        if options.strict:
            raise ValueError(
                f"the optimizer state dict has no param group holding {fqns[0]!r}; it "
                "does not belong to this model and optimizer (or pass "
                "StateDictOptions(strict=False) to keep this group's settings)"
            )
        source = {k: v for k, v in group.items() if k != "params"}
    if source is not None and source.get("algorithm") != group.get("algorithm"):
        raise ValueError(
            f"the optimizer state dict's param group holding {fqns[0]!r} has "
            f"algorithm {source.get('algorithm')!r}, this optimizer's has "
            f"{group.get('algorithm')!r}: it was written by another optimizer. To "
            "fine-tune from it, load only the model part (dmuon.set_model_state_dict) "
            "and start the optimizer fresh."
        )
    return source


def _load_optimizer(
    optim: torch.optim.Optimizer,
    names: dict[int, str],
    dedicated: dict[int, Any],
    loaded: _Loaded,
    options: StateDictOptions,
) -> None:
    """Load ``optim``'s groups and state from ``loaded``, as index-keyed torch state."""
    _ensure_state(optim)
    index_state: dict[int, dict[str, Any]] = {}
    index_groups: list[dict[str, Any]] = []
    position = 0
    for group in optim.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        source = _group_source(group, fqns, loaded, options)
        values = {k: copy.copy(v) for k, v in (source or {}).items() if k != "params"}
        if group.get("algorithm") == "muon" and values.get("variant", "muon") != group["variant"]:
            # strict=False across variants (checked above): this optimizer's own
            values["variant"], values["beta2"] = group["variant"], group["beta2"]
        values["params"] = list(range(position, position + len(fqns)))
        index_groups.append(values)
        for p, fqn in zip(group["params"], fqns, strict=True):
            dp = dedicated.get(id(p))
            if dp is not None:
                # Under HSDP every replica's owner received the values; the one that
                # steps the matrix keeps them.
                if dp.updates_here and loaded.momenta.get(dp.name) is not None:
                    index_state[position] = {MOMENTUM: loaded.momenta[dp.name]}
                if dp.updates_here and loaded.second_moments.get(dp.name) is not None:
                    index_state.setdefault(position, {})[SECOND_MOMENT] = loaded.second_moments[
                        dp.name
                    ]
            elif fqn in loaded.state:
                index_state[position] = {
                    k: _local_value(p, v) for k, v in loaded.state[fqn].items()
                }
            elif options.strict and p.requires_grad and not loaded.foreign:
                raise ValueError(
                    f"the optimizer state dict has no state for {fqn!r}; pass "
                    "StateDictOptions(strict=False) to start it fresh"
                )
            position += 1
    optim.load_state_dict({"state": index_state, "param_groups": index_groups})


def _same_variant(
    optimizers: tuple,
    loaded_groups: list[dict[str, Any]],
    names: dict[int, str],
    options: StateDictOptions,
) -> set[int]:
    """``id``s of the Muon groups' parameters whose group has the checkpoint's variant.

    Raises in strict mode where a Muon group's variant differs from the checkpoint's (a
    group without ``variant`` was written by Muon).
    """
    same: set[int] = set()
    for optim in optimizers:
        for group in optim.param_groups:
            if group.get("algorithm") != "muon" or not group["params"]:
                continue
            first = names[id(group["params"][0])]
            source = next((g for g in loaded_groups if first in g["params"]), None)
            ours = group["variant"]
            theirs = source.get("variant", "muon") if source is not None else ours
            if ours == theirs:
                same.update(id(p) for p in group["params"])
            elif options.strict:
                raise ValueError(
                    f"the optimizer state dict's Muon group holding {first!r} is variant "
                    f"{theirs!r}, this optimizer's is {ours!r}; nothing was loaded. Create "
                    f"dmuon.Muon(..., variant={theirs!r}) to resume, or pass "
                    "options=StateDictOptions(strict=False) to continue as "
                    f"{ours!r}: the momenta load and NorMuon's second moments start at zero."
                )
    return same
