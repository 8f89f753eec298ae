"""HSDP gradient accumulation that crosses replicas once per step:
``dmuon.no_sync(model, scope="replicas")`` around all micro-batches but the last.

Oracles: the single-process run on the global batch (tolerance 1e-5 as in the other
distributed tests); the comm audit, per step: a reduce inside the replica for every
micro-batch and boundary, one reduce-scatter between replicas per boundary; and the
matrices each rank owns, for the size of what it holds between micro-batches (its owned
elements, about P_M / S). HSDP 2x2 and 3x2, Z2 and Z3, 4 micro-batches.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any

import pytest
from dist_harness import (
    Scenario,
    _loss,
    global_batch,
    hsdp_model,
    make_model,
    reference_run,
    spawn_ranks,
)

K = 4
STEPS = 2
SHAPES = {4: (2, 2), 6: (3, 2)}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication

    mesh = init_device_mesh("cpu", SHAPES[world], mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}
    for mode in ("z2", "z3"):
        model, optimizer = hsdp_model(mesh, mode, "replica accumulation")
        state = get_dedication(model)
        held = []
        for step in range(STEPS):
            tokens = global_batch(step, world, K).chunk(world)[rank]
            for micro, chunk in enumerate(tokens.chunk(K)):
                last = micro == K - 1
                ctx = nullcontext() if last else dmuon.no_sync(model, scope="replicas")
                with ctx:
                    (_loss(model, chunk) / K).backward()
                if micro == K - 2:
                    held.append(
                        sum(
                            t.numel()
                            for buffer in state.runtime.buffers()
                            for t in buffer._replica_sums.values()
                        )
                    )
            optimizer.step()
            optimizer.zero_grad()
        full = dmuon.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[mode] = {
            "params": {k: v.detach().clone() for k, v in full.items()},
            "held": held,
            "owned": sum(dp.numel for dp in state.params if dp.is_owned),
            "boundaries": len(state.runtime.boundaries),
            "steps": [s.as_dict() for s in dmuon.comm_audit(model).steps],
        }
    return out


@functools.cache
def _spawned(world: int) -> list[dict[str, Any]]:
    return spawn_ranks(world, _worker)


@pytest.mark.parametrize("mode", ["z2", "z3"])
@pytest.mark.parametrize("world", sorted(SHAPES))
def test_accumulation_crosses_replicas_once_and_trains_as_one_process(
    world: int, mode: str
) -> None:
    reference = reference_run(Scenario("reference", accum=K, steps=STEPS), world)
    initial = dict(make_model(Scenario("initial")).named_parameters())
    assert max((reference[n] - p).abs().max().item() for n, p in initial.items()) > 1e-3
    for rank, result in enumerate(_spawned(world)):
        assert "error" not in result, result.get("error")
        got = result[mode]
        worst = max((got["params"][n] - p).abs().max().item() for n, p in reference.items())
        assert worst <= 1e-5, f"rank {rank}: {worst:.2e}"
        # Between micro-batches a rank holds the sums of its own matrices only.
        assert got["held"] == [got["owned"]] * STEPS, (rank, got["held"], got["owned"])
        boundaries = got["boundaries"]
        for step in got["steps"][:STEPS]:
            replicate = step["dimensions"]["replicate"]["collectives"]
            shard = step["dimensions"]["shard"]["collectives"]
            crossing = replicate.get("reduce_scatter", {}).get("count", 0)
            inside = sum(shard.get(k, {}).get("count", 0) for k in ("reduce", "reduce_scatter"))
            if got["owned"]:
                assert crossing == boundaries, (rank, replicate)
            assert inside == K * boundaries, (rank, shard)


@pytest.mark.parametrize("world", sorted(SHAPES))
def test_the_planner_predicts_what_the_ranks_hold_and_send(world: int) -> None:
    """`plan_cluster(no_sync=True, no_sync_scope="replicas")` rank by rank against the
    gloo run: the sums held between micro-batches (float32) and the collective calls of
    each mesh dimension."""
    from dmuon.plan import plan_cluster

    _, shard = SHAPES[world]
    plan = plan_cluster(
        make_model(Scenario("plan")),
        world,
        shard,
        mode="z3",
        accum=K,
        no_sync=True,
        no_sync_scope="replicas",
        device_type="cpu",
    )
    for rank, result in enumerate(_spawned(world)):
        got, predicted = result["z3"], plan.ranks[rank]
        assert predicted.accumulator_bytes == 4 * got["held"][0], rank
        measured = got["steps"][0]["dimensions"]
        for dimension, tallies in (
            ("replicate", predicted.replicate_collectives),
            ("shard", predicted.shard_collectives),
        ):
            counts = {k: v["count"] for k, v in measured[dimension]["collectives"].items()}
            expected = {k: t.count for k, t in tallies.items() if t.count}
            assert counts == expected, (rank, dimension, counts, expected)
