"""`dedicate_params`: give every Muon-target matrix to one owner rank."""

from __future__ import annotations

import atexit
import os
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dmuon._comm import Communicator
from dmuon._comm_audit import CommAudit
from dmuon._ownership.ddp_integration import keep_out_of_ddp
from dmuon._ownership.dedication_state import STATE_ATTR, DedicationState, attach
from dmuon._ownership.experts import fused_gate_up_parts
from dmuon._ownership.flat_buffer import FlatBuffer
from dmuon._ownership.fsdp_integration import (
    install_fsdp_filter,
    is_dedicated,
    is_fsdp_module,
    mark_dedicated,
)
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.planner import (
    ExpertRange,
    ModulePredicate,
    ParamPredicate,
    SplitStacks,
    range_name,
)
from dmuon._ownership.runtime import Boundary, DedicationRuntime
from dmuon._ownership.selection import plan_dedication
from dmuon._ownership.split_blocks import make_split_block
from dmuon._ownership.tp_integration import assign_workers, leaf_for, tensor_parallel_of
from dmuon._teardown import before_interpreter_exit

#: Dimension names of a 2-D mesh read as (replicate, shard), as FSDP2's HSDP uses it.
REPLICATE_DIM_NAMES = ("replicate", "dp_replicate")
SHARD_DIM_NAMES = ("shard", "dp_shard")

_HSDP_MESH_HINT = (
    "init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=('replicate', 'shard'))"
)


def _mesh_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """``(shard group, replicate group)`` of a 1-D mesh or a 2-D ``(replicate, shard)`` mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:
        return mesh.get_group(), None
    if mesh.ndim == 2:
        if not names or (names[0] in REPLICATE_DIM_NAMES and names[1] in SHARD_DIM_NAMES):
            return mesh.get_group(1), mesh.get_group(0)
        raise ValueError(
            f"dedicate_params takes a 1-D DeviceMesh or a 2-D (replicate, shard) DeviceMesh "
            f"as FSDP2's HSDP uses it, but this 2-D mesh's dimensions are named {names}. "
            f"For HSDP pass {_HSDP_MESH_HINT} (the same mesh as fully_shard(..., mesh=...)); "
            "for other parallelisms pass the data-parallel sub-mesh, e.g. mesh['dp']"
        )
    raise ValueError(
        f"dedicate_params takes a 1-D DeviceMesh or a 2-D (replicate, shard) DeviceMesh, "
        f"got one with {mesh.ndim} dimensions {names}; pass the data-parallel part: a 1-D "
        f"sub-mesh such as mesh['dp'], or a 2-D one such as mesh['replicate', 'shard'] "
        f"built with {_HSDP_MESH_HINT}"
    )


def _resolve_group(
    model: nn.Module, mesh: DeviceMesh | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, torch.device]:
    """``(shard group, replicate group, device)``; a group of one rank is ``None``."""
    if mesh is not None:
        group, replicate = _mesh_groups(mesh)
        if mesh.device_type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device(mesh.device_type)
        if replicate is not None and dist.get_world_size(replicate) == 1:
            replicate = None
        return (group if dist.get_world_size(group) > 1 else None), replicate, device
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            return dist.group.WORLD, None, torch.device("cuda", torch.cuda.current_device())
        return dist.group.WORLD, None, torch.device("cpu")
    first = next(model.parameters(), None)
    if first is None or first.is_meta:
        # A model built on the meta device is materialised where it will run.
        cuda = torch.cuda.is_available()
        return (
            None,
            None,
            torch.device("cuda", torch.cuda.current_device()) if cuda else (torch.device("cpu")),
        )
    return None, None, first.device


def _master_data(
    data: torch.Tensor, is_owned: bool, device: torch.device, copy: bool = False
) -> torch.Tensor:
    """The owner's float32 master values on ``device``; a 0-element placeholder elsewhere.

    From the meta device the owner's master is allocated, not initialised: ``to_empty``,
    ``init_weights`` or a loaded state dict give it values, as for FSDP2's shards."""
    if is_owned:
        if data.is_meta:
            return torch.empty(data.shape, dtype=torch.float32, device=device)
        return data.detach().to(device=device, dtype=torch.float32, copy=copy)
    return torch.empty(0, dtype=torch.float32, device=device)


