"""Checkpoint scenarios run on `dist_harness.spawn_ranks`: save at N ranks, load at N'.

Every run trains `TinyLlama` on the same global batch per step (``GLOBAL`` sequences split
over ranks and accumulation micro-batches, ``no_sync`` on all but the last), so runs at
different world sizes train the same model. A save run trains ``K`` steps, writes a DCP
checkpoint with ``dmuon.get_state_dict``, keeps the full state (``full_state_dict``) as the
oracle of what the checkpoint holds, and trains ``M`` more steps: its final parameters are
the uninterrupted run.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import ADAMW_LR, EVAL_TOKENS, LR, SEQ, VOCAB, _loss, full_parameters
from tiny_llama import TinyLlama
from torch.distributed.checkpoint import state_dict as torch_sd
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._pytree import tree_map_only

import dmuon

GLOBAL, ACCUM, K, M = 24, 2, 2, 2
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def batch(step: int) -> torch.Tensor:
    """The global batch of optimizer step ``step`` (the same whatever the world size)."""
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=gen)


def build(world: int, mode: str | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """TinyLlama with FSDP2; ``mode`` ``"z2"``/``"z3"`` dedicates, ``None`` is FSDP2 + AdamW."""
    torch.manual_seed(1234)
    model = TinyLlama(vocab=VOCAB)
    mesh = init_device_mesh("cpu", (world,))
    reshard = mode != "z2"
    if mode is not None:
        dmuon.dedicate_params(model, mesh, reshard_after_forward=reshard)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if mode is None:
        return model, torch.optim.AdamW(model.parameters(), lr=ADAMW_LR, weight_decay=0.01)
    optimizer = dmuon.Muon(
        model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
    )
    return model, optimizer


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: range,
    rank: int,
    world: int,
    dedicated: bool = True,
) -> None:
    """Optimizer steps ``steps`` with ``ACCUM`` micro-batches each (``no_sync`` between)."""
    for step in steps:
        mine = batch(step).chunk(world)[rank]
        for micro, chunk in enumerate(mine.chunk(ACCUM)):
            last = micro + 1 == ACCUM
            ctx = nullcontext() if last or not dedicated else dmuon.no_sync(model)
            if not dedicated:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            with ctx:
                (_loss(model, chunk) / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()


def snapshot(tree: Any) -> Any:
    """A deep copy of a state dict's tensors (at one rank, full tensors alias the weights)."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def eval_loss(model: torch.nn.Module) -> float:
    """Loss of the evaluation batch (a forward that broadcasts dedicated matrices)."""
    with torch.no_grad():
        return _loss(model, EVAL_TOKENS).item()


def save_run(rank: int, world: int, root: str, modes: list[str]) -> dict[str, Any]:
    """Per mode: train K steps, save to ``root/<mode>-<world>``, train M more."""
    out: dict[str, Any] = {}
    for mode in modes:
        model, optimizer = build(world, None if mode == "adamw" else mode)
        dedicated = mode != "adamw"
        train(model, optimizer, range(K), rank, world, dedicated)
        get = dmuon.get_state_dict if dedicated else torch_sd.get_state_dict
        model_sd, optim_sd = get(model, optimizer)
        path = os.path.join(root, f"{mode}-{world}")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        full_model, full_optim = snapshot(get(model, optimizer, options=FULL))
        train(model, optimizer, range(K, K + M), rank, world, dedicated)
        out[mode] = {
            "saved_model": full_model,
            "saved_optim": full_optim,
            "final": full_parameters(model),
            "sharded_keys": sorted(model_sd),
            "sharded_types": {k: type(v).__name__ for k, v in model_sd.items()},
            "momentum_types": {
                k: type(v["momentum_buffer"]).__name__
                for k, v in optim_sd["state"].items()
                if "momentum_buffer" in v
            },
            "optim_keys": sorted(optim_sd["state"]),
            "group_params": [g["params"] for g in optim_sd["param_groups"]],
        }
    return out


def load_run(
    rank: int, world: int, root: str, sources: list[tuple[str, str]], full_from: dict[str, Any]
) -> dict[str, Any]:
    """Per ``(mode, checkpoint name)``: load into a fresh model at this world size, train M.

    Before loading, one forward makes Z2's buffers resident with the initial weights: the
    loaded weights must still be what the next forward uses. ``full_from[name]`` (on rank
    0 only) is a full state dict loaded a second time with ``broadcast_from_rank0``.
    """
    out: dict[str, Any] = {}
    for mode, name in sources:
        model, optimizer = build(world, mode)
        eval_loss(model)
        model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, name))
        dmuon.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        loaded_model, loaded_optim = snapshot(dmuon.get_state_dict(model, optimizer, options=FULL))
        loss_after_load = eval_loss(model)
        train(model, optimizer, range(K, K + M), rank, world)
        result = {
            "loaded_model": loaded_model,
            "loaded_optim": loaded_optim,
            "loss_after_load": loss_after_load,
            "final": full_parameters(model),
        }
        if name in full_from:
            fresh, fresh_optim = build(world, mode)
            eval_loss(fresh)
            given = full_from[name] if rank == 0 else ({}, {})
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            dmuon.set_state_dict(
                fresh,
                fresh_optim,
                model_state_dict=given[0],
                optim_state_dict=given[1],
                options=options,
            )
            result["broadcast_model"], result["broadcast_optim"] = snapshot(
                dmuon.get_state_dict(fresh, fresh_optim, options=FULL)
            )
            result["broadcast_loss"] = eval_loss(fresh)
        out[f"{mode}<-{name}"] = result
    return out


def plain_fsdp_load(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    """Load a checkpoint's model part into FSDP2 without dedication, with torch's functions."""
    model, _ = build(world, None)
    model_sd = torch_sd.get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    torch_sd.set_model_state_dict(model, model_sd)
    return full_parameters(model)


def finetune_from_adamw(rank: int, world: int, path: str, mode: str) -> dict[str, Any]:
    """Load an FSDP2 + AdamW checkpoint's model part into a dedicated model; train one step."""
    model, optimizer = build(world, mode)
    model_sd = dmuon.get_model_state_dict(model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    dmuon.set_model_state_dict(model, model_sd)
    loaded = full_parameters(model)
    loss = eval_loss(model)
    train(model, optimizer, range(K, K + 1), rank, world)
    return {"loaded": loaded, "loss": loss, "stepped": full_parameters(model)}


def load_everything(
    rank: int,
    world: int,
    root: str,
    sources: list[tuple[str, str]],
    full_from: dict[str, Any],
    plain_from: str | None = None,
    finetune_from: str | None = None,
) -> dict[str, Any]:
    """`load_run`, and optionally `plain_fsdp_load` and `finetune_from_adamw`, in one spawn."""
    out = load_run(rank, world, root, sources, full_from)
    if plain_from is not None:
        out["plain"] = plain_fsdp_load(rank, world, os.path.join(root, plain_from))
    if finetune_from is not None:
        out["finetune"] = finetune_from_adamw(rank, world, os.path.join(root, finetune_from), "z2")
    return out


def reference_loss(params: dict[str, torch.Tensor]) -> float:
    """Evaluation loss of an unwrapped model holding ``params`` (one process)."""
    torch.manual_seed(1234)
    model = TinyLlama(vocab=VOCAB)
    model.load_state_dict(params)
    return eval_loss(model)


def barrier_all() -> None:
    """A barrier on the default group (used between phases that share files)."""
    dist.barrier()
