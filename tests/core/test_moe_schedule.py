"""Routing that leaves experts idle on some ranks: the same collectives, the right gradients.

A `TinyMoE` routes by token id, and each (rank, micro-batch) chunk only holds tokens of
one expert, so in every micro-batch each rank has experts without a gradient, and not the
same ones as the other rank. DMuon must still issue the same collectives in the same order
on every rank (a missing gradient contributes zeros) and reduce the right sums.

Oracle: the plain model trained in one process on the global batch (every expert sees
tokens there) with Muon written out in `dist_harness.reference_train`; tolerance 1e-5
absolute per parameter. Each rank's collective sequence is also compared with the other
ranks' (kind, size and root of every collective, in order).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from dist_harness import ADAMW_LR, LR, full_parameters, reference_train, run_in_order, spawn_ranks
from tiny_moe import TinyMoE

VOCAB, DIM, EXPERTS, MICRO, SEQ = 48, 16, 3, 2, 8
TOLERANCE = 1e-5


@dataclass(frozen=True)
class MoECase:
    """One configuration of the idle-expert check."""

    name: str
    mode: str
    hiddens: tuple[int, ...]
    accum: int
    no_sync: bool
    steps: int = 2
    check_collectives: bool = False
    expert_bias: bool = False


def _cases() -> list[MoECase]:
    cases = []
    for mode in ("z2", "z3"):
        for sizes, hiddens in (("equal", (24, 24)), ("unequal", (24, 40))):
            cases.append(MoECase(f"{mode}-{sizes}-accum1", mode, hiddens, 1, False))
            cases.append(MoECase(f"{mode}-{sizes}-accum2-no_sync", mode, hiddens, 2, True))
    cases.append(MoECase("z3-equal-accum2-sync", "z3", (24, 24), 2, False))
    cases.append(
        MoECase("z2-equal-accum2-checked", "z2", (24, 24), 2, True, check_collectives=True)
    )
    # Expert biases stay with FSDP2, which reduce-scatters zeros for them only when told to.
    cases.append(MoECase("z3-bias-accum2-no_sync", "z3", (24, 40), 2, True, expert_bias=True))
    return cases


CASES = {case.name: case for case in _cases()}
WORLDS = {2: list(CASES.values()), 3: [CASES["z3-unequal-accum2-no_sync"]]}


def make_moe(case: MoECase) -> TinyMoE:
    torch.manual_seed(5)
    return TinyMoE(VOCAB, DIM, list(case.hiddens), EXPERTS, expert_bias=case.expert_bias)


def chunk(step: int, rank: int, micro: int) -> torch.Tensor:
    """Tokens of one (rank, micro-batch): all routed to expert (step + rank + micro) % E."""
    expert = (step + rank + micro) % EXPERTS
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    ids = torch.randint(0, VOCAB // EXPERTS, (MICRO, SEQ + 1), generator=gen)
    return ids * EXPERTS + expert


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1], tokens[:, 1:])


def _train(rank: int, world: int, case: MoECase) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    model = make_moe(case)
    dmuon.dedicate_params(
        model,
        mesh,
        reshard_after_forward=case.mode == "z3",
        check_collectives=case.check_collectives,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=case.mode == "z3")
    fully_shard(model, mesh=mesh, reshard_after_forward=case.mode == "z3")
    if case.expert_bias:
        model.set_reduce_scatter_unused_params(True)
    optimizer = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR)
    sequence: list[tuple[str, int]] = []
    comm = dmuon._ownership.dedication_state.get_dedication(model).runtime.comm
    issue = comm._issue

    def record(kind: str, tensor: torch.Tensor, root: int, call: Any, **kwargs: Any) -> Any:
        sequence.append((kind, tensor.numel(), root))
        return issue(kind, tensor, root, call, **kwargs)

    comm._issue = record
    idle_here = 0
    for step in range(case.steps):
        for micro in range(case.accum):
            tokens = chunk(step, rank, micro)
            accumulating = micro + 1 < case.accum and case.no_sync
            with dmuon.no_sync(model) if accumulating else nullcontext():
                (_loss(model, tokens) / case.accum).backward()
            idle_here += EXPERTS - 1
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": full_parameters(model),
        "sequence": sequence,
        "idle_expert_passes": idle_here,
        "dedicated": sorted(dp.fqn for dp in dmuon.dedicated_parameters(model)),
    }


def _run_cases(rank: int, world: int, cases: list[MoECase]) -> dict[str, Any]:
    results = run_in_order((case.name, partial(_train, rank, world, case)) for case in cases)
    if world == 2:
        results["mismatch"] = _mismatched_schedule(rank)
    return results


def _mismatched_schedule(rank: int) -> str:
    """Rank 0 accumulates under no_sync while rank 1 reduces: the guard must stop both.

    In Z3, rank 1's first reduce meets rank 0's broadcast for the next forward.
    """
    import dmuon

    model = make_moe(CASES["z3-equal-accum1"])
    dmuon.dedicate_params(model, check_collectives=True, reshard_after_forward=True)
    tokens = chunk(0, rank, 0)
    try:
        with dmuon.no_sync(model) if rank == 0 else nullcontext():
            _loss(model, tokens).backward()
        _loss(model, tokens).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def moe_results() -> dict[int, list[dict[str, Any]]]:
    return {world: spawn_ranks(world, _run_cases, cases) for world, cases in WORLDS.items()}


def _case_results(moe_results, world: int, name: str) -> list[dict[str, Any]]:
    per_rank = []
    for rank, result in enumerate(moe_results[world]):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert name in result, f"rank {rank}: {name} did not run (an earlier case failed)"
        assert "error" not in result[name], f"rank {rank}:\n{result[name]['error']}"
        per_rank.append(result[name])
    return per_rank


def _reference(case: MoECase, world: int) -> dict[str, torch.Tensor]:
    model = make_moe(case)
    muon_names = {n for n, p in model.named_parameters() if "experts" in n and p.ndim == 2}
    batches = [
        torch.cat([chunk(step, r, m) for r in range(world) for m in range(case.accum)])
        for step in range(case.steps)
    ]
    return reference_train(model, muon_names, batches)


PARAMS = [(world, case.name) for world, cases in WORLDS.items() for case in cases]


@pytest.mark.parametrize(("world", "name"), PARAMS)
def test_idle_experts_match_single_process(moe_results, world: int, name: str) -> None:
    case = CASES[name]
    per_rank = _case_results(moe_results, world, name)
    reference = _reference(case, world)
    initial = dict(make_moe(case).named_parameters())
    dedicated = sorted(n for n in reference if "experts" in n and n.endswith("weight"))
    assert per_rank[0]["dedicated"] == dedicated
    for rank, result in enumerate(per_rank):
        assert result["idle_expert_passes"] > 0
        for fqn, expected in reference.items():
            diff = (result["params"][fqn] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank} {fqn}: max |diff| {diff:.3g}"
    # Every expert moved in the reference, so an expert left out on one rank would show.
    for fqn, expected in reference.items():
        if fqn in dedicated:
            assert (expected - initial[fqn]).abs().max().item() > 1e-3, fqn


@pytest.mark.parametrize(("world", "name"), PARAMS)
def test_every_rank_issues_the_same_collectives(moe_results, world: int, name: str) -> None:
    per_rank = _case_results(moe_results, world, name)
    sequences = [result["sequence"] for result in per_rank]
    assert sequences[0], "no collective was recorded"
    for rank, sequence in enumerate(sequences[1:], start=1):
        assert sequence == sequences[0], f"rank {rank} issued a different sequence"


def test_collective_guard_stops_every_rank_alike(moe_results) -> None:
    messages = [result["mismatch"] for result in moe_results[2]]
    for rank, message in enumerate(messages):
        assert "about to issue different collectives" in message, f"rank {rank}: {message}"
    assert messages[0] == messages[1]
