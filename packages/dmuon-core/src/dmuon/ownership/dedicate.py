"""`dedicate_params`: give every Muon-target matrix to one owner rank."""

from __future__ import annotations

import atexit
import gc
import os
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dmuon.comm import CommAudit, Communicator
from dmuon.ownership.fsdp_integration import install_fsdp_filter, is_fsdp_module, mark_dedicated
from dmuon.ownership.packed_group import PackedGroup
from dmuon.ownership.param import DedicatedParam
from dmuon.ownership.planner import (
    ModulePredicate,
    ParamPredicate,
    default_predicate,
    find_hook_boundary,
    plan_owners,
)
from dmuon.ownership.runtime import Boundary, DedicationRuntime
from dmuon.ownership.state import STATE_ATTR, DedicationState

ROOT_BOUNDARY = ""


def _collect_before_teardown() -> None:
    """Free process groups held by reference cycles before the interpreter tears down.

    Dedicated models and FSDP2 keep their process group alive through reference cycles.
    If those are only collected during interpreter teardown, a gloo worker thread that
    drops its last tensor then aborts the process ("terminate called without an active
    exception"). Collecting them at exit, while the interpreter is whole, avoids that.
    """
    gc.collect()


def _resolve_group(
    model: nn.Module, mesh: DeviceMesh | None
) -> tuple[dist.ProcessGroup | None, torch.device]:
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(
                f"dedicate_params needs a 1-D DeviceMesh, got one with {mesh.ndim} dimensions "
                f"{tuple(mesh.mesh_dim_names or ())}; pass the data-parallel sub-mesh, "
                "e.g. mesh['dp']"
            )
        group = mesh.get_group()
        if mesh.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(mesh.device_type)
        return (group if dist.get_world_size(group) > 1 else None), device
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            return dist.group.WORLD, torch.device("cuda", torch.cuda.current_device())
        return dist.group.WORLD, torch.device("cpu")
    first = next(model.parameters(), None)
    return None, (first.device if first is not None else torch.device("cpu"))


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


