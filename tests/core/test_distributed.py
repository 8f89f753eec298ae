"""Distributed DMuon on gloo ranks against a single-process run on the global batch.

Each world size is spawned once per module (all scenarios run inside the same ranks).
Oracle: `dist_harness.reference_run`, the plain model trained on the whole global batch
with float32 Newton-Schulz Muon and torch.optim.AdamW. Tolerance 1e-5 absolute on every
parameter (float32 sums in a different order differ by about 1e-7 per step).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dist_harness import (
    Scenario,
    make_model,
    reference_eval_loss,
    reference_run,
    run_distributed,
    spawn_ranks,
)

K = 4
EQUIVALENCE = [
    Scenario("z2-accum1", "z2", 1),
    Scenario("z3-accum1", "z3", 1),
    Scenario("z2-accum4-no_sync", "z2", K, use_no_sync=True),
    Scenario("z3-accum4-no_sync", "z3", K, use_no_sync=True),
    Scenario("z2-accum4-sync", "z2", K, use_no_sync=False),
    Scenario("z3-accum4-sync", "z3", K, use_no_sync=False),
    Scenario("z3-meta-init", "z3", 1, meta_init=True),
    Scenario("z2-meta-init", "z2", 1, meta_init=True),
    Scenario("z3-meta-init-deep", "z3", 1, meta_init=True, model_kwargs={"n_layers": 8}),
]
FEATURES = [
    Scenario("z3-checkpoint", "z3", 2, checkpoint=True),
    Scenario("z2-checkpoint", "z2", 2, checkpoint=True),
    Scenario("z3-dataclass-output", "z3", 1, dataclass_output=True),
    Scenario("z3-bf16", "z3", 2, bf16=True),
    Scenario("z3-bf16-from-policy", "z3", 2, bf16=True, bf16_from_policy=True),
    Scenario("z3-top-layer-frozen", "z3", 2, frozen_layer=1),
    Scenario("z2-top-layer-frozen", "z2", 2, frozen_layer=1),
    Scenario("z2-bf16-from-policy", "z2", 2, bf16=True, bf16_from_policy=True),
    Scenario("naive-fsdp2-muon", "z3", 2, naive=True),
]
SCENARIOS = {s.name: s for s in EQUIVALENCE + FEATURES}
MUON_NAMES = {
    f"layers.{i}.{m}.weight"
    for i in range(2)
    for m in (
        *("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"),
        *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    )
}
# Relative error of the bf16 run's update ||p - p_ref|| / ||p_ref - p_0||.
BF16_UPDATE_TOLERANCE = 0.1


WORLDS = {2: EQUIVALENCE + FEATURES, 4: EQUIVALENCE}
CASES = [(world, s.name) for world, scenarios in WORLDS.items() for s in scenarios]
EQUIVALENCE_CASES = [(w, n) for w, n in CASES if n in {s.name for s in EQUIVALENCE}]


@pytest.fixture(scope="module")
def spawned() -> Callable[[int], list[dict[str, Any]]]:
    """Spawn each world size once for the whole module, on first use."""
    cache: dict[int, list[dict[str, Any]]] = {}

    def results(world: int) -> list[dict[str, Any]]:
        if world not in cache:
            cache[world] = run_distributed(world, WORLDS[world])
        return cache[world]

    return results


def _scenario_results(spawned, world: int, name: str) -> list[dict[str, Any]]:
    results = spawned(world)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        assert "error" not in result[name], f"rank {rank}:\n{result[name]['error']}"
    return [r[name] for r in results]


@pytest.mark.parametrize(("world", "name"), CASES)
def test_parameters_match_single_process_global_batch(spawned, world: int, name: str) -> None:
    per_rank = _scenario_results(spawned, world, name)
    scenario = SCENARIOS[name]
    reference = reference_run(scenario, world)
    initial = {n: p.detach() for n, p in make_model(scenario).named_parameters()}
    for rank, result in enumerate(per_rank):
        assert result["params"].keys() == reference.keys()
        for fqn, expected in reference.items():
            got = result["params"][fqn]
            if scenario.bf16:
                # bf16 forward against an fp32 oracle: compare the whole update.
                update_error = (got - expected).norm() / (expected - initial[fqn]).norm()
                assert update_error <= BF16_UPDATE_TOLERANCE, f"rank {rank} {fqn}: {update_error}"
            else:
                diff = (got - expected).abs().max().item()
                assert diff <= 1e-5, f"rank {rank} {fqn}: max |diff| {diff:.3g} > 1e-5"
    # The run must have moved the parameters, or the comparison proves nothing.
    moved = max((reference[n] - p).abs().max().item() for n, p in initial.items())
    assert moved > 1e-3


#: Allocations of set-up that are not tensors of the model (the process groups' and
#: FSDP2's bookkeeping, the load's scalars), in bytes.
SETUP_SLACK = 4096


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["z3-meta-init", "z2-meta-init", "z3-meta-init-deep"])
def test_a_model_built_on_meta_holds_its_share_during_set_up(
    spawned, world: int, name: str
) -> None:
    """Built on the meta device, dedicated, sharded, materialised and loaded from rank 0
    (it trains as one process: the test above), no rank allocated more during set-up than
    what it keeps (its FSDP2 shards and owned masters) plus one boundary's buffer or one
    whole tensor (what the load broadcasts at once), whichever is larger. On the 8-layer
    model that bound is below the whole model, so allocating it whole fails the test."""
    for rank, result in enumerate(_scenario_results(spawned, world, name)):
        memory = result["setup_memory"]
        kept = memory["shards"] + memory["masters"]
        bound = kept + max(memory["boundary"], memory["largest"]) + SETUP_SLACK
        assert kept <= memory["peak"] <= bound, f"rank {rank}: {memory}"
        if name.endswith("deep"):
            assert bound < memory["whole"], f"rank {rank}: {memory}"


@pytest.mark.parametrize(("world", "name"), CASES)
def test_forward_after_training_uses_the_updated_weights(spawned, world: int, name: str) -> None:
    # Each rank's own forward after the last step (Z2 buffers included) against the
    # reference model's loss on the same unseen batch.
    per_rank = _scenario_results(spawned, world, name)
    scenario = SCENARIOS[name]
    expected = reference_eval_loss(scenario, reference_run(scenario, world))
    tolerance = 2e-2 if scenario.bf16 else 1e-5
    for rank, result in enumerate(per_rank):
        assert result["eval_loss"] == pytest.approx(expected, abs=tolerance), f"rank {rank}"


def _expected_comm(scenario: Scenario, owners: list[int]) -> dict[str, float]:
    """Per step: each buffer (one per hook boundary) sends its values in one call per
    forward pass (Z2: once) and sums its gradients in one call per synchronised backward,
    a broadcast and a reduce when one rank owns it all, else an all-gather and a
    reduce-scatter of the owners' pieces."""
    k = scenario.accum
    rounds = 1 if scenario.mode == "z2" else 2 * k
    synced = 1 if scenario.use_no_sync or k == 1 else k
    single = sum(1 for n in owners if n == 1)
    shared = len(owners) - single
    if scenario.mode == "z2":
        units = 1 + (1 if scenario.use_no_sync else k)
    else:
        units = 2 * k + (1 if scenario.use_no_sync else k)
    expected = {
        "broadcast": single * rounds,
        "all_gather": shared * rounds,
        "reduce": single * synced,
        "reduce_scatter": shared * synced,
    }
    return {kind: count for kind, count in expected.items() if count} | {"units": units}


