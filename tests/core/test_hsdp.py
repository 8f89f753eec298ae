"""DMuon on 2-D (replicate, shard) HSDP meshes against a single-process run on the global batch.

Two spawns for the whole module. 4 gloo ranks: the 2x2 scenarios, the 2x1 and 1x2 ones
(twice side by side, on 2-rank sub-meshes), the checkpoint round trips from a 2x2 run to
1x4, 4x1 and 1-D runs of 2 ranks and back, and the mesh errors. 6 gloo ranks: the 3x2 and
2x3 scenarios. Oracles: `dist_harness.reference_run` (the plain model trained on the whole
global batch, tolerance 1e-5 per parameter), the global-batch gradient norm of the plain
model, the traffic formula of the HSDP docs page, the FLOPs that
`torch.utils.flop_counter.FlopCounterMode` counts in one process's ``optimizer.step()``,
and the full tensors the saving run held (checkpoints, compared exactly).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist_harness import (
    ADAMW_LR,
    LR,
    Scenario,
    _loss,
    full_parameters,
    global_batch,
    hsdp_model,
    make_model,
    reference_run,
    run_in_order,
    run_scenario,
    spawn_ranks,
)

from dmuon import default_predicate

K = 2
STEPS = 2


def _scenario(shape: tuple[int, int], mode: str, sync: str) -> Scenario:
    return Scenario(
        f"{shape[0]}x{shape[1]}-{mode}-{sync}",
        mode,
        K,
        use_no_sync=sync == "no_sync",
        steps=STEPS,
        mesh_shape=shape,
    )


FULL_GRID = [("z2", "no_sync"), ("z3", "no_sync"), ("z2", "sync"), ("z3", "sync")]
#: The scenarios of each spawn, by its number of ranks. 2x2 runs the whole grid. 2x1 and
#: 1x2 share it (each covers Z2 and Z3, with and without no_sync); on the 4 ranks they run
#: twice side by side, each on its own 2-rank sub-mesh. 3x2 and 2x3 share it too.
SPAWNS = {
    4: [_scenario((2, 2), *cell) for cell in FULL_GRID]
    + [_scenario((2, 1), *cell) for cell in (FULL_GRID[0], FULL_GRID[3])]
    + [_scenario((1, 2), *cell) for cell in (FULL_GRID[1], FULL_GRID[2])],
    6: [_scenario((3, 2), *cell) for cell in (FULL_GRID[0], FULL_GRID[3])]
    + [_scenario((2, 3), *cell) for cell in (FULL_GRID[1], FULL_GRID[2])],
}
#: ``{name: (ranks of the spawn that runs it, scenario)}``.
SCENARIOS = {s.name: (world, s) for world, group in SPAWNS.items() for s in group}
WORLD = 4

#: P_M: the elements of the matrices Muon trains (the reference's Muon parameters).
MUON_ELEMENTS = sum(
    p.numel()
    for n, p in make_model(Scenario("count")).named_parameters()
    if n.startswith("layers.") and default_predicate(n, p)
)


# ----- the workers ---------------------------------------------------------------------------
def _momenta(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every Muon momentum as a full CPU tensor on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import dmuon
    from dmuon.checkpoint._optim_state import MOMENTUM

    osd = dmuon.get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    return {
        fqn: entry[MOMENTUM].cpu()
        for fqn, entry in osd["state"].items()
        if isinstance(entry, dict) and MOMENTUM in entry
    }


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _load(model, optimizer, path: str, group: Any = None) -> None:
    import torch.distributed.checkpoint as dcp

    import dmuon

    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)
    dmuon.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _reload(mesh: Any, path: str, group: Any = None) -> tuple[dict, dict]:
    """A fresh Z2 model on ``mesh`` loaded from the DCP checkpoint ``path``: full
    parameters and momenta."""
    model, optimizer = hsdp_model(mesh, "z2", "checkpoint")
    _load(model, optimizer, path, group)
    return full_parameters(model), _momenta(model, optimizer)


def _checkpoint_round_trips(rank: int, world: int, root: str) -> dict[str, float]:
    """2x2 HSDP -> 1x4, 4x1 and 1-D runs of 2 ranks -> 2x2 again, through DCP; max
    differences."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    flat = mesh2d["shard"]  # each replica's ranks: a 1-D run of world // 2 ranks
    hsdp, hsdp_opt = hsdp_model(mesh2d, "z3", "checkpoint")
    tokens = global_batch(0, world, 1).chunk(world)[rank]
    _loss(hsdp, tokens).backward()
    hsdp_opt.step()
    hsdp_opt.zero_grad()
    saved = full_parameters(hsdp), _momenta(hsdp, hsdp_opt)
    model_sd, optim_sd = dmuon.get_state_dict(hsdp, hsdp_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, "hsdp"))
    rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    rank0_sd = dmuon.get_model_state_dict(hsdp, options=rank0)
    rank0_osd = dmuon.get_optimizer_state_dict(hsdp, hsdp_opt, options=rank0)

    one_by_four = _reload(
        init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")),
        os.path.join(root, "hsdp"),
    )
    four_by_one = _reload(
        init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")),
        os.path.join(root, "hsdp"),
    )
    one_d, one_d_opt = hsdp_model(flat, "z2", "checkpoint")
    _load(one_d, one_d_opt, os.path.join(root, "hsdp"), flat.get_group())
    loaded = full_parameters(one_d), _momenta(one_d, one_d_opt)
    if mesh2d.get_local_rank("replicate") == 0:
        model_sd, optim_sd = dmuon.get_state_dict(one_d, one_d_opt)
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=os.path.join(root, "flat"),
            process_group=flat.get_group(),
        )
    dist.barrier()

    back, back_opt = hsdp_model(mesh2d, "z2", "checkpoint")
    _load(back, back_opt, os.path.join(root, "flat"))
    again = full_parameters(back), _momenta(back, back_opt)

    from_rank0, from_rank0_opt = hsdp_model(mesh2d, "z3", "checkpoint")
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dmuon.set_model_state_dict(from_rank0, rank0_sd if rank == 0 else {}, options=broadcast)
    dmuon.set_optimizer_state_dict(
        from_rank0, from_rank0_opt, rank0_osd if rank == 0 else {}, options=broadcast
    )
    return {
        "moved": _max_diff(saved[0], full_parameters(hsdp_model(mesh2d, "z3", "checkpoint")[0])),
        "hsdp_to_1x4_params": _max_diff(saved[0], one_by_four[0]),
        "hsdp_to_1x4_momenta": _max_diff(saved[1], one_by_four[1]),
        "hsdp_to_4x1_params": _max_diff(saved[0], four_by_one[0]),
        "hsdp_to_4x1_momenta": _max_diff(saved[1], four_by_one[1]),
        "hsdp_to_1d_params": _max_diff(saved[0], loaded[0]),
        "hsdp_to_1d_momenta": _max_diff(saved[1], loaded[1]),
        "1d_to_hsdp_params": _max_diff(saved[0], again[0]),
        "1d_to_hsdp_momenta": _max_diff(saved[1], again[1]),
        "rank0_full_to_hsdp_params": _max_diff(saved[0], full_parameters(from_rank0)),
        "rank0_full_to_hsdp_momenta": _max_diff(saved[1], _momenta(from_rank0, from_rank0_opt)),
        "rank0_holds_full": float(rank != 0 or rank0_sd.keys() == saved[0].keys()),
    }


