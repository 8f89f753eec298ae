"""Pipeline parallelism (`torch.distributed.pipelining`) with dedication per stage.

4 gloo ranks: 2 pipeline stages x 2 data-parallel ranks. Each stage's module (stage 0:
the embedding and the first layer; stage 1: the second layer, the norm and the head) is
dedicated over the data-parallel sub-mesh and wrapped by FSDP2 there, as torchtitan does.
The GPipe and 1F1B schedules run 4 micro-batches a step with their defaults (the loss is
the micro-batch's mean, the schedule divides the gradients by 4). Oracle: the
single-process run of the whole model on the global batch, tolerance 1e-5, Z2 and Z3.
Interleaved 1F1B runs a 4-layer model as 4 stages, two per rank, against the same oracle;
the zero-bubble schedules, which split backward into inputs then weights, are refused by
the ranks that run their first forward, naming the schedules that work.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_harness import (
    ADAMW_LR,
    LR,
    Scenario,
    full_parameters,
    global_batch,
    make_model,
    reference_run,
    spawn_ranks,
)
from torch import nn

STEPS = 2
MICRO = 4
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


class FirstStage(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embed = model.embed
        self.layers = nn.ModuleList([model.layers[0]])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.embed(tokens))


class LastStage(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([model.layers[1]])
        self.norm = model.norm
        self.lm_head = model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.layers[0](hidden)))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    out: dict[str, Any] = {"stage": stage_index}
    for schedule_name in SCHEDULES:
        for mode in ("z2", "z3"):
            whole = make_model(Scenario("pipeline"))
            module = FirstStage(whole) if stage_index == 0 else LastStage(whole)
            dmuon.dedicate_params(module, mesh["dp"], reshard_after_forward=mode == "z3")
            fully_shard(module.layers[0], mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
            optimizer = dmuon.Muon(
                module, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
            )
            stage = pipelining.PipelineStage(
                module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group()
            )
            schedule = getattr(pipelining, schedule_name)(stage, MICRO, loss_fn=_loss)
            for step in range(STEPS):
                tokens = global_batch(step, 2, MICRO).chunk(2)[dp_rank]
                if stage_index == 0:
                    schedule.step(tokens[:, :-1])
                else:
                    schedule.step(target=tokens[:, 1:], losses=[])
                optimizer.step()
                optimizer.zero_grad()
            out[f"{schedule_name}-{mode}"] = full_parameters(module)
    return out


class Stage(nn.Module):
    """Layer ``index`` of a 4-layer model, with the embedding first and the head last."""

    def __init__(self, model: nn.Module, index: int) -> None:
        super().__init__()
        self.index = index
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleList([model.layers[index]])
        self.norm = model.norm if index == 3 else None
        self.lm_head = model.lm_head if index == 3 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](self.embed(x) if self.embed is not None else x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


FOUR_LAYERS = Scenario("four layers", steps=STEPS, accum=MICRO, model_kwargs={"n_layers": 4})


def _multi_stage_worker(rank: int, world: int, schedule_name: str) -> dict[str, Any]:
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dmuon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    whole = make_model(FOUR_LAYERS)
    indices = [pp_rank, 3 - pp_rank] if "ZBV" in schedule_name else [pp_rank, pp_rank + 2]
    stages, optimizers = [], []
    for index in indices:
        module = Stage(whole, index)
        dmuon.dedicate_params(module, mesh["dp"])
        fully_shard(module.layers[0], mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        optimizers.append(
            dmuon.Muon(
                module, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
            )
        )
        stages.append(
            pipelining.PipelineStage(
                module, index, 4, torch.device("cpu"), group=mesh["pp"].get_group()
            )
        )
    schedule = getattr(pipelining, schedule_name)(stages, MICRO, loss_fn=_loss)
    for step in range(STEPS):
        tokens = global_batch(step, 2, MICRO).chunk(2)[dp_rank]
        inputs = (tokens[:, :-1],) if pp_rank == 0 else ()
        schedule.step(*inputs, target=tokens[:, 1:], losses=[])
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    params = {}
    for index, stage in zip(indices, stages, strict=True):
        for name, value in full_parameters(stage.submod).items():
            params[name.replace("layers.0.", f"layers.{index}.")] = value
    return params


@functools.cache
def _spawned() -> list[dict[str, Any]]:
    return spawn_ranks(4, _worker)


@pytest.mark.parametrize("mode", ["z2", "z3"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_schedules_train_as_one_process(schedule: str, mode: str) -> None:
    reference = reference_run(Scenario("reference", steps=STEPS, accum=MICRO), 2)
    for rank, result in enumerate(_spawned()):
        assert "error" not in result, result.get("error")
        params = result[f"{schedule}-{mode}"]
        # A stage's "layers.0" is the whole model's layer 0 or 1.
        layer = f"layers.{result['stage']}."
        assert params
        for name, value in params.items():
            whole = name.replace("layers.0.", layer)
            worst = (value - reference[whole]).abs().max().item()
            assert worst <= 1e-5, (rank, name, worst)


def test_interleaved_1f1b_with_two_stages_per_rank_trains_as_one_process() -> None:
    reference = reference_run(FOUR_LAYERS, 2)
    for rank, params in enumerate(spawn_ranks(4, _multi_stage_worker, "ScheduleInterleaved1F1B")):
        assert "error" not in params, params.get("error")
        assert len(params) > 10
        worst = max((value - reference[name]).abs().max().item() for name, value in params.items())
        assert worst <= 1e-5, (rank, worst)


def test_zero_bubble_schedules_are_refused_with_the_reason() -> None:
    results = spawn_ranks(4, _multi_stage_worker, "ScheduleZBVZeroBubble")
    errors = [r.get("error", "") for r in results]
    refused = [e for e in errors if "ScheduleZBVZeroBubble splits backward" in e]
    assert len(refused) >= 2, errors  # the first stage's data-parallel ranks, at once
    assert all("ScheduleGPipe, Schedule1F1B" in e for e in refused)
    assert all(e for e in errors)  # no rank trained on
