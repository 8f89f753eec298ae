"""Parameter groups of `dmuon.Muon`: the user's groups split by algorithm.

A user group is a dict with ``"params"`` (parameters of the model), an optional ``"name"``
and any of `dmuon.Muon`'s hyperparameters as overrides. Muon names apply to the group's
dedicated matrices, AdamW names (``adamw_*``) to its other parameters. Each user group
becomes up to two optimizer groups, ``algorithm`` ``"muon"`` then ``"adamw"`` (a part
without parameters is left out), in the order the groups are given; parameters in no group
then form the default groups, with the constructor's values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dmuon._ownership.dedication_state import DedicationState
from dmuon._ownership.fsdp_integration import is_dedicated
from dmuon._ownership.param import DedicatedParam
from dmuon.optim._normuon import check_normuon_layouts
from dmuon.optim._validation import validate_adamw_group, validate_muon_group

__all__ = ["ADAMW_KEYS", "MUON_KEYS", "build_param_groups", "weight_decay_groups"]

#: Keys of a user group that set the Muon part's hyperparameters (the constructor's names).
MUON_KEYS: tuple[str, ...] = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "ns_gram",
    "eps",
    "adjust_lr_fn",
    "nonfinite",
    "variant",
    "beta2",
)

#: Keys of a user group that set the AdamW part, and the name each has in that part.
ADAMW_KEYS: dict[str, str] = {
    "adamw_lr": "lr",
    "adamw_betas": "betas",
    "adamw_eps": "eps",
    "adamw_weight_decay": "weight_decay",
}

_OTHER_KEYS = ("params", "name")
#: Every key a user param group may have.
_GROUP_KEYS = frozenset({*_OTHER_KEYS, *MUON_KEYS, *ADAMW_KEYS})


def _params_of(group: Mapping[str, Any], index: int) -> list[nn.Parameter]:
    params = group.get("params")
    if isinstance(params, torch.Tensor):
        return [params]  # type: ignore[list-item]
    if (
        params is None
        or isinstance(params, (str, bytes, Mapping))
        or not isinstance(params, Iterable)
    ):
        raise ValueError(
            f"param_groups[{index}] needs 'params': the model's parameters of the group "
            f"(an iterable of nn.Parameter), got {type(params).__name__}"
        )
    return list(params)


def build_param_groups(
    model: nn.Module,
    state: DedicationState,
    user_groups: Sequence[Mapping[str, Any]] | None,
    muon_defaults: Mapping[str, Any],
    adamw_defaults: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """The optimizer's param groups: each user group's Muon and AdamW parts, then defaults.

    Without user groups, exactly two groups: every dedicated record (``"muon"``) and every
    other parameter of the model (``"adamw"``), frozen ones included, so that they train
    once unfrozen. Hyperparameters are validated by the optimizer, not here.

    Raises:
        ValueError: a group that is not a dict, has no ``params``, an unknown key, a
            parameter that is not the model's, is frozen, or is in two groups.
    """
    # A module holds one parameter per dedicated tensor; a stack split by experts has one
    # record (with its own master) per range, all behind the stack's placeholder.
    records_of: dict[int, list[nn.Parameter]] = {}
    for dp in state.params:
        records_of.setdefault(id(dp.module_param), []).append(dp.param)
    others: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in records_of or is_dedicated(p) or id(p) in seen:
            continue
        seen.add(id(p))
        others.append(p)
    other_ids = {id(p) for p in others}
    names = {id(p): name for name, p in model.named_parameters()}
    claimed: dict[int, int] = {}
    groups: list[dict[str, Any]] = []
    for index, group in enumerate(user_groups or ()):
        _check_group_keys(group, index)
        muon_part: list[int] = []
        adamw_part: list[nn.Parameter] = []
        for p in _params_of(group, index):
            _claim(p, index, claimed, records_of, other_ids, names)
            if id(p) in records_of:
                muon_part.append(id(p))
            else:
                adamw_part.append(p)
        if muon_part:
            chosen = set(muon_part)
            part = {k: group[k] for k in MUON_KEYS if k in group}
            part.update(
                params=[dp.param for dp in state.params if id(dp.module_param) in chosen],
                algorithm="muon",
                name=group.get("name"),
            )
            groups.append(part)
        if adamw_part:
            part = {ADAMW_KEYS[k]: group[k] for k in ADAMW_KEYS if k in group}
            part.update(params=adamw_part, algorithm="adamw", name=group.get("name"))
            groups.append(part)
    rest_muon = [dp.param for dp in state.params if id(dp.module_param) not in claimed]
    rest_adamw = [p for p in others if id(p) not in claimed]
    for algorithm, params in (("muon", rest_muon), ("adamw", rest_adamw)):
        if params or not user_groups:
            groups.append({"params": params, "algorithm": algorithm, "name": "default"})
    for group in groups:
        defaults = muon_defaults if group["algorithm"] == "muon" else adamw_defaults
        for key, value in defaults.items():
            group.setdefault(key, value)
    return groups


def _check_group_keys(group: object, index: int) -> None:
    """Refuse a user group that is not a mapping, or that has a key no group takes."""
    if not isinstance(group, Mapping):
        raise ValueError(
            f"param_groups[{index}] must be a dict with 'params' and hyperparameter "
            f"overrides, got {type(group).__name__}"
        )
    unknown = sorted(set(group) - _GROUP_KEYS)
    if unknown:
        raise ValueError(
            f"param_groups[{index}] has unknown keys {unknown}; a group takes 'params', "
            f"'name', the Muon hyperparameters {list(MUON_KEYS)} (for its dedicated "
            f"matrices) and the AdamW ones {list(ADAMW_KEYS)} (for its other parameters)"
        )


def _claim(
    p: nn.Parameter,
    index: int,
    claimed: dict[int, int],
    records_of: Mapping[int, object],
    other_ids: set[int],
    names: Mapping[int, str],
) -> None:
    """Record that user group ``index`` holds ``p``; refuse a parameter that is not the
    model's, is already in another group, or is frozen."""
    key = id(p)
    if key not in records_of and key not in other_ids:
        raise ValueError(
            f"param_groups[{index}] holds a parameter of shape {tuple(p.shape)} that is "
            "not one of the model's parameters; take the groups' parameters from "
            "model.parameters() after fully_shard (FSDP2 replaces them)"
        )
    name = names.get(key, "?")
    if key in claimed:
        raise ValueError(
            f"{name!r} is in param_groups[{claimed[key]}] and param_groups[{index}]; "
            "put each parameter in one group"
        )
    if not p.requires_grad:
        raise ValueError(
            f"param_groups[{index}] holds the frozen parameter {name!r}; leave frozen "
            "parameters out of param_groups: dmuon.Muon keeps them in its default "
            "groups, so they train with the constructor's settings once unfrozen"
        )
    claimed[key] = index


