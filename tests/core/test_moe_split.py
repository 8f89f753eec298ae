"""Expert stacks split by experts across owners (``dedicate_params(split_expert_stacks=...)``).

The distributed runs force the split on a tiny Mixtral (gloo; 3 ranks in Z3, then 2 of
them in Z2, in one spawn; accumulation 2 under `no_sync`; FSDP2 on the decoder layers)
and compare every parameter with the one-process reference of `test_moe_experts`, which
applies Newton-Schulz to each expert matrix by hand (tolerance 1e-5 absolute). The same
spawn checks that `dmuon.owner_plan` lists the ranges and that each owner holds only its
experts, that the communication audit equals the formula (Z2: 2 units, Z3: 2 x
accumulation + 1, with P_M counting each dedicated element once), that micro-batches
left experts without tokens, and that a checkpoint saved split loads into an unsplit
model and back, with equal parameters and momenta.

The planner checks (no process group) compare `dmuon.plan_owners` with loads computed
from the Newton-Schulz cost formula.
"""

from __future__ import annotations

import itertools
import math
from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import full_parameters, run_in_order, spawn_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

import dmuon

transformers = pytest.importorskip("transformers")

from test_moe_experts import (  # noqa: E402
    ACCUM,
    STEPS,
    _by_hand,
    _step,
    dedicate_and_shard,
    expected_muon_names,
    tiny_mixtral,
)

TOLERANCE = 1e-5
EXPERTS = 4
STACK = "model.layers.0.mlp.experts.gate_up_proj"


# ----- planner (one process) ---------------------------------------------------------------
def _cost(shape: tuple[int, ...]) -> int:
    """Multiply-adds of one Newton-Schulz iteration of a matrix (short side m, long side
    n: X Xᵀ, A·A and B·X cost m²n + m³ + m²n), or of a stack of them."""
    count = shape[0] if len(shape) == 3 else 1
    m, n = sorted(shape[-2:])
    return count * (2 * m * m * n + m**3)


