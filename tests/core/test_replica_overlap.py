"""HSDP: the values a step computed reach the other replicas while the next forward runs,
and every read of the weights in between sees them.

After each step the updates are still in flight (checked), and the first read after the
step is, in turn, a full state dict, an evaluation forward, and `dmuon.parameters_updated`
followed by a state dict. Oracles: the single-process run on the global batch stopped after
the same number of steps (its parameters, and its loss on the evaluation batch); tolerance
1e-5 as in the other distributed tests. HSDP 2x2 and 3x2, Z2 and Z3.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from dist_harness import (
    EVAL_TOKENS,
    Scenario,
    _loss,
    global_batch,
    hsdp_model,
    make_model,
    reference_eval_loss,
    reference_run,
    spawn_ranks,
)

STEPS = 3
#: What each step's first read of the weights is.
READS = ("state dict", "evaluation", "parameters_updated")
SHAPES = {4: (2, 2), 6: (3, 2)}


def _evaluate(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return _loss(model, EVAL_TOKENS).item()


def _read(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import dmuon

    state = dmuon.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon
    from dmuon._ownership.dedication_state import get_dedication

    mesh = init_device_mesh("cpu", SHAPES[world], mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}
    for mode in ("z2", "z3"):
        model, optimizer = hsdp_model(mesh, mode, "overlap")
        runtime = get_dedication(model).runtime
        in_flight, weights, losses = [], [], []
        for step in range(STEPS):
            tokens = global_batch(step, world, 1).chunk(world)[rank]
            _loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            in_flight.append(runtime.replica_updates.pending)

            if READS[step] == "state dict":
                weights.append(_read(model))
                losses.append(_evaluate(model))
            elif READS[step] == "evaluation":
                losses.append(_evaluate(model))
                weights.append(_read(model))
            else:
                dmuon.parameters_updated(model)
                weights.append(_read(model))
                losses.append(_evaluate(model))
        out[mode] = {"in_flight": in_flight, "weights": weights, "losses": losses}
    return out


@functools.cache
def _spawned(world: int) -> list[dict[str, Any]]:
    return spawn_ranks(world, _worker)


@functools.cache
def _reference(world: int, steps: int) -> dict[str, torch.Tensor]:
    return reference_run(Scenario("reference", steps=steps), world)


@pytest.mark.parametrize("mode", ["z2", "z3"])
@pytest.mark.parametrize("world", sorted(SHAPES))
def test_updates_overlap_the_next_forward_and_every_read_sees_them(world: int, mode: str) -> None:
    initial = dict(make_model(Scenario("initial")).named_parameters())
    for rank, result in enumerate(_spawned(world)):
        assert "error" not in result, result.get("error")
        got = result[mode]
        # Nothing waited for the updates inside the step: they were on their way.
        assert got["in_flight"] == [True] * STEPS, (rank, got["in_flight"])
        for step in range(STEPS):
            reference = _reference(world, step + 1)
            weights = got["weights"][step]
            assert weights.keys() == reference.keys()
            worst = max((weights[n] - p).abs().max().item() for n, p in reference.items())
            assert worst <= 1e-5, f"rank {rank}, {READS[step]} after step {step}: {worst:.2e}"
            expected = reference_eval_loss(Scenario("reference"), reference)
            assert abs(got["losses"][step] - expected) <= 1e-5, (rank, step)
    final = _reference(world, STEPS)
    assert max((final[n] - p).abs().max().item() for n, p in initial.items()) > 1e-3