def weight_decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The usual weight-decay split of ``model``'s trainable parameters, as two groups.

    ``"decay"``: the dedicated matrices and every other parameter of two or more
    dimensions except embeddings; ``"no_decay"`` (``adamw_weight_decay=0``): biases, norm
    weights and other 1-D parameters, and the weights of ``nn.Embedding`` modules (so a
    head tied to the embedding too). Pass the result as
    ``dmuon.Muon(model, param_groups=dmuon.weight_decay_groups(model))``, after
    ``fully_shard`` (it reads the parameters FSDP2 registered). Frozen parameters are left
    out: the optimizer keeps them in its default groups.

    Args:
        model: the model passed to ``dmuon.dedicate_params`` (or its DDP wrapper).
    """
    from dmuon._ownership.dedication_state import unwrap

    model = unwrap(model)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        if is_dedicated(p):
            decay.append(p)  # placeholders have no elements, but dedicated means a matrix
        elif p.ndim < 2 or id(p) in embeddings:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"name": "decay", "params": decay},
        {"name": "no_decay", "params": no_decay, "adamw_weight_decay": 0.0},
    ]


def route_group(param_group: Mapping[str, Any], state: DedicationState) -> list[dict[str, Any]]:
    """A param group without ``"algorithm"`` as groups with one (`dmuon.Muon.add_param_group`).

    Its dedicated parameters go to Muon and the others to AdamW, as the constructor routes
    them. A group of one kind keeps torch's meaning of its keys (``lr`` is that algorithm's
    rate); a group of both kinds takes the constructor's convention for its user groups
    (Muon's names for the dedicated part, ``adamw_*`` for the rest).
    """
    records_of: dict[int, list[nn.Parameter]] = {}
    for dp in state.params:
        records_of.setdefault(id(dp.module_param), []).append(dp.param)
    params = param_group.get("params")
    params = [params] if isinstance(params, torch.Tensor) else list(params or [])
    muon = [r for p in params for r in records_of.get(id(p), [])]
    adamw = [p for p in params if id(p) not in records_of]
    keys = {k: v for k, v in param_group.items() if k != "params"}
    if not (muon and adamw):
        algorithm = "muon" if muon else "adamw"
        return [{**keys, "params": muon or adamw, "algorithm": algorithm}]
    unknown = sorted(set(keys) - _GROUP_KEYS)
    if unknown:
        raise ValueError(
            f'this param group has no "algorithm" and holds {len(muon)} dedicated '
            f"matrices (Muon's) and {len(adamw)} other parameter(s) (AdamW's), so its keys "
            f"follow dmuon.Muon's param_groups: {unknown} are not among them. Give Muon's "
            f"{list(MUON_KEYS)} and AdamW's {list(ADAMW_KEYS)}, or add one group per "
            'algorithm with "algorithm": "muon" or "adamw".'
        )
    name = {"name": keys["name"]} if "name" in keys else {}
    muon_part = {k: v for k, v in keys.items() if k in MUON_KEYS}
    adamw_part = {ADAMW_KEYS[k]: v for k, v in keys.items() if k in ADAMW_KEYS}
    return [
        {**muon_part, **name, "params": muon, "algorithm": "muon"},
        {**adamw_part, **name, "params": adamw, "algorithm": "adamw"},
    ]


def complete_group(
    param_group: dict[str, Any],
    defaults: Mapping[str, Mapping[str, Any]],
    dedicated_by_id: Callable[[], dict[int, DedicatedParam]],
) -> None:
    """Fill a group's missing hyperparameters from ``defaults[algorithm]`` and validate it
    (``dedicated_by_id`` is asked only for a NorMuon group's layouts).

    Raises:
        ValueError: an unknown ``"algorithm"``, or a hyperparameter out of range.
    """
    algorithm = param_group.get("algorithm")
    if algorithm not in defaults:
        raise ValueError(f'param group "algorithm" must be "muon" or "adamw", got {algorithm!r}')
    for key, value in defaults[algorithm].items():
        param_group.setdefault(key, value)
    if algorithm == "muon":
        validate_muon_group(param_group)
        if param_group["variant"] == "normuon":
            check_normuon_layouts(param_group, dedicated_by_id())
    else:
        validate_adamw_group(param_group)
