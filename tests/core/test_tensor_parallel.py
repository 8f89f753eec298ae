"""FSDP2 + tensor parallelism (2-D) with DMuon, on 4 gloo ranks as (dp, tp) = (2, 2).

The order users write: ``parallelize_module(model, mesh["tp"], plan)`` with torch's
ColwiseParallel / RowwiseParallel (and SequenceParallel norms in the second model), then
``dmuon.dedicate_params(model, mesh["dp"])``, ``fully_shard(..., mesh=mesh["dp"])``,
``dmuon.Muon(model)``.

Oracles: one process training the plain model on the global batch, with Muon written out
(float32 Newton-Schulz on the whole matrices) and torch.optim.AdamW: 1e-5 absolute per
parameter; the traffic formulas per mesh dimension (dp: Z2 2 units, Z3 2k + 1; tp: 2
units of the whole matrices per step over the dp ranks); the same collectives, in the same
order and of the same sizes, on every rank; and a DCP checkpoint saved at (2, 2) that
resumes at (4, 1) and at one process to the uninterrupted run's weights (1e-5).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from collectives import recorded_collectives
from dist_harness import reference_train, run_in_order, spawn_ranks
from hf_models import config_of
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

import dmuon

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, STEPS, ACCUM = 64, 8, 2, 2, 2
LR, ADAMW_LR = 0.02, 3e-3
FULL = StateDictOptions(full_state_dict=True)


def hf_llama() -> nn.Module:
    torch.manual_seed(21)
    return transformers.LlamaForCausalLM(config_of("llama", vocab=VOCAB, positions=32))


def hf_plan(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        plan[f"model.layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"model.layers.{i}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.up_proj"] = ColwiseParallel()
        plan[f"model.layers.{i}.mlp.down_proj"] = RowwiseParallel()
    return plan


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    """Causal attention whose head count follows the projections' (local) width."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, 8)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class SequenceParallelLM(nn.Module):
    """A small decoder written so a sequence-parallel plan applies (torchtitan's layout)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(22)
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(2))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def sp_plan(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    gather = partial(
        PrepareModuleInput, input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    for i in range(len(model.layers)):
        plan[f"layers.{i}.attn_norm"] = SequenceParallel()
        plan[f"layers.{i}.mlp_norm"] = SequenceParallel()
        plan[f"layers.{i}.attn"] = gather()
        plan[f"layers.{i}.mlp"] = gather()
        for name in ("attn.q", "attn.k", "attn.v", "mlp.up"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attn.o"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"layers.{i}.mlp.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


MODELS = {"hf_llama": (hf_llama, hf_plan), "sequence_parallel": (SequenceParallelLM, sp_plan)}


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model, tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def global_batch(step: int) -> torch.Tensor:
    """The batch of step ``step``, the same at every layout (split over dp and micro-batches)."""
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randint(0, VOCAB, (4 * ACCUM * MICRO, SEQ + 1), generator=gen)


def build(kind: str, shape: tuple[int, int], mode: str) -> tuple[nn.Module, dmuon.Muon, Any]:
    """The model on a (dp, tp) mesh: TP plan, dedication, FSDP2 per layer, Muon."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    make, plan = MODELS[kind]
    model = make()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    if shape[1] > 1:
        parallelize_module(model, mesh["tp"], plan(model))
    z3 = mode == "z3"
    dmuon.dedicate_params(model, mesh["dp"], reshard_after_forward=z3)
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=z3)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=z3)
    optimizer = dmuon.Muon(
        model, lr=LR, ns_dtype=torch.float32, adamw_lr=ADAMW_LR, adamw_weight_decay=0.01
    )
    return model, optimizer, mesh


def train_steps(
    model: nn.Module,
    optimizer: dmuon.Muon,
    mesh: Any,
    steps: range,
    flops: list[int] | None = None,
) -> list[Any]:
    """Train ``steps``; the collectives each issued, and in ``flops`` what
    `FlopCounterMode` counted inside each ``optimizer.step()``."""
    from torch.utils.flop_counter import FlopCounterMode

    dp = mesh["dp"].size()
    dp_rank = mesh["dp"].get_local_rank()
    issued = []
    for step in steps:
        mine = global_batch(step).chunk(dp)[dp_rank]
        with recorded_collectives() as seen:
            for micro, chunk in enumerate(mine.chunk(ACCUM)):
                with dmuon.no_sync(model) if micro + 1 < ACCUM else nullcontext():
                    (loss_of(model, chunk) / ACCUM).backward()
            with FlopCounterMode(display=False) as counter:
                optimizer.step()
            if flops is not None:
                flops.append(counter.get_total_flops())
        optimizer.zero_grad()
        issued.append(seen)
    return issued


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone() for k, v in dmuon.get_model_state_dict(model, options=FULL).items()
    }