def test_auto_splits_a_dominant_stack_and_not_a_small_one() -> None:
    dominant = {"experts": (8, 64, 32), "a": (32, 32), "b": (32, 32)}
    total = sum(_cost(s) for s in dominant.values())
    assert _cost(dominant["experts"]) > total / 2  # more than one rank's share
    whole = dmuon.plan_owners(dominant, 2, split_expert_stacks=False)
    auto = dmuon.plan_owners(dominant, 2)
    assert whole.expert_ranges == {} and max(whole.loads) == _cost((8, 64, 32))
    ranges = auto.expert_ranges["experts"]
    assert [(r.start, r.stop) for r in ranges] == [(0, 4), (4, 8)]
    assert {r.owner for r in ranges} == {0, 1}
    assert auto.owners == {"experts[0:4]": 0, "experts[4:8]": 1, "a": 0, "b": 1}
    # Perfect balance: each rank gets half of everything; the largest load drops 1.74x.
    assert auto.loads == (total // 2, total // 2)
    assert max(whole.loads) / max(auto.loads) == pytest.approx(1310720 / 753664)
    # The reported loads are the costs of what each rank owns.
    per_expert = _cost((64, 32))
    loads = [0, 0]
    for name, owner in auto.owners.items():
        loads[owner] += 4 * per_expert if name.startswith("experts[") else _cost((32, 32))
    assert tuple(loads) == auto.loads

    small = {"experts": (4, 16, 16), "a": (64, 64), "b": (64, 64), "c": (64, 64)}
    assert dmuon.plan_owners(small, 2).expert_ranges == {}  # below the per-rank share
    forced = dmuon.plan_owners(small, 3, split_expert_stacks=True)
    assert len(forced.expert_ranges["experts"]) >= 2  # True splits even a small stack
    owners = [r.owner for r in forced.expert_ranges["experts"]]
    assert len(set(owners)) == len(owners)  # one range per owner
    assert dmuon.plan_owners(small, 1, split_expert_stacks=True).expert_ranges == {}
    with pytest.raises(ValueError, match='split_expert_stacks must be "auto", True'):
        dmuon.plan_owners(small, 2, split_expert_stacks="yes")  # type: ignore[arg-type]


# ----- distributed ---------------------------------------------------------------------------
def _mesh(world: int) -> DeviceMesh:
    """All ranks, or the first two ranks' group (made by `_run` on every rank)."""
    if world == dist.get_world_size():
        return init_device_mesh("cpu", (world,))
    return DeviceMesh.from_group(_PAIR[0], "cpu")


_PAIR: list[dist.ProcessGroup] = []


def _build(world: int, z3: bool, split: bool) -> tuple[nn.Module, dmuon.Muon]:
    model = tiny_mixtral()
    return model, dedicate_and_shard(model, _mesh(world), z3, split_expert_stacks=split)


def _full_momenta(model: nn.Module, optimizer: dmuon.Muon) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    options = StateDictOptions(full_state_dict=True)
    osd = dmuon.get_optimizer_state_dict(model, optimizer, options=options)
    stacks = [n for n in expected_muon_names("mixtral") if "experts" in n]
    return {n: osd["state"][n]["momentum_buffer"].detach().cpu().clone() for n in stacks}


def _round_trip(world: int, z3: bool, model: nn.Module, optimizer: dmuon.Muon) -> dict[str, Any]:
    """Save split, load unsplit; save that, load split: parameters and momenta equal."""
    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    stack = model_sd[STACK]
    saved = {
        "type": type(stack).__name__,
        "placements": tuple(stack.placements),
        "shape": tuple(stack.shape),
        "momentum_shape": tuple(optim_sd["state"][STACK]["momentum_buffer"].shape),
    }
    params, momenta = full_parameters(model), _full_momenta(model, optimizer)
    unsplit, unsplit_opt = _build(world, z3, split=False)
    dmuon.set_state_dict(unsplit, unsplit_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert not dmuon.owner_plan(unsplit).expert_ranges
    saved["to_unsplit"] = _max_diffs(params, momenta, unsplit, unsplit_opt)
    model_sd, optim_sd = dmuon.get_state_dict(unsplit, unsplit_opt)
    resplit, resplit_opt = _build(world, z3, split=True)
    dmuon.set_state_dict(resplit, resplit_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    saved["to_split"] = _max_diffs(params, momenta, resplit, resplit_opt)
    return saved


def _max_diffs(
    params: dict[str, torch.Tensor],
    momenta: dict[str, torch.Tensor],
    model: nn.Module,
    optimizer: dmuon.Muon,
) -> tuple[float, float]:
    theirs, their_momenta = full_parameters(model), _full_momenta(model, optimizer)
    param_diff = max((params[n] - theirs[n]).abs().max().item() for n in params)
    momentum_diff = max((momenta[n] - their_momenta[n]).abs().max().item() for n in momenta)
    return param_diff, momentum_diff


def _train(rank: int, world: int, z3: bool) -> dict[str, Any]:
    model, optimizer = _build(world, z3, split=True)
    plan = dmuon.owner_plan(model)
    records = [
        (dp.name, dp.owner, dp.experts, tuple(dp.param.shape) if dp.is_owned else None)
        for dp in dmuon.dedicated_parameters(model)
        if dp.is_range
    ]
    idle = 0

    def count_idle(_module: nn.Module, args: tuple[Any, ...]) -> None:
        nonlocal idle
        idle += int(args[1].unique().numel() < EXPERTS)  # top_k_index: experts with tokens

    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(count_idle)
    units, elements, norms = [], [], []
    for step in range(STEPS):
        norms.append(_step(model, optimizer, step, rank, world))
        audit = dmuon.comm_audit(model)
        units.append(audit.last_step().units)
        elements.append(audit.dedicated_elements)
    momentum_shapes = {
        dp.name: tuple(optimizer.state[dp.param]["momentum_buffer"].shape)
        for dp in dmuon.dedicated_parameters(model)
        if dp.is_range and dp.is_owned
    }
    result = {
        "params": full_parameters(model),
        "norms": norms,
        "plan": plan,
        "records": records,
        "momentum_shapes": momentum_shapes,
        "units": units,
        "elements": elements,
        "idle": idle,
        "checkpoint": _round_trip(world, z3, model, optimizer) if not z3 else None,
    }
    if not z3:  # nn.Module.load_state_dict: each owner takes its experts of the full stack
        doubled = result["params"][STACK] * 2
        model.load_state_dict({STACK: doubled}, strict=False)
        result["plain_load_diff"] = (full_parameters(model)[STACK] - doubled).abs().max().item()
    return result


#: (ranks, Z3): 3 ranks in Z3, then 2 of them in Z2 with the checkpoint round trip.
RUNS = [(3, True), (2, False)]


def _run(rank: int, world: int) -> dict[tuple[int, bool], dict[str, Any]]:
    """Both runs in one spawn of 3 processes; the third one sits out the 2-rank run."""
    _PAIR.append(dist.new_group([0, 1]))  # on every rank, as new_group requires
    return run_in_order(
        ((ranks, z3), partial(_train, rank, ranks, z3)) for ranks, z3 in RUNS if rank < ranks
    )


@pytest.fixture(scope="module")
def split_results() -> dict[tuple[int, bool], list[dict[str, Any]]]:
    per_rank = spawn_ranks(3, _run)
    return {
        run: [result.get(run, {"error": "did not run"}) for result in per_rank[: run[0]]]
        for run in RUNS
    }


@pytest.mark.parametrize(("world", "z3"), RUNS, ids=["3-z3", "2-z2"])
def test_split_stacks_match_per_expert_newton_schulz(split_results, world: int, z3: bool) -> None:
    per_rank = split_results[(world, z3)]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    muon = expected_muon_names("mixtral")
    by_hand = _by_hand(tiny_mixtral(), muon, False, world)
    reference = by_hand["params"]
    initial = dict(tiny_mixtral().named_parameters())
    stacks = sorted(n for n in muon if "experts" in n)
    assert sum(result["idle"] for result in per_rank) > 0, "every expert saw tokens everywhere"

    # The plan: every stack in ranges of contiguous experts, one owner each, on every rank.
    plan = per_rank[0]["plan"]
    assert all(result["plan"] == plan for result in per_rank)
    assert sorted(plan.expert_ranges) == stacks
    for fqn, ranges in plan.expert_ranges.items():
        assert ranges[0].start == 0 and ranges[-1].stop == EXPERTS
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
        assert len({r.owner for r in ranges}) == len(ranges) >= 2
        for r in ranges:
            assert plan.owners[f"{fqn}[{r.start}:{r.stop}]"] == r.owner
    # Each rank holds the master and the momentum of its own ranges only.
    shapes = {n: tuple(p.shape) for n, p in initial.items()}
    for rank, result in enumerate(per_rank):
        for name, owner, (start, stop), master in result["records"]:
            fqn = name.partition("[")[0]
            expected = (stop - start, *shapes[fqn][1:])
            assert master == (expected if owner == rank else None), (rank, name)
            if owner == rank:
                assert result["momentum_shapes"][name] == expected

    # The audit: P_M counts each element once; units as without splitting.
    p_m = sum(math.prod(shapes[n]) for n in muon)
    expected_units = 2 * ACCUM + 1.0 if z3 else 2.0
    for result in per_rank:
        assert result["elements"] == [p_m] * STEPS
        assert result["units"] == [pytest.approx(expected_units)] * STEPS

    for rank, result in enumerate(per_rank):
        # The global gradient norm (dmuon's clipping norm) counts each range once.
        assert result["norms"] == pytest.approx(by_hand["norms"], rel=1e-5), rank
        for name, expected in reference.items():
            diff = (result["params"][name] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank} {name}: max |diff| {diff:.3g}"
    for name in stacks:  # every expert moved, so a range left out would show
        moved = (reference[name] - initial[name]).abs().amax(dim=(1, 2))
        assert moved.min().item() > 1e-3, name


def test_split_checkpoint_loads_unsplit_and_back(split_results) -> None:
    for rank, result in enumerate(split_results[(2, False)]):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        saved = result["checkpoint"]
        assert (saved["type"], saved["placements"]) == ("DTensor", (Shard(0),))
        assert saved["shape"] == saved["momentum_shape"] == (EXPERTS, 96, 32)
        assert saved["to_unsplit"] == (0.0, 0.0), f"rank {rank}: split -> unsplit differs"
        assert saved["to_split"] == (0.0, 0.0), f"rank {rank}: unsplit -> split differs"
        assert result["plain_load_diff"] == 0.0, f"rank {rank}: load_state_dict differs"
