"""`dmuon.reference`, the algorithm on one screen, against the library on gloo.

On 2 and 4 ranks, a dense model (transformers' Llama) and a mixture of experts
(transformers' Mixtral, fused 3-D expert stacks whose experts some ranks leave idle) train
three steps two ways from the same seed and the same per-rank batches: `dmuon.Muon` on
FSDP2 (Z3, two micro-batches under `dmuon.no_sync`; at 4 ranks each expert stack is split
by experts between two owners), and `dmuon.reference.ReferenceMuon`
on a whole model per rank with plain ``torch.distributed`` calls. Every parameter agrees
within 1e-5 on every rank, and every parameter moved, so agreement is not two runs that
did nothing. One process checks the reference's pieces: its owners against greedy
scheduling's bound (the library's plan too), its Newton-Schulz against
`dmuon.newton_schulz`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from dist_harness import full_parameters, run_in_order, spawn_ranks
from hf_models import config_of
from torch import nn

import dmuon
from dmuon.reference import ReferenceMuon, assign_owners, newton_schulz

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, ACCUM, STEPS = 64, 8, 2, 3
LR, ADAMW_LR, ADAMW_WD, WEIGHT_DECAY = 0.02, 3e-3, 0.01, 0.1
TOLERANCE = 1e-5
KINDS = ("llama", "mixtral")


def _model(kind: str) -> nn.Module:
    torch.manual_seed(5)
    return transformers.AutoModelForCausalLM.from_config(config_of(kind, vocab=VOCAB))


def _batch(step: int, world: int, rank: int) -> torch.Tensor:
    """This rank's sequences of one step: ACCUM micro-batches of one sequence each."""
    generator = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, VOCAB, (world * ACCUM, SEQ + 1), generator=generator)
    return tokens.chunk(world)[rank]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _dmuon_run(kind: str, rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(kind)
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    optimizer = dmuon.Muon(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        ns_dtype=torch.float32,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WD,
    )
    for step in range(STEPS):
        for micro, tokens in enumerate(_batch(step, world, rank).chunk(ACCUM)):
            last = micro + 1 == ACCUM
            with nullcontext() if last else dmuon.no_sync(model):
                (_loss(model, tokens) / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()
    # At 4 ranks an expert stack is split by experts between owners: one name, two ranges.
    names = sorted({p.fqn for p in dmuon.dedicated_parameters(model)})
    return full_parameters(model), names


def _reference_run(kind: str, rank: int, world: int, muon: list[str]) -> dict[str, torch.Tensor]:
    model = _model(kind)
    optimizer = ReferenceMuon(
        model,
        muon,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WD,
    )
    for step in range(STEPS):
        for tokens in _batch(step, world, rank).chunk(ACCUM):
            (_loss(model, tokens) / ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _compare(kind: str, rank: int, world: int) -> dict[str, Any]:
    library, muon = _dmuon_run(kind, rank, world)
    reference = _reference_run(kind, rank, world, muon)
    start = dict(_model(kind).named_parameters())
    return {
        "names": sorted(library) == sorted(reference),
        "muon": len(muon),
        "stacks": sum(reference[name].ndim == 3 for name in muon),
        "diff": max((library[n] - reference[n]).abs().max().item() for n in reference),
        "least_moved": min((reference[n] - start[n]).abs().max().item() for n in reference),
    }


def _ranks(rank: int, world: int) -> dict[Any, Any]:
    return run_in_order((kind, lambda kind=kind: _compare(kind, rank, world)) for kind in KINDS)


@pytest.mark.parametrize("world", [2, 4])
def test_the_reference_and_the_library_train_alike(world: int) -> None:
    results = spawn_ranks(world, _ranks)
    for rank, by_kind in enumerate(results):
        for kind in KINDS:
            result = by_kind[kind]
            assert "error" not in result, result.get("error")
            assert result["names"], (rank, kind)
            assert result["diff"] < TOLERANCE, (world, rank, kind, result)
            assert result["least_moved"] > 1e-4, (world, rank, kind, result)
            # Llama: 7 matrices per layer; Mixtral: 4 attention + 2 expert stacks per layer.
            expected = (14, 0) if kind == "llama" else (12, 4)
            assert (result["muon"], result["stacks"]) == expected, (kind, result)


def test_owners_keep_every_rank_within_one_matrix_of_the_mean() -> None:
    """Greedy list scheduling's bound (Graham): the busiest rank carries at most the mean
    load plus the costliest matrix; the library's plan, with its extra tie-breaks, too."""
    model = _model("mixtral")
    dmuon.dedicate_params(model)
    shapes = {p.fqn: torch.Size(p.shape) for p in dmuon.dedicated_parameters(model)}
    costs = {name: dmuon.plan_owners({name: tuple(s)}, 1).loads[0] for name, s in shapes.items()}
    total, largest = sum(costs.values()), max(costs.values())
    for world in (1, 2, 3, 4, 7):
        owners = assign_owners(shapes, world)
        assert sorted(owners) == sorted(shapes) and set(owners.values()) <= set(range(world))
        loads = [0] * world
        for name, rank in owners.items():
            loads[rank] += costs[name]
        planned = dmuon.plan_owners(
            {n: tuple(s) for n, s in shapes.items()}, world, split_expert_stacks=False
        )
        for plan_loads in (loads, list(planned.loads)):
            assert sum(plan_loads) == total
            assert max(plan_loads) <= total / world + largest, (world, plan_loads)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 48), (32, 32)])
def test_the_readable_iteration_is_the_librarys(shape: tuple[int, ...]) -> None:
    update = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    ours = newton_schulz(update)
    if len(shape) == 3:
        theirs = torch.stack([dmuon.newton_schulz(m, 5, dtype=torch.float32) for m in update])
    else:
        theirs = dmuon.newton_schulz(update, 5, dtype=torch.float32)
    assert ours.shape == update.shape
    assert (ours - theirs).abs().max().item() < 1e-5