def _reduce_inputs_alive_in_backward(world: int) -> dict[str, Any]:
    """A 6-layer model on the 2x2 mesh: how many boundaries still hold their reduce input
    when the gradient of layer 0's input arrives (the end of the layers' backward), and the
    trained result against one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    scenario = Scenario("six layers", model_kwargs={"n_layers": 6})
    model = make_model(scenario)
    dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    alive: list[int] = []

    def count(grad: torch.Tensor) -> torch.Tensor:
        boundaries = get_dedication(model).runtime.boundaries
        alive.append(sum(x.buffer._reduce_flat is not None for x in boundaries))
        return grad

    def watch(_module: Any, args: tuple[Any, ...]) -> None:
        if args[0].requires_grad:
            args[0].register_hook(count)

    model.layers[0].register_forward_pre_hook(watch)
    tokens = global_batch(0, world, 1).chunk(world)[dist_rank()]
    _loss(model, tokens).backward()
    return {"alive": alive, "boundaries": len(model.layers)}


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _mesh_errors(world: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    meshes = {
        "3d": init_device_mesh("cpu", (1, 2, world // 2), mesh_dim_names=("a", "b", "c")),
        "dp_tp": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp")),
        "swapped": init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("shard", "replicate")),
    }
    messages = {}
    for name, mesh in meshes.items():
        try:
            dmuon.dedicate_params(make_model(Scenario(name)), mesh)
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def _worker(rank: int, world: int, scenarios: list[Scenario], root: str) -> dict[str, Any]:
    # Every run also checks that all ranks issue the same collectives, per dimension
    # (owners alone take part in the replicate dimension's).
    os.environ["DMUON_CHECK_COLLECTIVES"] = "1"
    steps: list[tuple[str, Callable[[], Any]]] = [
        (s.name, functools.partial(run_scenario, s, rank, world)) for s in scenarios
    ]
    if world == WORLD:
        steps.append(("__checkpoint__", lambda: _checkpoint_round_trips(rank, world, root)))
        steps.append(("__errors__", lambda: _mesh_errors(world)))
        steps.append(("__reduce_window__", lambda: _reduce_inputs_alive_in_backward(world)))
    return run_in_order(steps)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict[str, Any]]]:
    """``spawned(ranks)``: the per-rank results of the module's spawn of that many ranks
    (each spawn runs once, when a test first asks for it)."""
    results: dict[int, list[dict[str, Any]]] = {}

    def of(world: int) -> list[dict[str, Any]]:
        if world not in results:
            root = str(tmp_path_factory.mktemp(f"hsdp-checkpoints-{world}"))
            results[world] = spawn_ranks(world, _worker, SPAWNS[world], root)
        return results[world]

    return of


def _per_rank(spawned: Callable[[int], list[dict[str, Any]]], key: str) -> list[Any]:
    world = SCENARIOS[key][0] if key in SCENARIOS else WORLD
    per_rank = []
    for rank, result in enumerate(spawned(world)):
        assert key in result, f"rank {rank} did not reach {key}: {list(result)}"
        assert "error" not in result[key], f"rank {rank}:\n{result[key]['error']}"
        per_rank.append(result[key])
    return per_rank


@functools.cache
def _reference(world: int) -> dict[str, torch.Tensor]:
    # The single-process run depends only on the global batches, not on Z2/Z3 or no_sync.
    return reference_run(Scenario("reference", accum=K, steps=STEPS), world)


def _reference_grad_norm(world: int) -> float:
    model = make_model(Scenario("reference"))
    _loss(model, global_batch(0, world, K)).backward()
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))


# ----- the tests -----------------------------------------------------------------------------
def _mesh_size(name: str) -> int:
    return math.prod(SCENARIOS[name][1].mesh_shape)


def _runs(per_rank: list[Any], size: int) -> list[list[Any]]:
    """The results of each run side by side: consecutive groups of ``size`` ranks."""
    return [per_rank[first : first + size] for first in range(0, len(per_rank), size)]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hsdp_matches_single_process_global_batch(spawned, name: str) -> None:
    reference = _reference(_mesh_size(name))
    initial = dict(make_model(Scenario("initial")).named_parameters())
    for rank, result in enumerate(_per_rank(spawned, name)):
        assert result["params"].keys() == reference.keys()
        worst = max((result["params"][n] - p).abs().max().item() for n, p in reference.items())
        assert worst <= 1e-5, f"rank {rank}: {worst:.2e}"
    moved = max((reference[n] - p).abs().max().item() for n, p in initial.items())
    assert moved > 1e-3  # the comparison is not between untrained models


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_traffic_per_mesh_dimension_follows_the_formula(spawned, name: str) -> None:
    _, scenario = SCENARIOS[name]
    replicas, shard = scenario.mesh_shape
    synced_backwards = 1 if scenario.use_no_sync else K
    forwards = K
    per_rank = _per_rank(spawned, name)
    for result in per_rank:
        groups = result["memory"]["groups"]
        # Clipping in step 0 sums the gradient norm over each mesh dimension of more than
        # one rank, through the communicator: audited apart, as control collectives.
        # Every step, the ranks agree whether a Muon gradient is NaN or infinite: one float32
        # over each of the same groups.
        norm_groups = (shard > 1) + (replicas > 1)
        assert result["comm"][0]["control"] == {
            "all_reduce": {
                "count": 2 * norm_groups,
                "elements": 2 * norm_groups,
                "bytes": (8 + 4) * norm_groups,
            }
        }
        agreement = {"count": norm_groups, "elements": norm_groups, "bytes": 4 * norm_groups}
        assert all(step["control"] == {"all_reduce": agreement} for step in result["comm"][1:])
        # One call per boundary and direction: a broadcast and a reduce where one rank
        # owns the boundary's matrices, an all-gather and a reduce-scatter where several do.
        owners = result["memory"]["owners"]
        assert len(owners) == groups
        single, shared = sum(n == 1 for n in owners), sum(n > 1 for n in owners)
        rounds = 1 if scenario.mode == "z2" else 2 * forwards
        expected = {
            "broadcast": single * rounds,
            "all_gather": shared * rounds,
            "reduce": single * synced_backwards,
            "reduce_scatter": shared * synced_backwards,
        }
        for step in result["comm"]:
            tallies = step["collectives"]
            if shard == 1:
                assert tallies == {} and step["units"] == 0
                continue
            counts = {kind: tally["count"] for kind, tally in tallies.items()}
            assert counts == {kind: n for kind, n in expected.items() if n}
            assert step["units"] == pytest.approx(rounds + synced_backwards)
    # The ranks of one replica own every matrix once. Per synchronised backward they
    # reduce-scatter P_M elements over the replicate group (1 unit of (R-1)/R x P_M), and
    # per step the replica that stepped each matrix broadcasts its P_M new values (1 unit).
    for replica in _runs(per_rank, shard):
        for step in range(STEPS):
            tallies = [r["comm"][step] for r in replica]
            if replicas == 1:
                assert all("dimensions" not in t for t in tallies)
                agreement = [("all_reduce", 1)] * (shard > 1)
                assert all(
                    [c for c in issued if c[0] != "all_gather_single"] == agreement
                    for r in replica
                    for issued in r["step_issued"]
                )
                continue
            dims = [t["dimensions"]["replicate"]["collectives"] for t in tallies]
            scattered = sum(d["reduce_scatter"]["elements"] for d in dims)
            shared = sum(
                d[k]["elements"] for d in dims for k in ("broadcast", "all_gather") if k in d
            )
            units = sum(t["dimensions"]["replicate"]["units"] for t in tallies)
            assert scattered == MUON_ELEMENTS * synced_backwards
            assert shared == MUON_ELEMENTS
            assert units == pytest.approx(synced_backwards + 1)
            # The step's updated values, counted at torch.distributed independently of the
            # audit: the only collectives optimizer.step() issues (besides the
            # all-gathered signatures of DMUON_CHECK_COLLECTIVES, which these runs set).
            # These small models fit one chunk: one call per rank, a broadcast when one
            # replica stepped all of the rank's matrices, else an all-gather of uneven
            # pieces (on gloo, an all-to-all: each replica sends its piece to every other).
            for result, dim in zip(replica, dims, strict=True):
                issued = [c for c in result["step_issued"][step] if c[0] != "all_gather_single"]
                agreement = [("all_reduce", 1)] * ((shard > 1) + 1)  # first, then the updates
                assert issued[: len(agreement)] == agreement
                issued = issued[len(agreement) :]
                if "broadcast" in dim:  # the updates travel packed as bytes
                    assert issued == [("broadcast", dim["broadcast"]["bytes"])]
                else:
                    assert [kind for kind, _ in issued] == ["all_to_all_single"]


@functools.cache
def _single_process_step_flops() -> int:
    """FLOPs `FlopCounterMode` counts in ``optimizer.step()`` of one process, same model."""
    from torch.utils.flop_counter import FlopCounterMode

    import dmuon

    model = make_model(Scenario("one process"))
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR)
    _loss(model, global_batch(0, 1, 1)).backward()
    with FlopCounterMode(display=False) as flops:
        optimizer.step()
    return flops.get_total_flops()


@pytest.mark.parametrize("name", [n for n, (_, s) in SCENARIOS.items() if s.mesh_shape[0] > 1])
def test_newton_schulz_runs_once_per_world_and_balanced(spawned, name: str) -> None:
    """Each matrix is orthogonalized on one rank of the whole mesh: the FLOPs of all
    ranks' steps add up to one process's (not R times), and no rank carries more than
    1.5x the mean."""
    one_process = _single_process_step_flops()
    assert one_process > 0
    for run in _runs(_per_rank(spawned, name), _mesh_size(name)):
        for step in range(STEPS):
            flops = [result["step_flops"][step] for result in run]
            assert sum(flops) == pytest.approx(one_process, rel=0.1), flops
            assert max(flops) <= 1.5 * sum(flops) / len(flops), flops


@pytest.mark.parametrize("world", sorted({_mesh_size(name) for name in SCENARIOS}))
def test_clip_grad_norm_on_hsdp_is_the_global_batch_norm(spawned, world: int) -> None:
    expected = _reference_grad_norm(world)
    for name in SCENARIOS:
        if _mesh_size(name) == world:
            for result in _per_rank(spawned, name):
                assert result["first_grad_norm"] == pytest.approx(expected, rel=1e-5), name


def test_checkpoints_reshard_between_hsdp_and_1d(spawned) -> None:
    for rank, result in enumerate(_per_rank(spawned, "__checkpoint__")):
        assert result["moved"] > 1e-3, "the saved run did not train"
        for key, value in result.items():
            if key not in ("moved", "rank0_holds_full"):
                assert value == 0.0, f"rank {rank}: {key} differs by {value}"
        assert result["rank0_holds_full"] == 1.0


def test_meshes_hsdp_does_not_use_are_refused_with_what_to_pass(spawned) -> None:
    messages = _per_rank(spawned, "__errors__")[0]
    assert "3 dimensions" in messages["3d"] and "mesh['dp']" in messages["3d"]
    for name in ("dp_tp", "swapped"):
        assert "mesh_dim_names=('replicate', 'shard')" in messages[name], messages[name]
    assert "('dp', 'tp')" in messages["dp_tp"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_cluster_plan_predicts_the_audit_and_the_flops(spawned, name: str) -> None:
    """`dmuon.plan.plan_cluster` on the same model and mesh, rank by rank: the collectives
    of each dimension (count and elements) equal what the comm audit recorded in every
    step, and the Newton-Schulz FLOPs what `FlopCounterMode` counted in ``optimizer.step()``.
    The 1x2 runs are 1-D meshes of 2 ranks."""
    from dmuon.plan import plan_cluster

    _, scenario = SCENARIOS[name]
    replicas, shard = scenario.mesh_shape
    plan = plan_cluster(
        make_model(Scenario("plan")),
        replicas * shard,
        shard,
        mode=scenario.mode,
        accum=K,
        no_sync=scenario.use_no_sync,
        ns_dtype=torch.float32,
        device_type="cpu",
    )

    def tallies(collectives: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return {kind: (t["count"], t["elements"]) for kind, t in collectives.items()}

    for run in _runs(_per_rank(spawned, name), _mesh_size(name)):
        for rank, result in enumerate(run):
            predicted = plan.ranks[rank]
            assert result["step_flops"] == [predicted.ns_flops] * STEPS
            shard_dim = {k: (t.count, t.elements) for k, t in predicted.shard_collectives.items()}
            replicate_dim = {
                k: (t.count, t.elements) for k, t in predicted.replicate_collectives.items()
            }
            for step in result["comm"]:
                assert tallies(step["collectives"]) == shard_dim, rank
                measured = step.get("dimensions", {}).get("replicate", {}).get("collectives", {})
                assert tallies(measured) == replicate_dim, rank


def test_backward_keeps_a_bounded_window_of_reduce_inputs(spawned) -> None:
    """Reduce inputs (float32, a boundary's gradients) are waited on and released during
    backward: at most REDUCES_IN_FLIGHT + 2 of the 6 boundaries hold one at the end of the
    layers' backward (those in flight, the one issued last, and the one whose reduce-scatter
    between replicas is in flight), where all 6 used to."""
    from dmuon._ownership.gradients import REDUCES_IN_FLIGHT

    for rank, result in enumerate(_per_rank(spawned, "__reduce_window__")):
        assert result["boundaries"] == 6
        assert result["alive"], f"rank {rank}: the hook did not run"
        assert 1 <= max(result["alive"]) <= REDUCES_IN_FLIGHT + 2 < 6, (rank, result["alive"])
