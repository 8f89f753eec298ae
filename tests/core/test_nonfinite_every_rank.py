"""A NaN gradient seen by one owner raises on every rank, and training goes on.

Only the rank that steps a matrix sees its averaged gradient. With ``nonfinite="raise"``
the error must reach every rank before anything changes: a rank that raised while the
others stepped would skip the step's collectives and leave the others waiting. The
pattern checked is the one users write: catch the error, drop the batch, carry on.

Oracle: one process trained with ``reference_train`` on the global batches of the steps
that were not dropped (float32, 1e-5), on 4 gloo ranks, flat (Z2) and HSDP 2x2 (Z3). The
NaN is written into the averaged gradient on the one rank that steps the matrix. Each
rank's ``optimizer.step()`` reads the device once (the norms and the agreement together),
counted as DMuon's own ``Tensor.item`` and ``Tensor.tolist`` calls (2 before).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import (
    Scenario,
    full_parameters,
    global_batch,
    hsdp_model,
    make_model,
    reference_train,
    spawn_ranks,
)
from host_reads import counted_host_reads

import dmuon
from dmuon.optim import NonFiniteGradientError

WORLD = 4
STEPS = 3
POISONED_STEP = 1
TARGET = "layers.0.attn.q_proj.weight"
LAYOUTS = {"flat-z2": ((WORLD,), "z2"), "hsdp-z3": ((2, 2), "z3")}


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    for layout, (shape, mode) in LAYOUTS.items():
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model, optimizer = hsdp_model(mesh, mode, "nonfinite")
        raised: list[str | None] = []
        reads: list[list[str]] = []
        poisoned_here = False
        for step in range(STEPS):
            tokens = global_batch(step, world, 1).chunk(world)[rank]
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            if step == POISONED_STEP:
                for dp in dmuon.dedicated_parameters(model):
                    if dp.fqn == TARGET and dp.updates_here:
                        dp.param._reduced_grad[0, 0] = float("nan")
                        poisoned_here = True
            with counted_host_reads() as step_reads:
                try:
                    optimizer.step()
                    raised.append(None)
                except NonFiniteGradientError as e:
                    raised.append(str(e))
            reads.append(step_reads)
            optimizer.zero_grad()
        out[layout] = {
            "raised": raised,
            "reads": reads,
            "poisoned_here": poisoned_here,
            "params": full_parameters(model),
        }
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return spawn_ranks(WORLD, _worker)


def _reference() -> dict[str, torch.Tensor]:
    from dmuon import default_predicate

    model = make_model(Scenario("nonfinite"))
    muon_names = {
        n
        for n, p in model.named_parameters()
        if default_predicate(n, p) and "lm_head" not in n and n.startswith("layers.")
    }
    kept = [global_batch(step, WORLD, 1) for step in range(STEPS) if step != POISONED_STEP]
    return reference_train(model, muon_names, kept)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_raises_and_the_next_steps_match_one_process(
    per_rank: list[dict[str, Any]], layout: str
) -> None:
    results = [r[layout] for r in per_rank]
    assert sum(r["poisoned_here"] for r in results) == 1  # one rank saw the NaN
    for rank, r in enumerate(results):
        assert [m is not None for m in r["raised"]] == [False, True, False], rank
        assert [len(step) for step in r["reads"]] == [1] * STEPS, (rank, r["reads"])
        message = r["raised"][POISONED_STEP]
        assert "nothing was changed, on any rank" in message
        if r["poisoned_here"]:
            assert TARGET in message
        else:
            assert "another rank found" in message
    expected = _reference()
    for rank, r in enumerate(results):
        for name, value in expected.items():
            diff = (r["params"][name] - value).abs().max().item()
            assert diff <= 1e-5, f"{layout} rank {rank} {name}: {diff:.3g}"