@pytest.mark.parametrize(("world", "name"), EQUIVALENCE_CASES)
def test_communication_per_optimizer_step(spawned, world: int, name: str) -> None:
    per_rank = _scenario_results(spawned, world, name)
    scenario = SCENARIOS[name]
    for result in per_rank:
        expected = _expected_comm(scenario, result["memory"]["owners"])
        units = expected.pop("units")
        assert len(result["comm"]) == scenario.steps
        for step in result["comm"]:
            counts = {kind: tally["count"] for kind, tally in step["collectives"].items()}
            assert counts == expected
            assert step["units"] == pytest.approx(units, abs=1e-12)
        # optimizer.step() issues one collective: the ranks agree whether a Muon gradient
        # is NaN or infinite (one number), so that nonfinite="raise" raises on all alike.
        assert result["step_issued"] == [[("all_reduce", 1)]] * scenario.steps


@pytest.mark.parametrize("world", list(WORLDS))
def test_no_sync_gives_the_designed_units(spawned, world: int) -> None:
    # The headline numbers: with k=4 under no_sync, Z2 costs 2 units and Z3 costs 2k+1 = 9.
    z2 = _scenario_results(spawned, world, "z2-accum4-no_sync")[0]["comm"][-1]["units"]
    z3 = _scenario_results(spawned, world, "z3-accum4-no_sync")[0]["comm"][-1]["units"]
    assert (z2, z3) == (pytest.approx(2.0), pytest.approx(2 * K + 1.0))


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("name", ["z2-accum1", "z3-accum1"])
def test_memory_after_forward(spawned, world: int, name: str) -> None:
    for result in _scenario_results(spawned, world, name):
        memory = result["memory"]
        assert memory["placeholder_elements"] == 0
        assert memory["master_ok"]
        if name.startswith("z3"):
            assert memory["buffer_bytes"] == 0
        else:
            assert memory["buffer_bytes"] == memory["packed_bytes"] > 0


