"""DMuon under torch's DistributedDataParallel, on gloo ranks, against one process.

``dmuon.dedicate_params(model, mesh)`` then ``DistributedDataParallel(model)`` with no
argument: DDP all-reduces the other parameters, DMuon reduces each dedicated gradient to
its owner and broadcasts the updated matrices in the next forward.

Oracles: `dist_harness.reference_run` (the plain model on the whole global batch, float32
Newton-Schulz Muon written out and torch.optim.AdamW; 1e-5 absolute on every parameter),
the communication formulas (Z2: 2 units per step, Z3: 2k + 1 with ``no_sync``), and the
global gradient norm of the reference's first step (relative 1e-5). On 3 ranks, ranks 0
and 1 first make a group of their own, as a user's script may.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist_harness import (
    Scenario,
    make_model,
    reference_eval_loss,
    reference_run,
    run_in_order,
    run_scenario,
    spawn_ranks,
)

SCENARIOS = [
    Scenario("ddp-z2-accum1", "z2", 1, layout="ddp"),
    Scenario("ddp-z3-accum1", "z3", 1, layout="ddp"),
    Scenario("ddp-z2-accum2-no_sync", "z2", 2, layout="ddp"),
    Scenario("ddp-z3-accum2-no_sync", "z3", 2, layout="ddp"),
    Scenario("ddp-z2-accum2-sync", "z2", 2, use_no_sync=False, layout="ddp"),
    Scenario("ddp-z3-accum2-sync", "z3", 2, use_no_sync=False, layout="ddp"),
]
BY_NAME = {s.name: s for s in SCENARIOS}
WORLDS = {2: SCENARIOS, 3: [BY_NAME["ddp-z2-accum2-no_sync"], BY_NAME["ddp-z3-accum1"]]}
CASES = [(world, s.name) for world, scenarios in WORLDS.items() for s in scenarios]


def _worker(rank: int, world: int, scenarios: list[Scenario], root: str) -> dict[str, Any]:
    if world == 3 and rank < 2:
        # A user's group of ranks 0 and 1, made by its members alone: DMuon's group beside
        # DDP's must still pair every rank (it hung when named from per-rank group counts).
        torch.distributed.new_group([0, 1], use_local_synchronization=True)
    results = run_in_order((s.name, lambda s=s: run_scenario(s, rank, world)) for s in scenarios)
    results["__wrapper__"] = run_in_order([("calls", lambda: _wrapper_calls(rank, world))])
    results["__checkpoint__"] = run_in_order(
        [("run", lambda: _checkpoint_run(rank, world, root, save=world == 2))]
    )
    return results


CKPT_STEPS = 2


def _checkpoint_run(rank: int, world: int, root: str, save: bool) -> dict[str, Any]:
    """2 ranks: train, save with DCP, train on (the uninterrupted run). 3 ranks: load the
    2-rank checkpoint under DDP and train the same steps."""
    import os

    import torch.distributed.checkpoint as dcp
    from dist_harness import global_batch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("ddp-checkpoint"))
    dmuon.dedicate_params(model, mesh, reshard_after_forward=False)
    ddp = DistributedDataParallel(model)
    optimizer = dmuon.Muon(ddp, ns_dtype=torch.float32, adamw_lr=3e-3)

    def train(steps: range) -> None:
        for step in steps:
            tokens = global_batch(step, 6, 1)  # 12 rows: whole chunks at 2 and 3 ranks
            mine = tokens.chunk(world)[rank]
            ddp(mine[:, :-1], mine[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()

    path = os.path.join(root, "ddp")
    if save:
        train(range(CKPT_STEPS))
        model_sd, optim_sd = dmuon.get_state_dict(ddp, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:
        model_sd, optim_sd = dmuon.get_state_dict(ddp, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dmuon.set_state_dict(ddp, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(range(CKPT_STEPS, CKPT_STEPS + 2))
    full = dmuon_options(full_state_dict=True)
    return {k: v.detach().clone() for k, v in dmuon.get_model_state_dict(ddp, options=full).items()}


def _wrapper_calls(rank: int, world: int) -> dict[str, Any]:
    """Every public function takes the DDP wrapper; the state dict has the model's keys."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("wrapper"))
    dmuon.dedicate_params(model, mesh)
    ddp = DistributedDataParallel(model)
    optimizer = dmuon.Muon(ddp, ns_dtype=torch.float32)
    tokens = torch.randint(0, 64, (2 * world, 13), generator=torch.Generator().manual_seed(5))
    mine = tokens.chunk(world)[rank]
    ddp(mine[:, :-1], mine[:, 1:]).backward()
    norm = float(dmuon.clip_grad_norm_(ddp, 1e9))
    optimizer.step()
    model_sd, optim_sd = dmuon.get_state_dict(
        ddp, optimizer, options=dmuon_options(full_state_dict=True)
    )
    return {
        "norm": norm,
        "keys": sorted(model_sd),
        "shapes": {k: tuple(v.shape) for k, v in model_sd.items()},
        "optim_keys": sorted(optim_sd["state"]),
        "units": dmuon.comm_audit(ddp).last_step().units,
        "separate_group": get_comm(model).group is not torch.distributed.group.WORLD,
    }


