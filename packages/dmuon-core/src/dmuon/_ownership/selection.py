"""Which parameters `dmuon.dedicate_params` dedicates, their hook boundaries, and the owner
plan: the planning both `dedicate_params` and the cluster planner (`dmuon.plan`) run.

Nothing here communicates or changes the model, so it runs on a model built on the meta
device as well as on a real one.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from torch import nn

from dmuon._ownership.experts import expert_stacks, routing_gate_ids, stores_in_out
from dmuon._ownership.planner import (
    ModulePredicate,
    OwnerPlan,
    ParamPredicate,
    SplitStacks,
    default_predicate,
    find_hook_boundary,
    plan_owners,
    state_dict_name,
)

#: The boundary name of matrices hooked on the model itself (``hook_boundary_strict=False``).
ROOT_BOUNDARY = ""

#: ``(name, module, attribute, parameter, transposed, path)`` of one selected parameter.
Selected = tuple[str, nn.Module, str, nn.Parameter, bool, str]


class DedicationPlan(NamedTuple):
    """What `plan_dedication` decided: the selected parameters, their boundaries, owners."""

    selected: list[Selected]
    boundaries: dict[str, str]
    plan: OwnerPlan


def plan_dedication(
    model: nn.Module,
    world_size: int,
    replicas: int = 1,
    predicate: ParamPredicate | None = None,
    *,
    hook_boundary_predicate: ModulePredicate | None = None,
    hook_boundary_strict: bool = True,
    split_expert_stacks: SplitStacks = "auto",
    ns_split: int = 1,
) -> DedicationPlan:
    """Select the Muon-target parameters of ``model``, find their hook boundaries and plan
    their owners over ``world_size`` shard ranks times ``replicas`` replicas.

    The arguments mean what they mean for `dmuon.dedicate_params`, which calls this.

    Raises:
        ValueError: As `dmuon.dedicate_params` does for a predicate or a boundary.
    """
    selected, boundaries = select_with_boundaries(
        model, predicate, hook_boundary_predicate, hook_boundary_strict
    )
    plan = plan_selected(selected, boundaries, world_size, replicas, split_expert_stacks, ns_split)
    return DedicationPlan(selected, boundaries, plan)


def plan_selected(
    selected: list[Selected],
    boundaries: dict[str, str],
    world_size: int,
    replicas: int = 1,
    split_expert_stacks: SplitStacks = "auto",
    ns_split: int = 1,
) -> OwnerPlan:
    """The owners of parameters `select_with_boundaries` chose: the part of
    `plan_dedication` that depends on the mesh."""
    return plan_owners(
        {fqn: p.shape for fqn, _, _, p, _, _ in selected},
        world_size,
        boundaries,
        split_expert_stacks=split_expert_stacks,
        replicas=replicas,
        ns_split=ns_split,
    )


def select_with_boundaries(
    model: nn.Module,
    predicate: ParamPredicate | None = None,
    hook_boundary_predicate: ModulePredicate | None = None,
    hook_boundary_strict: bool = True,
) -> tuple[list[Selected], dict[str, str]]:
    """The Muon-target parameters of ``model`` and each one's hook boundary: the part of
    `plan_dedication` that does not depend on the mesh.

    Raises:
        ValueError: As `dmuon.dedicate_params` does for a predicate or a boundary.
    """
    selected = _select(model, predicate)
    boundaries: dict[str, str] = {}
    for fqn, *_, path in selected:
        boundary = find_hook_boundary(model, path, hook_boundary_predicate)
        if boundary is None:
            if hook_boundary_strict:
                raise ValueError(
                    f"{fqn!r} has no hook boundary: it is not inside an element of a ModuleList "
                    "named 'layers', 'blocks' or 'h'. Pass hook_boundary_predicate="
                    "lambda m: isinstance(m, MyBlock), or hook_boundary_strict=False to hook it "
                    "on the model itself."
                )
            boundary = ROOT_BOUNDARY
        boundaries[fqn] = boundary
    return selected, boundaries


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 and relatives): a linear layer stored as (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _shared_modules(model: nn.Module) -> dict[str, list[str]]:
    """``{first name: [other names]}`` of module objects that appear under several names."""
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, module in model.named_modules(remove_duplicate=False):
        names_of[id(module)].append(name)
    return {names[0]: names[1:] for names in names_of.values() if len(names) > 1}


def _tie_reason(model: nn.Module, names: list[str]) -> str:
    """Why these parameter names share one tensor: a shared block, or tied weights."""
    for block, aliases in _shared_modules(model).items():
        if block and names[0].startswith(block + "."):
            return (
                f"the block object {block!r} is listed again as {aliases[0]!r}, so its weights "
                "are shared by both positions"
            )
    others = ", ".join(repr(n) for n in names[1:])
    return f"{names[0]!r} is tied to {others}"


def _select(model: nn.Module, predicate: ParamPredicate | None) -> list[Selected]:
    """``(name, module, attribute, parameter, transposed, path)`` of every selected one.

    ``name`` is the state-dict name (wrapper modules left out, see `state_dict_name`),
    what the predicate sees and the dedication calls it; ``path`` the attribute path.
    """
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of[id(param)].append(name)
    gates = routing_gate_ids(model) if predicate is None else set()
    selected = []
    skipped_tied: list[list[str]] = []
    for module_name, module in model.named_modules():
        stacks = expert_stacks(module)
        for attr, param in module._parameters.items():
            if param is None:
                continue
            path = f"{module_name}.{attr}" if module_name else attr
            if names_of[id(param)][0] != path:
                continue  # a later alias of a tied parameter; the first name decides
            fqn = state_dict_name(path)
            tied = len(names_of[id(param)]) > 1
            transposed = (_is_conv1d(module) and attr == "weight") or (
                param.ndim == 3 and stores_in_out(module)
            )
            if predicate is None:
                linear = isinstance(module, nn.Linear) or _is_conv1d(module)
                chosen = (linear and default_predicate(fqn, param) and id(param) not in gates) or (
                    attr in stacks
                )
                if chosen and tied:
                    skipped_tied.append(names_of[id(param)])
                    chosen = False
            else:
                chosen = bool(predicate(fqn, param))
                if chosen and tied:
                    raise ValueError(
                        f"the predicate selected {fqn!r}, but "
                        f"{_tie_reason(model, names_of[id(param)])}; a tied parameter cannot be "
                        "dedicated (its owner could not serve both uses). Exclude it from the "
                        "predicate so it stays with FSDP2 and AdamW, or give each position its "
                        "own block."
                    )
            if chosen and param.ndim not in (2, 3):
                raise ValueError(
                    f"the predicate selected {fqn!r} with shape {tuple(param.shape)}; Muon needs "
                    "2-D matrices, or 3-D stacks whose leading dimension indexes independent "
                    "matrices (fused experts). Select only 2-D and 3-D weights; leave other "
                    "parameters to AdamW, or reshape them into such a layout first."
                )
            if chosen:
                selected.append((fqn, module, attr, param, transposed, path))
    if not selected:
        candidates = [n for n, p in model.named_parameters() if p.ndim in (2, 3)][:5]
        reason = ""
        if skipped_tied:
            reason = (
                f" Tied weights are never dedicated by default; {len(skipped_tied)} skipped, "
                f"for example: {_tie_reason(model, skipped_tied[0])}."
            )
        raise ValueError(
            f"the predicate matched no parameter, so nothing would be trained with Muon.{reason} "
            f"2-D and 3-D parameters of this model include: {candidates}. The default "
            "predicate takes the weights of nn.Linear and transformers' Conv1D modules and "
            "fused expert stacks (3-D gate_up_proj/down_proj); pass a predicate such as "
            "`lambda name, p: 'proj' in name and p.ndim == 2`."
        )
    return selected
