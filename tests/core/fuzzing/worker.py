"""One phase of a case on one rank: build the layout, train, checkpoint, report.

The three-line integration in each layout, in the order users write it:

- ``fsdp`` / ``hsdp``: ``dedicate_params(model, mesh)``, ``fully_shard`` on every layer and
  on the model (1-D mesh, or a 2-D ``("replicate", "shard")`` mesh), ``dmuon.Muon``;
- ``ddp``: ``dedicate_params(model, mesh)``, ``DistributedDataParallel(model)``;
- ``tp``: ``parallelize_module(model, mesh["tp"], plan)`` with torch's Colwise/Rowwise
  styles, ``dedicate_params(model, mesh["dp"])``, ``fully_shard(..., mesh=mesh["dp"])``.

With ``bf16`` the dedicated matrices are broadcast in bfloat16 (``param_dtype``) and FSDP2
casts the rest with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.

Every collective issued while training is recorded with its process group (the global
ranks in it), kind and size: the parent checks that every member of a group issued the
same sequence on it.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
from collectives import Collective, recorded_collectives
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon
from fuzzing.cases import AFTER_DEDICATION, BEFORE_DEDICATION, Case, Phase
from fuzzing.models import Decoder, loss_of, tp_plan
from fuzzing.training import (
    ADAMW_LR,
    ADAMW_WD,
    CUSTOM_MUON,
    CUSTOM_NO_DECAY_LR,
    LR,
    apply_schedule,
    global_batch,
    layer0_prefix,
    pieces,
    static_frozen,
)

_MESHES: dict[tuple[Any, ...], Any] = {}


def mesh_of(phase: Phase) -> Any:
    """The phase's device mesh (made once per process and shape: meshes hold groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (phase.layout if phase.layout in ("hsdp", "tp") else "1d", phase.mesh)
    if key not in _MESHES:
        if phase.layout == "hsdp":
            assert phase.mesh is not None
            mesh = init_device_mesh("cpu", phase.mesh, mesh_dim_names=("replicate", "shard"))
        elif phase.layout == "tp":
            assert phase.mesh is not None
            mesh = init_device_mesh("cpu", phase.mesh, mesh_dim_names=("dp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (phase.world,))
        _MESHES[key] = mesh
    return _MESHES[key]


def _groups(case: Case, wrapped: nn.Module) -> list[dict[str, Any]] | None:
    if case.groups is None:
        return None
    decay, no_decay = dmuon.weight_decay_groups(wrapped)
    if case.groups == "decay":
        return [decay, no_decay]
    model = wrapped.module if isinstance(wrapped, nn.parallel.DistributedDataParallel) else wrapped
    dedicated = {
        id(p) for p in model.parameters() if dmuon._ownership.fsdp_integration.is_dedicated(p)
    }
    names = {id(p): n for n, p in model.named_parameters()}
    first = [
        p
        for p in decay["params"]
        if id(p) in dedicated and names[id(p)].startswith(layer0_prefix(case))
    ]
    decay["params"] = [p for p in decay["params"] if all(p is not q for q in first)]
    no_decay["adamw_lr"] = CUSTOM_NO_DECAY_LR
    groups = [decay, no_decay]
    if first:
        groups.insert(0, {"name": "layer0", "params": first, **CUSTOM_MUON})
    return groups


def build(case: Case, phase: Phase) -> tuple[nn.Module, nn.Module, dmuon.Muon, Any]:
    """``(model, wrapped, optimizer, mesh)`` of the phase, as a user script builds them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = mesh_of(phase)
    model = Decoder(case.model, case.seed)
    for name in static_frozen(case, BEFORE_DEDICATION):
        model.get_parameter(name).requires_grad_(False)
    dp_mesh = mesh
    if phase.layout == "tp":
        plan = tp_plan(model)
        if plan:
            parallelize_module(model, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    dmuon.dedicate_params(
        model,
        dp_mesh,
        reshard_after_forward=phase.mode == "z3",
        param_dtype=torch.bfloat16 if phase.bf16 else None,
        check_collectives=phase.check_collectives,
        ns_split=phase.ns_split,
    )
    for name in static_frozen(case, AFTER_DEDICATION):
        model.get_parameter(name).requires_grad_(False)
    wrapped: nn.Module = model
    if phase.layout == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if phase.bf16
            else MixedPrecisionPolicy()
        )
        for block in model.blocks:
            fully_shard(
                block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=phase.fsdp_reshard
            )
        fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=phase.fsdp_reshard)
    optimizer = dmuon.Muon(
        wrapped,
        lr=LR,
        momentum=case.momentum,
        nesterov=case.nesterov,
        weight_decay=case.weight_decay,
        ns_dtype=torch.float32,
        adjust_lr_fn=case.adjust_lr_fn,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WD,
        param_groups=_groups(case, wrapped),
    )
    return model, wrapped, optimizer, mesh


def data_rank(phase: Phase, mesh: Any, rank: int) -> int:
    """This rank's data-parallel index (tensor-parallel ranks share one)."""
    return mesh["dp"].get_local_rank() if phase.layout == "tp" else rank


def backward_and_clip(
    case: Case, phase: Phase, step: int, first: int, wrapped: nn.Module, dp_rank: int
) -> None:
    """The step's micro-batches (some under `no_sync`, each with its forwards), clipping."""
    mine = pieces(global_batch(case, step), phase.dp)[dp_rank]
    pattern = phase.no_sync[step - first] if phase.no_sync else ()
    for index, chunk in enumerate(pieces(mine, phase.accum)):
        accumulate = index + 1 < phase.accum and pattern[index]
        scope = phase.no_sync_scope
        with dmuon.no_sync(wrapped, scope=scope) if accumulate else nullcontext():
            loss = sum(
                loss_of(wrapped, part) * (part.shape[0] * phase.dp / case.rows)
                for part in pieces(chunk, phase.forwards)
            )
            loss.backward()
    if case.clip is not None:
        dmuon.clip_grad_norm_(wrapped, case.clip)


def other_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full gradients of the parameters that are not dedicated (collective)."""
    from torch.distributed.tensor import DTensor

    from dmuon._ownership.fsdp_integration import is_dedicated

    grads = {}
    for name, p in model.named_parameters():
        if is_dedicated(p) or p.grad is None:
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = grad.detach().clone()
    return grads


# ----- what a phase reports -----------------------------------------------------------------
def full_weights(model: nn.Module, phase: Phase) -> dict[str, torch.Tensor]:
    """Every parameter (by ``named_parameters`` name) as a full tensor, on every rank."""
    from dist_harness import full_parameters

    if phase.layout != "tp":
        # Copies: on one rank a full tensor (or a plain parameter) is the live tensor.
        return {n: t.clone() for n, t in full_parameters(model).items()}
    full = dmuon.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    names = [n for n, _ in model.named_parameters()]
    return {n: full[n].detach().clone() for n in names}


def leftover_gradients(model: nn.Module) -> list[str]:
    """Dedicated matrices that still hold gradient state after ``zero_grad``."""
    return [
        dp.name
        for dp in dmuon.dedicated_parameters(model)
        if getattr(dp.param, "_reduced_grad", None) is not None
        or getattr(dp.module_param, "_accumulated_grad", None) is not None
    ]


def run_phase(rank: int, world: int, case: Case, which: str, checkpoint_dir: str) -> dict[str, Any]:
    """Run phase ``which`` (``"run"`` or ``"resume"``) of ``case`` on this rank."""
    import torch.distributed.checkpoint as dcp

    phase, steps = next((p, s) for name, p, s in case.phases() if name == which)
    assert phase.world == world, (phase.world, world)
    model, wrapped, optimizer, mesh = build(case, phase)
    if which == "resume":
        assert case.save_at is not None
        apply_schedule(model, case, range(case.save_at))
        model_sd, optim_sd = dmuon.get_state_dict(wrapped, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
        dmuon.set_state_dict(
            wrapped, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
        )
    dp_rank = data_rank(phase, mesh, rank)
    issued: list[Collective] = []
    # bfloat16: the weights before each step and the other parameters' gradients, for
    # the oracle's step-by-step comparison.
    snapshots = [full_weights(model, phase)] if case.bf16 else []
    grads = []
    functional = phase.layout == "tp"
    for step in steps:
        apply_schedule(model, case, range(step, step + 1))
        with recorded_collectives(functional) as seen:
            backward_and_clip(case, phase, step, steps.start, wrapped, dp_rank)
        issued += seen
        if case.bf16:
            grads.append(other_gradients(model))
        with recorded_collectives(functional) as seen:
            optimizer.step()
            optimizer.zero_grad()
        issued += seen
        if case.bf16:
            snapshots.append(full_weights(model, phase))
        if which == "run" and case.save_at == step + 1 and case.resume is not None:
            model_sd, optim_sd = dmuon.get_state_dict(wrapped, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    return {
        "params": snapshots[-1] if snapshots else full_weights(model, phase),
        "snapshots": snapshots,
        "grads": grads,
        "collectives": issued,
        "dedicated": sorted({dp.fqn for dp in dmuon.dedicated_parameters(model)}),
        "leftover": leftover_gradients(model),
    }


def run_phase_in_dir(rank: int, world: int, case: Case, which: str, root: str) -> Any:
    """`run_phase` with the case's checkpoint folder under ``root``."""
    return run_phase(rank, world, case, which, os.path.join(root, "checkpoint"))