def ns_split_refusal(kind: str) -> dict[str, Any]:
    """``dedicate_params(ns_split=2)`` on a tensor-parallel model: its message, and
    whether the model was left as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from dmuon._ownership.dedication_state import get_dedication

    make, plan = MODELS[kind]
    model = make()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan(model))
    before = dict(model.named_parameters())
    try:
        dmuon.dedicate_params(model, mesh["dp"], ns_split=2)
        message = "not refused"
    except ValueError as error:
        message = str(error)
    untouched = get_dedication(model) is None and all(
        p is before[n] for n, p in model.named_parameters()
    )
    return {"message": message, "untouched": untouched}


def run_case(kind: str, mode: str, rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model, optimizer, mesh = build(kind, (2, 2), mode)
    flops: list[int] = []
    issued = train_steps(model, optimizer, mesh, range(STEPS), flops)
    audit = dmuon.comm_audit(model).last_step().as_dict()
    result: dict[str, Any] = {
        "issued": issued,
        "audit": audit,
        "trained": full_weights(model),
        "step_flops": flops,
    }
    if mode == "z2":  # a checkpoint, then the uninterrupted run goes on
        model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, kind))
        train_steps(model, optimizer, mesh, range(STEPS, STEPS + 1))
        result["resumed_reference"] = full_weights(model)
    return result


def resume_case(kind: str, shape: tuple[int, int], rank: int, world: int, root: str) -> Any:
    import torch.distributed.checkpoint as dcp

    model, optimizer, mesh = build(kind, shape, "z2")
    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, kind))
    dmuon.set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train_steps(model, optimizer, mesh, range(STEPS, STEPS + 1))
    return full_weights(model)


CASES = [(kind, mode) for kind in MODELS for mode in ("z2", "z3")]


def _train_worker(rank: int, world: int, root: str) -> dict[Any, Any]:
    cases = [
        ((kind, mode), partial(run_case, kind, mode, rank, world, root)) for kind, mode in CASES
    ]
    refusal = ("ns_split", partial(ns_split_refusal, next(iter(MODELS))))
    return run_in_order([*cases, refusal])


def _resume_worker(rank: int, world: int, root: str, shape: tuple[int, int]) -> dict[Any, Any]:
    return run_in_order(
        (kind, partial(resume_case, kind, shape, rank, world, root)) for kind in MODELS
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("tp"))
    return {
        "trained": spawn_ranks(4, _train_worker, root),
        "(4, 1)": spawn_ranks(4, _resume_worker, root, (4, 1)),
        "(1, 1)": spawn_ranks(1, _resume_worker, root, (1, 1)),
    }


def _ok(per_rank: list[dict[Any, Any]], key: Any) -> list[Any]:
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        value = result[key]
        assert not (isinstance(value, dict) and "error" in value), f"rank {rank}:\n{value['error']}"
    return [result[key] for result in per_rank]


def reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    make, _ = MODELS[kind]
    model = make()
    names = {n for n, p in model.named_parameters() if dmuon.default_predicate(n, p)}
    names = {f"inner.{n}" for n in names if "lm_head" not in n and "embed" not in n}
    return reference_train(_Tokens(model), names, [global_batch(s) for s in range(steps)])


class _Tokens(nn.Module):
    """The plain model with the harness's ``model(inputs, targets) -> loss`` interface."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = logits_of(self.inner, inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _strip(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("inner."): v for k, v in params.items()}