@pytest.mark.parametrize(("world", "name"), CASES)
def test_zero_grad_clears_dedicated_gradients(spawned, world: int, name: str) -> None:
    for result in _scenario_results(spawned, world, name):
        assert result["leftover_grads"] == []


@pytest.mark.parametrize("world", list(WORLDS))
def test_every_parameter_has_one_owner_on_every_rank(spawned, world: int) -> None:
    per_rank = _scenario_results(spawned, world, "z3-accum1")
    owners = per_rank[0]["owners"]
    assert all(r["owners"] == owners for r in per_rank)
    assert set(owners.values()) == set(range(world))  # every rank owns something


def test_user_errors_that_need_a_process_group(spawned) -> None:
    messages = spawned(2)[0]["__errors__"]
    assert "before fully_shard" in messages["after_fully_shard"]
    assert "1-D DeviceMesh" in messages["mesh_2d"]
    before, inside, after = ast.literal_eval(messages["no_sync_flags"])
    assert before == after and False in before  # restored exactly, one flag was already off
    assert not any(inside)


def test_naive_baseline_gathers_every_matrix_in_step(spawned) -> None:
    # Naive FSDP2 + Muon: step() all-gathers each full update, on every rank. Counted by
    # intercepting the collectives themselves: 14 gathers (7 matrices x 2 layers) whose
    # local inputs add up to P_M / N elements.
    model = make_model(SCENARIOS["naive-fsdp2-muon"])
    muon_elements = sum(p.numel() for n, p in model.named_parameters() if n in MUON_NAMES)
    for result in _scenario_results(spawned, 2, "naive-fsdp2-muon"):
        for issued in result["step_issued"]:
            names = {name for name, _ in issued}
            assert names == {"all_gather_into_tensor"}, names
            assert len(issued) == 14
            assert sum(numel for _, numel in issued) == muon_elements // 2


def test_dedicated_matrices_follow_fsdp2s_mixed_precision_policy(spawned) -> None:
    # dedicate_params without dtypes under MixedPrecisionPolicy(bf16, reduce fp32): the
    # same computation, value for value, as giving dedicate_params the policy's dtypes.
    for mode in ("z3", "z2"):
        explicit = _scenario_results(spawned, 2, "z3-bf16") if mode == "z3" else None
        following = _scenario_results(spawned, 2, f"{mode}-bf16-from-policy")
        for rank, result in enumerate(following):
            for fqn, value in result["params"].items():
                assert value.isfinite().all(), (mode, rank, fqn)
                if explicit is not None:
                    assert torch.equal(value, explicit[rank]["params"][fqn]), (rank, fqn)


def _forward_under_a_conflicting_policy(rank: int, world: int) -> str:
    import dist_harness
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("conflict"))
    dmuon.dedicate_params(model, mesh, param_dtype=torch.float16)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    tokens = dist_harness.global_batch(0, world, 1).chunk(world)[rank]
    try:
        dist_harness._loss(model, tokens)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_param_dtype_that_contradicts_the_policy_raises_naming_both() -> None:
    for message in spawn_ranks(2, _forward_under_a_conflicting_policy):
        assert "param_dtype=torch.float16" in message, message
        assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in message


def _step_without_a_wrapper(rank: int, world: int) -> str:
    import dist_harness
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("unwrapped"))
    dmuon.dedicate_params(model, mesh)
    optimizer = dmuon.Muon(model, lr=0.02)
    tokens = dist_harness.global_batch(0, world, 1).chunk(world)[rank]
    dist_harness._loss(model, tokens).backward()
    try:
        optimizer.step()
    except ValueError as e:
        return str(e)
    return "no error"


def test_torchrun_without_fsdp2_or_ddp_raises_at_the_first_step() -> None:
    # The embedding, norms and head would each train on one rank's data alone.
    for message in spawn_ranks(2, _step_without_a_wrapper):
        assert "neither sharded by FSDP2 nor in a DistributedDataParallel" in message, message
        assert "fully_shard" in message and "DistributedDataParallel(model)" in message
