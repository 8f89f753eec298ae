"""Several forwards before their backwards (GPipe's order, contrastive and RL code).

Each step runs every micro-batch's forward first, then the backwards: in order (1, 2),
reversed (2, 1), and four at once. Oracle: the single-process run of the plain model on
the global batch (`dist_harness.reference_run`), tolerance 1e-5: one process, 2 ranks
(FSDP2) and HSDP 2x2, Z2 and Z3. A forward whose backward never comes (a loss computed
and dropped) delays nothing past the step.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from dist_harness import Scenario, _loss, global_batch, hsdp_model, reference_run, spawn_ranks

STEPS = 2
#: Micro-batches per step and the order of their backwards.
ORDERS = {"2F2B": (2, (0, 1)), "2F2B-reversed": (2, (1, 0)), "4F4B": (4, (0, 1, 2, 3))}
MESHES = {1: None, 2: (2,), 4: (2, 2)}


def _train(model: torch.nn.Module, optimizer: Any, rank: int, world: int, order: str) -> None:
    accum, backwards = ORDERS[order]
    for step in range(STEPS):
        tokens = global_batch(step, world, accum).chunk(world)[rank]
        losses = [_loss(model, chunk) / accum for chunk in tokens.chunk(accum)]
        for i in backwards:
            losses[i].backward()
        optimizer.step()
        optimizer.zero_grad()


def _worker(rank: int, world: int) -> dict[str, Any]:
    from dist_harness import full_parameters
    from torch.distributed.device_mesh import init_device_mesh

    names = ("shard",) if world == 2 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", MESHES[world], mesh_dim_names=names)
    out: dict[str, Any] = {}
    for mode in ("z2", "z3"):
        for order in ORDERS:
            model, optimizer = hsdp_model(mesh, mode, f"{order}-{mode}")
            _train(model, optimizer, rank, world, order)
            out[f"{order}-{mode}"] = full_parameters(model)
    return out


@functools.cache
def _spawned(world: int) -> list[dict[str, Any]]:
    return spawn_ranks(world, _worker)


def _one_process(mode: str, order: str) -> dict[str, torch.Tensor]:
    from dist_harness import ADAMW_LR, LR, make_model

    import dmuon

    model = make_model(Scenario(f"{order}-{mode}"))
    dmuon.dedicate_params(model, reshard_after_forward=mode == "z3")
    optimizer = dmuon.Muon(
        model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
    )
    _train(model, optimizer, 0, 1, order)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def _reference(world: int, accum: int) -> dict[str, torch.Tensor]:
    return reference_run(Scenario("reference", steps=STEPS, accum=accum), world)


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("mode", ["z2", "z3"])
@pytest.mark.parametrize("world", sorted(MESHES))
def test_forwards_before_backwards_train_as_one_process(world: int, mode: str, order: str) -> None:
    reference = _reference(world, ORDERS[order][0])
    results = [_one_process(mode, order)] if world == 1 else [
        r[f"{order}-{mode}"] for r in _spawned(world)
    ]  # fmt: skip
    for rank, params in enumerate(results):
        assert params.keys() == reference.keys()
        worst = max((params[n] - p).abs().max().item() for n, p in reference.items())
        assert worst <= 1e-5, f"rank {rank}: {worst:.2e}"


def test_a_forward_without_backward_is_forgotten_at_the_step() -> None:
    """A loss computed and dropped leaves its forward pending until the step; the next
    step's single forward and backward then reduce as usual, exactly."""
    from dist_harness import ADAMW_LR, LR, make_model

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication

    model = make_model(Scenario("dropped"))
    dmuon.dedicate_params(model, reshard_after_forward=True)
    optimizer = dmuon.Muon(
        model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
    )
    runtime = get_dedication(model).runtime
    for step in range(STEPS):
        tokens = global_batch(step, 1, 1)
        _loss(model, tokens[:1])  # dropped: no backward
        _loss(model, tokens).backward()
        assert all(b.awaits_backward for b in runtime.boundaries)  # the dropped forward
        optimizer.step()
        assert not any(b.awaits_backward for b in runtime.boundaries)
        optimizer.zero_grad()
    reference = _reference(1, 1)
    params = dict(model.named_parameters())
    worst = max((params[n].detach() - p).abs().max().item() for n, p in reference.items())
    assert worst <= 1e-5