def _hold(module: nn.Module, attr: str, param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """``param`` holding ``data`` from now on: the same parameter, or, for a parameter on
    the meta device (whose data cannot change device), a new one registered in its place."""
    if param.is_meta and not data.is_meta:
        held = nn.Parameter(data, requires_grad=param.requires_grad)
        module._parameters[attr] = held
        return held
    with torch.no_grad():
        param.data = data
    return param


def _hold_shard(
    fqn: str,
    module: nn.Module,
    attr: str,
    param: nn.Parameter,
    is_owned: bool,
    device: torch.device,
) -> nn.Parameter:
    """Register a tensor-parallel DTensor's local shard as the plain parameter the module
    holds between forwards (the owner's master, a placeholder elsewhere); forward sees the
    DTensor."""
    registered = nn.Parameter(
        _master_data(param.to_local(), is_owned, device, copy=True),
        requires_grad=param.requires_grad,
    )
    module._parameters[attr] = registered
    mark_dedicated(registered, fqn)
    return registered


def _records(
    fqn: str,
    module: nn.Module,
    attr: str,
    param: nn.Parameter,
    owners: tuple[ExpertRange, ...] | int,
    comm_rank: int,
    replica_of: Callable[[str], int],
    replica_rank: int,
    device: torch.device,
    boundary: str,
    transposed: bool,
) -> list[DedicatedParam]:
    """The dedication records of one selected parameter.

    ``owners`` is one owner rank (the parameter stays whole) or the ranges of a stack split
    by experts; ``replica_of(name)`` is the replica whose owner steps a record (HSDP).
    Whole: one record; the parameter becomes its owner's float32 master and a
    0-element placeholder elsewhere. Split: one record per range; a range's owner keeps a
    float32 master of its experts, and the stack becomes a 0-element placeholder on every
    rank (what the module holds between forwards).
    """
    whole = isinstance(owners, int)
    full_shape = param.shape
    tp = tensor_parallel_of(fqn, param)
    if tp is not None and not whole:
        raise ValueError(
            f"{fqn!r} is a tensor-parallel DTensor and a 3-D expert stack; such a stack "
            "cannot be split by experts: pass dedicate_params(..., split_expert_stacks=False)"
        )
    if tp is not None:
        assert isinstance(owners, int)
        is_owned = owners == comm_rank
        registered = _hold_shard(fqn, module, attr, param, is_owned, device)
        update_replica = replica_of(fqn)
        return [
            DedicatedParam(
                fqn=fqn,
                module=module,
                attr=attr,
                owner=owners,
                shape=param.to_local().shape,
                param=registered,
                boundary=boundary,
                is_owned=is_owned,
                transposed=transposed,
                fused_parts=fused_gate_up_parts(fqn, module, attr),
                tp=tp,
                update_replica=update_replica,
                updates_here=is_owned and update_replica == replica_rank,
            )
        ]
    ranges = [ExpertRange(0, int(full_shape[0]), owners)] if whole else list(owners)
    records = []
    for start, stop, owner in ranges:
        is_owned = owner == comm_rank
        update_replica = replica_of(fqn if whole else range_name(fqn, start, stop))
        if whole:
            master = _hold(module, attr, param, _master_data(param.data, is_owned, device))
        else:
            # A copy: a view of the slice would keep the whole stack's storage alive.
            data = _master_data(param.data[start:stop], is_owned, device, copy=True)
            master = nn.Parameter(data, requires_grad=param.requires_grad)
            mark_dedicated(master, fqn)
        records.append(
            DedicatedParam(
                fqn=fqn,
                module=module,
                attr=attr,
                owner=owner,
                shape=full_shape if whole else torch.Size((stop - start, *full_shape[1:])),
                param=master,
                boundary=boundary,
                is_owned=is_owned,
                transposed=transposed,
                fused_parts=fused_gate_up_parts(fqn, module, attr),
                experts=None if whole else (start, stop),
                registered=None if whole else param,
                stack_shape=None if whole else full_shape,
                update_replica=update_replica,
                updates_here=is_owned and update_replica == replica_rank,
            )
        )
    if not whole:
        placeholder = _hold(module, attr, param, torch.empty(0, dtype=torch.float32, device=device))
        for record in records:
            record.registered = placeholder
        param = placeholder
    mark_dedicated(records[0].param if whole else param, fqn)
    return records


def _flat_buffer(
    records: list[DedicatedParam],
    dtype: torch.dtype,
    device: torch.device,
    comm: Communicator,
    reduce_dtype: torch.dtype,
    broadcast_dtype: torch.dtype | None,
) -> FlatBuffer:
    """One boundary's buffer, the same on every rank: its whole matrices grouped by owner,
    then each stack split by experts (its ranges in expert order)."""
    by_owner: dict[int, list[DedicatedParam]] = defaultdict(list)
    by_stack: dict[str, list[DedicatedParam]] = defaultdict(list)
    for dp in records:
        if dp.is_range:
            by_stack[dp.fqn].append(dp)
        else:
            by_owner[dp.owner].append(dp)
    ordered: list[DedicatedParam] = []
    views = []
    for owner in sorted(by_owner):
        for dp in by_owner[owner]:
            views.append((dp.module, dp.attr, dp.param, [len(ordered)], dp.fqn))
            ordered.append(dp)
    for ranges in by_stack.values():
        ranges = sorted(ranges, key=lambda dp: dp.experts or (0, 0))
        first = ranges[0]
        assert first.registered is not None
        covered = list(range(len(ordered), len(ordered) + len(ranges)))
        views.append((first.module, first.attr, first.registered, covered, first.fqn))
        ordered += ranges
    return FlatBuffer.build(
        ordered, views, dtype, device, comm, _leaf, reduce_dtype, broadcast_dtype
    )


def _leaf(view: torch.Tensor, requires_grad: bool, record: DedicatedParam) -> nn.Parameter:
    return leaf_for(record.tp, view, requires_grad)


def dedicate_params(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    predicate: ParamPredicate | None = None,
    *,
    reshard_after_forward: bool = True,
    hook_boundary_predicate: ModulePredicate | None = None,
    hook_boundary_strict: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    broadcast_dtype: torch.dtype | None = None,
    check_collectives: bool | None = None,
    split_expert_stacks: SplitStacks = "auto",
    ns_split: int = 1,
) -> dict[str, int]:
    """Give every Muon-target matrix of ``model`` to exactly one owner rank.

    Call it on every rank, before ``fully_shard``. A model moved afterwards (``model.to``,
    ``to_empty``, or ``fully_shard`` moving the parameters it manages) is followed before
    the next forward: its dedicated masters and buffers go to FSDP2's device, or to where
    the model was moved, in its new dtype (in one process; a process group's device is
    fixed, so move the model first there). The owner keeps the full matrix as a
    float32 master; every other rank keeps a 0-element placeholder. FSDP2 leaves
    dedicated parameters alone. From the meta device the owner's master is allocated on
    the mesh's device without values: ``to_empty`` then ``init_weights``, or a state dict
    loaded with `dmuon.set_model_state_dict` (``broadcast_from_rank0`` included), give it
    values, so no rank allocates the whole model.

    Args:
        model: The model; the same on every rank.
        mesh: A 1-D ``DeviceMesh`` (the data-parallel ranks), or the 2-D
            ``(replicate, shard)`` mesh of FSDP2's HSDP (dimension names ``replicate`` and
            ``shard``, or none). On a 2-D mesh each matrix has one owner per replica, at
            the same shard rank in every replica, holding its master: broadcasts and
            reduces stay inside the shard group, and the plan, made over every rank of the
            mesh, picks the one replica whose owner steps the matrix. The owners
            reduce-scatter gradients by matrix across replicas, and the stepping owner
            sends its update to the others after ``optimizer.step()``. ``None``
            uses the default process group, or,
            without one, runs in one process with everything owned by rank 0 and nothing
            communicated.
        predicate: ``predicate(name, param) -> bool`` selects the Muon-target parameters:
            2-D matrices, or 3-D stacks whose leading dimension indexes independent matrices
            (fused experts; each matrix is orthogonalized on its own). ``None`` applies
            `default_predicate` to the weights of ``nn.Linear`` modules, adds the fused
            expert stacks of mixture-of-experts modules, and skips tied parameters and
            routers.
        reshard_after_forward: ``True`` (Z3) frees the broadcast buffers after forward and
            broadcasts again before backward; ``False`` (Z2) keeps them allocated for the
            whole run (never freed), broadcasting again once ``optimizer.step()`` changed
            the owners' values. Only a bool: ``fully_shard``'s integer form has no meaning
            for matrices broadcast whole.
        hook_boundary_predicate: Marks extra hook-boundary modules; the lowest matching
            ancestor of a parameter wins over the ``layers``/``blocks``/``h`` rule.
        hook_boundary_strict: With ``True`` a selected parameter without a hook boundary
            raises ``ValueError``; with ``False`` it joins a boundary on ``model`` itself.
        param_dtype: Forward/broadcast dtype of dedicated parameters (e.g.
            ``torch.bfloat16``); masters stay float32. ``None``: the ``param_dtype`` of the
            ``MixedPrecisionPolicy`` of the ``fully_shard`` around each hook boundary
            (read at the first forward), else float32. Given, floating-point inputs of each
            boundary are cast to it, as FSDP2's mixed precision does, and every boundary
            must be wrapped by ``fully_shard``; a policy with another ``param_dtype``
            raises at the first forward (the layer would mix dtypes).
        reduce_dtype: The dtype gradients are summed in on their way to the owner (and
            between replicas under HSDP), as ``MixedPrecisionPolicy(reduce_dtype=...)`` is
            for FSDP2: ``torch.bfloat16`` halves the reduce's bytes. The local
            accumulation under `no_sync`, the owner's averaged gradient, the masters and
            the momentum stay float32. ``None``: what FSDP2's policy around the boundary
            reduces in (its ``reduce_dtype``, else its ``param_dtype``), else float32. A
            policy that reduces in another dtype raises at the first forward: set it once,
            in the policy, and the dedicated matrices follow.
        broadcast_dtype: The dtype matrices are broadcast in from their owners, then
            widened into the forward buffers (every rank, the owner too, computes with the
            same rounded values): ``torch.bfloat16`` halves the broadcasts' bytes while the
            forward runs in ``param_dtype``. ``None``: ``param_dtype`` (float32 without it).
        check_collectives: Before every collective, all-gather its signature and raise on
            every rank if the ranks disagree (a debugging aid that costs one small
            collective each). ``None`` reads the environment variable
            ``DMUON_CHECK_COLLECTIVES`` (``1`` turns it on).
        split_expert_stacks: Whether a 3-D expert stack may be split by experts across
            owners. ``"auto"`` lets the planner split a stack whose Newton-Schulz cost
            exceeds the per-rank share (total / ranks) when that lowers the largest
            per-rank load; ``True`` splits every stack; ``False`` keeps every stack whole
            on one owner. See `dmuon.plan_owners`.
        ns_split: Ranks per block that may share one matrix's Newton-Schulz iteration
            (default 1: every iteration runs whole on one rank). Blocks are consecutive
            ranks of a shard group, so pass a divisor of its size, typically the GPUs per
            node. With more ranks than matrices to balance, the planner then spreads the
            matrices over blocks and splits the iterations that lighten the busiest ranks:
            each block member iterates a slice of the matrix's long side, and the Gram
            matrix is all-reduced inside the block every iteration (see the Scaling page).
            Not with tensor parallelism, and the mesh must hold every rank of the
            default process group (every rank makes the blocks' process groups).

    Returns:
        ``{name: owner_rank}`` for every dedicated parameter; on a 2-D mesh the owner's
        rank inside its shard group. A stack split by experts appears once per range, as
        ``fqn[start:stop]`` (experts ``start`` to ``stop - 1``).

    Raises:
        ValueError: Called twice, after ``fully_shard``, with a mesh that is neither 1-D
            nor a 2-D ``(replicate, shard)`` mesh, a predicate that matches nothing or
            selects a tied parameter or one that is neither 2-D nor 3-D, a parameter
            without a hook boundary in strict mode, or a ``split_expert_stacks`` other than
            ``"auto"``, ``True`` or ``False``.

    The default predicate selects the weights of ``nn.Linear`` modules and of
    transformers' ``Conv1D`` modules (GPT-2 style, stored as ``(in, out)``; the learning-rate
    adjustment uses ``(out, in)``), and the fused expert stacks of mixture-of-experts
    modules: the 3-D ``gate_up_proj`` / ``down_proj`` (and ``gate_proj`` / ``up_proj``)
    parameters of any module holding such a ``gate_up_proj`` or ``down_proj`` (transformers'
    Mixtral, Qwen2-MoE, Qwen3-MoE experts and modules of the same layout). A stack is one
    dedicated tensor with one owner, broadcast and reduced as a whole, unless the planner
    splits it by experts (``split_expert_stacks``): each contiguous range of experts then
    has its own owner, which keeps the master and the Muon momentum of those experts, and
    broadcasts and reduces its range as an item of its own. Routers and the
    other gates next to an experts module (a router's ``experts x hidden`` matrix,
    Qwen2-MoE's ``shared_expert_gate``) stay with AdamW: the top-k choice depends on the
    relative scale of the router's rows, which Muon's equal-size orthogonalized update
    would override.
    """
    _check_arguments(model, reshard_after_forward, param_dtype, reduce_dtype, broadcast_dtype)
    group, replicate_group, device = _resolve_group(model, mesh)
    comm_rank = dist.get_rank(group) if group is not None else 0
    world_size = dist.get_world_size(group) if group is not None else 1
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    replica_rank = dist.get_rank(replicate_group) if replicate_group is not None else 0
    selected, boundaries, plan = plan_dedication(
        model,
        world_size,
        replicas,
        predicate,
        hook_boundary_predicate=hook_boundary_predicate,
        hook_boundary_strict=hook_boundary_strict,
        split_expert_stacks=split_expert_stacks,
        ns_split=ns_split,
    )
    if ns_split > 1 and any(tensor_parallel_of(f, p) is not None for f, _, _, p, *_ in selected):
        raise ValueError(
            "ns_split does not combine with tensor parallelism: a tensor-parallel matrix's "
            "iteration already runs on its gathered whole; pass ns_split=1"
        )
    split_block = make_split_block(plan, mesh, group, comm_rank, replica_rank)
    dedicated = [
        record
        for fqn, module, attr, param, transposed, _ in selected
        for record in _records(
            fqn,
            module,
            attr,
            param,
            plan.expert_ranges.get(fqn, plan.owners.get(fqn, -1)),
            comm_rank,
            lambda name: plan.workers.get(name, 0),
            replica_rank,
            device,
            boundaries[fqn],
            transposed,
        )
    ]
    comm = _communicator(dedicated, group, replicate_group, replicas, device, check_collectives)
    runtime_boundaries = _boundaries(
        model,
        dedicated,
        param_dtype or torch.float32,
        device,
        comm,
        (reduce_dtype or torch.float32, broadcast_dtype),
    )
    runtime = DedicationRuntime(
        model,
        dedicated,
        runtime_boundaries,
        comm,
        reshard_after_forward,
        param_dtype,
        reduce_dtype,
    )
    install_fsdp_filter()
    keep_out_of_ddp(model, [n for n, p in model.named_parameters() if is_dedicated(p)])
    atexit.unregister(before_interpreter_exit)  # registered once however many models
    atexit.register(before_interpreter_exit)
    attach(
        model,
        DedicationState(
            rank=comm_rank,
            world_size=world_size,
            runtime=runtime,
            params=dedicated,
            plan=plan,
            split_block=split_block,
            mesh=mesh
            if mesh is not None or group is None
            else DeviceMesh.from_group(group, device.type),
        ),
    )
    return dict(plan.owners)


def _check_arguments(
    model: nn.Module,
    reshard_after_forward: object,
    param_dtype: object,
    reduce_dtype: object,
    broadcast_dtype: object,
) -> None:
    """Refuse a second dedication, an integer ``reshard_after_forward``, a dtype that is
    not a floating-point one, and a model ``fully_shard`` already wrapped."""
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("dedicate_params was already called on this model; call it once")
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward must be True (Z3) or False (Z2), not "
            f"{reshard_after_forward!r}: dedicated matrices are broadcast whole from their "
            "owners, so fully_shard's integer form (reshard to a smaller group of ranks) has "
            "no meaning for them. fully_shard itself may still take the integer."
        )
    for name, value in (
        ("param_dtype", param_dtype),
        ("reduce_dtype", reduce_dtype),
        ("broadcast_dtype", broadcast_dtype),
    ):
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(
                f"{name} must be a floating-point torch.dtype such as torch.bfloat16, or None, "
                f"got {value!r}"
            )
    wrapped = [name or "<root>" for name, m in model.named_modules() if is_fsdp_module(m)]
    if wrapped:
        raise ValueError(
            f"dedicate_params must be called before fully_shard, but {wrapped[:3]} are already "
            "wrapped by fully_shard. Call dmuon.dedicate_params(model, mesh) first, then "
            "fully_shard each layer and the model."
        )