def _select(
    model: nn.Module, predicate: ParamPredicate | None
) -> list[tuple[str, nn.Module, str, nn.Parameter, bool]]:
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of[id(param)].append(name)
    selected = []
    skipped_tied: list[list[str]] = []
    for module_name, module in model.named_modules():
        for attr, param in module._parameters.items():
            if param is None or not param.requires_grad:
                continue
            fqn = f"{module_name}.{attr}" if module_name else attr
            if names_of[id(param)][0] != fqn:
                continue  # a later alias of a tied parameter; the first name decides
            tied = len(names_of[id(param)]) > 1
            transposed = _is_conv1d(module) and attr == "weight"
            if predicate is None:
                linear = isinstance(module, nn.Linear) or transposed
                chosen = linear and default_predicate(fqn, param)
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
            if chosen and param.ndim != 2:
                raise ValueError(
                    f"the predicate selected {fqn!r} with shape {tuple(param.shape)}; Muon needs "
                    "2-D matrices. Select only 2-D weights."
                )
            if chosen:
                selected.append((fqn, module, attr, param, transposed))
    if not selected:
        candidates = [n for n, p in model.named_parameters() if p.ndim == 2][:5]
        reason = ""
        if skipped_tied:
            reason = (
                f" Tied weights are never dedicated by default; {len(skipped_tied)} skipped, "
                f"for example: {_tie_reason(model, skipped_tied[0])}."
            )
        raise ValueError(
            f"the predicate matched no parameter, so nothing would be trained with Muon.{reason} "
            f"2-D parameters of this model include: {candidates}. The default predicate takes "
            "the weights of nn.Linear and transformers' Conv1D modules; pass a predicate such "
            "as `lambda name, p: 'proj' in name and p.ndim == 2`."
        )
    return selected


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    predicate: ParamPredicate | None = None,
    *,
    reshard_after_forward: bool = True,
    hook_boundary_predicate: ModulePredicate | None = None,
    hook_boundary_strict: bool = True,
    param_dtype: torch.dtype | None = None,
    check_collectives: bool | None = None,
) -> dict[str, int]:
    """Give every Muon-target matrix of ``model`` to exactly one owner rank.

    Call it on every rank, after moving the model to its device and before
    ``fully_shard``. The owner keeps the full matrix as a float32 master; every other rank
    keeps a 0-element placeholder. FSDP2 leaves dedicated parameters alone.

    Args:
        model: The model; the same on every rank.
        mesh: A 1-D ``DeviceMesh`` (the data-parallel ranks). ``None`` uses the default
            process group, or, without one, runs in one process with everything owned by
            rank 0 and nothing communicated.
        predicate: ``predicate(name, param) -> bool`` selects the Muon-target parameters.
            ``None`` applies `default_predicate` to the weights of ``nn.Linear`` modules and
            skips tied parameters.
        reshard_after_forward: ``True`` (Z3) frees the broadcast buffers after forward and
            broadcasts again before backward; ``False`` (Z2) keeps them resident until
            ``optimizer.step()`` changes the owners' values.
        hook_boundary_predicate: Marks extra hook-boundary modules; the lowest matching
            ancestor of a parameter wins over the ``layers``/``blocks``/``h`` rule.
        hook_boundary_strict: With ``True`` a selected parameter without a hook boundary
            raises ``ValueError``; with ``False`` it joins a boundary on ``model`` itself.
        param_dtype: Forward/broadcast dtype of dedicated parameters (e.g.
            ``torch.bfloat16``); masters and gradient reduction stay float32. Floating-point
            inputs of each boundary are cast to it, as FSDP2's mixed precision does. Every
            boundary must then be wrapped by ``fully_shard`` with
            ``MixedPrecisionPolicy(param_dtype=...)`` (checked at the first forward).
        check_collectives: Before every collective, all-gather its signature and raise on
            every rank if the ranks disagree (a debugging aid that costs one small
            collective each). ``None`` reads the environment variable
            ``DMUON_CHECK_COLLECTIVES`` (``1`` turns it on).

    Returns:
        ``{fqn: owner_rank}`` for every dedicated parameter.

    Raises:
        ValueError: Called twice, after ``fully_shard``, with a mesh that is not 1-D, a
            predicate that matches nothing or selects a tied or non-2-D parameter, or a
            parameter without a hook boundary in strict mode.

    The default predicate selects the weights of ``nn.Linear`` modules and of
    transformers' ``Conv1D`` modules (GPT-2 style, stored as ``(in, out)``; the learning-rate
    adjustment uses ``(out, in)``).
    """
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("dedicate_params was already called on this model; call it once")
    wrapped = [name or "<root>" for name, m in model.named_modules() if is_fsdp_module(m)]
    if wrapped:
        raise ValueError(
            f"dedicate_params must be called before fully_shard, but {wrapped[:3]} are already "
            "wrapped by fully_shard. Call dmuon.dedicate_params(model, mesh) first, then "
            "fully_shard each layer and the model."
        )
    group, device = _resolve_group(model, mesh)
    selected = _select(model, predicate)
    boundaries: dict[str, str] = {}
    for fqn, *_ in selected:
        boundary = find_hook_boundary(model, fqn, hook_boundary_predicate)
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
    comm_rank = dist.get_rank(group) if group is not None else 0
    world_size = dist.get_world_size(group) if group is not None else 1
    plan = plan_owners({fqn: p.shape for fqn, _, _, p, _ in selected}, world_size, boundaries)

    dedicated: list[DedicatedParam] = []
    for fqn, module, attr, param, transposed in selected:
        owner = plan.owners[fqn]
        is_owned = owner == comm_rank
        shape = param.shape
        with torch.no_grad():
            if is_owned:
                param.data = param.data.to(device=device, dtype=torch.float32)
            else:
                param.data = torch.empty(0, dtype=torch.float32, device=device)
        mark_dedicated(param, fqn)
        dedicated.append(
            DedicatedParam(
                fqn=fqn,
                module=module,
                attr=attr,
                owner=owner,
                shape=shape,
                param=param,
                boundary=boundaries[fqn],
                is_owned=is_owned,
                transposed=transposed,
            )
        )

    audit = CommAudit(sum(dp.numel for dp in dedicated))
    if check_collectives is None:
        check_collectives = os.environ.get("DMUON_CHECK_COLLECTIVES", "0") not in ("", "0")
    comm = Communicator(group, device, audit, check_collectives=check_collectives)
    buffer_dtype = param_dtype or torch.float32
    by_boundary: dict[str, list[DedicatedParam]] = defaultdict(list)
    for dp in dedicated:
        by_boundary[dp.boundary].append(dp)
    module_order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    runtime_boundaries = []
    for name in sorted(by_boundary, key=lambda n: module_order[n]):
        by_owner: dict[int, list[DedicatedParam]] = defaultdict(list)
        for dp in by_boundary[name]:
            by_owner[dp.owner].append(dp)
        groups = [
            PackedGroup(by_owner[owner], owner, buffer_dtype, device, comm)
            for owner in sorted(by_owner)
        ]
        runtime_boundaries.append(Boundary(name, model.get_submodule(name), groups))
    runtime = DedicationRuntime(
        model, dedicated, runtime_boundaries, comm, reshard_after_forward, param_dtype
    )
    install_fsdp_filter()
    atexit.unregister(_collect_before_teardown)  # registered once however many models
    atexit.register(_collect_before_teardown)
    setattr(
        model,
        STATE_ATTR,
        DedicationState(
            rank=comm_rank,
            world_size=world_size,
            runtime=runtime,
            params=dedicated,
            plan=plan,
            mesh=mesh,
        ),
    )
    return dict(plan.owners)