def dmuon_options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def get_comm(model: torch.nn.Module) -> Any:
    from dmuon._ownership.dedication_state import get_dedication

    state = get_dedication(model)
    assert state is not None
    return state.runtime.comm


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    cache: dict[int, list[dict[str, Any]]] = {}
    root = str(tmp_path_factory.mktemp("ddp"))

    def results(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            if world == 3 and 2 not in cache:
                results(2)  # the 3-rank run loads the 2-rank run's checkpoint
            cache[world] = spawn_ranks(world, _worker, WORLDS[world], root)
        return cache[world]

    return results


def _results(spawned, world: int, name: str) -> list[dict[str, Any]]:
    per_rank = spawned(world)
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert "error" not in result[name], f"rank {rank}:\n{result[name]['error']}"
    return [r[name] for r in per_rank]


@pytest.mark.parametrize(("world", "name"), CASES)
def test_ddp_matches_one_process_on_the_global_batch(spawned, world: int, name: str) -> None:
    scenario = BY_NAME[name]
    reference = reference_run(scenario, world)
    initial = {n: p.detach() for n, p in make_model(scenario).named_parameters()}
    assert max((reference[n] - p).abs().max().item() for n, p in initial.items()) > 1e-3
    expected_eval = reference_eval_loss(scenario, reference)
    for rank, result in enumerate(_results(spawned, world, name)):
        assert result["params"].keys() == reference.keys()
        for fqn, expected in reference.items():
            diff = (result["params"][fqn] - expected).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {fqn}: {diff:.3g}"
        # Each rank's own forward after the last step (Z2 buffers included).
        assert result["eval_loss"] == pytest.approx(expected_eval, abs=1e-5), f"rank {rank}"


@pytest.mark.parametrize(("world", "name"), CASES)
def test_ddp_traffic_is_the_formula_and_step_only_agrees(spawned, world: int, name: str) -> None:
    scenario = BY_NAME[name]
    k = scenario.accum
    synced = 1 if scenario.use_no_sync else k
    expected = (1 if scenario.mode == "z2" else 2 * k) + synced
    for result in _results(spawned, world, name):
        assert [step["units"] for step in result["comm"]] == [pytest.approx(expected)] * 3
        # nothing but the ranks' one-number agreement on non-finite gradients
        assert result["step_issued"] == [[("all_reduce", 1)]] * scenario.steps
        assert result["leftover_grads"] == []


def test_ddp_clipped_norm_is_the_global_one(spawned) -> None:
    scenario = BY_NAME["ddp-z2-accum1"]
    model = make_model(scenario)
    from dist_harness import global_batch

    tokens = global_batch(0, 2, 1)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    for result in _results(spawned, 2, "ddp-z2-accum1"):
        assert result["first_grad_norm"] == pytest.approx(expected, rel=1e-5)


def test_public_functions_take_the_ddp_wrapper(spawned) -> None:
    plain = make_model(Scenario("wrapper"))
    keys = sorted(plain.state_dict())
    for rank, result in enumerate(r["__wrapper__"] for r in spawned(2)):
        assert "error" not in result["calls"], result["calls"]
        calls = result["calls"]
        assert calls["units"] == pytest.approx(3.0)  # Z3: forward and backward broadcast, reduce
        assert calls["separate_group"]
        if rank == 0:  # full state dicts land on rank 0 only with cpu_offload; here on all
            assert calls["keys"] == keys
            assert calls["shapes"] == {k: tuple(v.shape) for k, v in plain.state_dict().items()}


def test_ddp_checkpoint_saved_at_2_ranks_resumes_at_3(spawned) -> None:
    saved = [r["__checkpoint__"]["run"] for r in spawned(2)]
    resumed = [r["__checkpoint__"]["run"] for r in spawned(3)]
    for rank, result in enumerate(saved + resumed):
        assert "error" not in result, f"{rank}: {result['error']}"
    expected = saved[0]
    assert sorted(expected) == sorted(make_model(Scenario("x")).state_dict())
    for rank, got in enumerate(resumed):
        for name, value in expected.items():
            diff = (got[name] - value).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {name}: {diff:.3g}"