def _communicator(
    dedicated: list[DedicatedParam],
    group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
    replicas: int,
    device: torch.device,
    check_collectives: bool | None,
) -> Communicator:
    """The collectives of the dedicated matrices, audited; tensor-parallel ones get their
    optimizer workers here (a 3-D mesh, tp with HSDP, is refused)."""
    tp_records = [dp for dp in dedicated if dp.tp is not None]
    if tp_records and replicate_group is not None:
        raise ValueError(
            f"{tp_records[0].fqn!r} is tensor-parallel and the mesh is 2-D (HSDP): tensor "
            "parallelism with HSDP (a 3-D mesh) is not supported. Use a (dp, tp) mesh and "
            "pass mesh['dp'] to dedicate_params and fully_shard."
        )
    assign_workers([(dp.tp, dp.owner) for dp in tp_records if dp.tp is not None])
    audit = CommAudit(
        sum(dp.numel for dp in dedicated),
        replicas,
        sum(dp.global_shape.numel() for dp in dedicated) if tp_records else None,
    )
    if check_collectives is None:
        check_collectives = os.environ.get("DMUON_CHECK_COLLECTIVES", "0") not in ("", "0")
    return Communicator(
        group,
        device,
        audit,
        check_collectives=check_collectives,
        replicate_group=replicate_group,
    )


def _boundaries(
    model: nn.Module,
    dedicated: list[DedicatedParam],
    buffer_dtype: torch.dtype,
    device: torch.device,
    comm: Communicator,
    wire: tuple[torch.dtype, torch.dtype | None],
) -> list[Boundary]:
    """One `Boundary` per hook boundary holding dedicated matrices, in module order, each
    with its packed buffer (``wire``: the reduce and gather dtypes)."""
    by_boundary: dict[str, list[DedicatedParam]] = defaultdict(list)
    for dp in dedicated:
        by_boundary[dp.boundary].append(dp)
    module_order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return [
        Boundary(
            name,
            model.get_submodule(name),
            _flat_buffer(by_boundary[name], buffer_dtype, device, comm, *wire),
        )
        for name in sorted(by_boundary, key=lambda n: module_order[n])
    ]