def test_ns_split_with_tensor_parallelism_is_refused_and_changes_nothing(runs) -> None:
    for result in _ok(runs["trained"], "ns_split"):
        assert "does not combine with tensor parallelism" in result["message"], result
        assert "ns_split=1" in result["message"]
        assert result["untouched"]


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_tp_matches_one_process_on_the_global_batch(runs, kind: str, mode: str) -> None:
    expected = _strip(reference(kind, STEPS))
    make, _ = MODELS[kind]
    plain = make().state_dict()
    for rank, result in enumerate(_ok(runs["trained"], (kind, mode))):
        trained = result["trained"]
        assert sorted(trained) == sorted(plain), f"rank {rank}"
        assert {k: tuple(v.shape) for k, v in trained.items()} == {
            k: tuple(v.shape) for k, v in plain.items()
        }
        for name, value in expected.items():
            diff = (trained[name] - value).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {name}: {diff:.3g}"


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_tp_traffic_per_mesh_dimension(runs, kind: str, mode: str) -> None:
    per_rank = _ok(runs["trained"], (kind, mode))
    dp_units = 2.0 if mode == "z2" else 2 * ACCUM + 1.0
    for result in per_rank:
        dims = result["audit"]["dimensions"]
        assert dims["shard"]["units"] == pytest.approx(dp_units)
        assert set(dims["tensor"]["collectives"]) == {"gather", "scatter"}
    # Ranks 0 and 2 are tp position 0 of dp ranks 0 and 1: together they own everything.
    total = sum(per_rank[r]["audit"]["dimensions"]["tensor"]["units"] for r in (0, 2))
    assert total == pytest.approx(2.0)


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_tp_collectives_are_the_same_on_every_rank(runs, kind: str, mode: str) -> None:
    """Each process group's ranks issue the same collectives in the same order (counted
    independently of the audit, by `collectives.recorded_collectives`)."""
    per_rank = [result["issued"] for result in _ok(runs["trained"], (kind, mode))]
    assert all(steps[0] for steps in per_rank), "nothing was counted"
    for step in range(STEPS):
        by_group: dict[tuple[int, ...], dict[int, list[Any]]] = {}
        for rank, steps in enumerate(per_rank):
            for ranks, name, numel, root in steps[step]:
                by_group.setdefault(tuple(ranks), {}).setdefault(rank, []).append(
                    (name, numel, root)
                )
        for ranks, seqs in by_group.items():
            assert set(seqs) == set(ranks), f"step {step}: only {sorted(seqs)} of {ranks} issued"
            first = seqs[ranks[0]]
            assert all(seqs[r] == first for r in ranks), f"step {step}, group {ranks} differ"


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_the_cluster_plan_predicts_the_tp_audit_and_the_flops(runs, mode: str) -> None:
    """`dmuon.plan.plan_cluster` with ``tp=2`` and the Llama config's own tp plan, rank by
    rank against the 2 x 2 (dp, tp) runs: the dp group's broadcasts and reduces and the tp
    group's gathers and scatters (count and elements) equal what the comm audit recorded,
    and the Newton-Schulz FLOPs what `FlopCounterMode` counted in ``optimizer.step()``."""
    from dmuon.plan import plan_cluster

    plan = plan_cluster(
        hf_llama(),
        4,
        tp=2,
        mode=mode,
        accum=ACCUM,
        no_sync=True,
        ns_dtype=torch.float32,
        device_type="cpu",
    )

    def tallies(collectives: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return {kind: (t["count"], t["elements"]) for kind, t in collectives.items()}

    def predicted(by_kind: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return {kind: (t.count, t.elements) for kind, t in by_kind.items()}

    results = _ok(runs["trained"], ("hf_llama", mode))
    assert [r.rank for r in plan.ranks] == list(range(4))
    for rank, (result, expected) in enumerate(zip(results, plan.ranks, strict=True)):
        assert result["step_flops"] == [expected.ns_flops] * STEPS, rank
        audit = result["audit"]
        assert tallies(audit["collectives"]) == predicted(expected.shard_collectives), rank
        tensor = audit.get("dimensions", {}).get("tensor", {}).get("collectives", {})
        assert tallies(tensor) == predicted(expected.tensor_collectives), rank
    assert sum(r.ns_flops for r in plan.ranks) > 0


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("layout", ["(4, 1)", "(1, 1)"])
def test_tp_checkpoint_resumes_at_other_layouts(runs, kind: str, layout: str) -> None:
    expected = _ok(runs["trained"], (kind, "z2"))[0]["resumed_reference"]
    for rank, resumed in enumerate(_ok(runs[layout], kind)):
        for name, value in expected.items():
            diff = (resumed[name] - value).abs().max().item()
            assert diff <= 1e-5, f"{layout} rank {rank} {name}: {diff:.3g}"
