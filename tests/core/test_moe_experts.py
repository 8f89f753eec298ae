"""Fused 3-D expert stacks (transformers' Mixtral and Qwen2-MoE) trained with DMuon.

The distributed runs (gloo, 2 and 3 ranks, Z2 and Z3, accumulation 2 under `no_sync`,
FSDP2 on the decoder layers, with and without splitting ``gate_up_proj`` into gate and up)
are compared with a one-process reference on the global batch that applies Muon by hand:
a loop over the experts of every stack calling ``dmuon.newton_schulz`` on each 2-D
matrix (or on each half of it), and ``torch.optim.AdamW`` for everything else. Tolerance
1e-5 absolute per parameter. Micro-batches of one short sequence leave experts without
tokens on some ranks, which the runs count.

The one-process checks compare the default selection with the parameter names written
out, and the user errors with their documented texts.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
from dist_harness import full_parameters, run_in_order, spawn_ranks
from hf_models import config_of
from torch import nn
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_map_only

import dmuon

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, ACCUM, STEPS = 64, 6, 1, 2, 2
LR, ADAMW_LR, ADAMW_WD = 0.02, 3e-3, 0.01
TOLERANCE = 1e-5


def tiny_mixtral() -> nn.Module:
    torch.manual_seed(11)
    return transformers.MixtralForCausalLM(config_of("mixtral", vocab=VOCAB))


def tiny_qwen2_moe() -> nn.Module:
    torch.manual_seed(12)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2MoeForCausalLM(config)


MODELS = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe}

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def expected_muon_names(kind: str) -> set[str]:
    """The default selection, written out: attention, expert stacks, shared expert."""
    names = set()
    for i in range(2):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.self_attn.{m}.weight" for m in ATTENTION}
        names |= {f"{layer}.mlp.experts.gate_up_proj", f"{layer}.mlp.experts.down_proj"}
        if kind == "qwen2_moe":
            names |= {f"{layer}.mlp.shared_expert.{m}.weight" for m in ("gate_proj", "up_proj")}
            names.add(f"{layer}.mlp.shared_expert.down_proj.weight")
    return names


# ----- one process ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_default_selection_takes_expert_stacks_and_leaves_routers(kind: str) -> None:
    model = MODELS[kind]()
    owners = dmuon.dedicate_params(model)
    assert set(owners) == expected_muon_names(kind)
    stacks = {dp.fqn: dp for dp in dmuon.dedicated_parameters(model) if dp.is_stack}
    gate_up = stacks["model.layers.0.mlp.experts.gate_up_proj"]
    down = stacks["model.layers.0.mlp.experts.down_proj"]
    hidden = 48 if kind == "mixtral" else 24
    assert tuple(gate_up.shape) == (4, 2 * hidden, 32) and gate_up.out_in_shape == (2 * hidden, 32)
    assert tuple(down.shape) == (4, 32, hidden) and down.out_in_shape == (32, hidden)
    assert (gate_up.fused_parts, down.fused_parts) == (2, 1)
    assert dmuon.Muon(model).split_sizes == {}  # whole by default
    assert dmuon.Muon(model, split="auto").split_sizes == {
        f"model.layers.{i}.mlp.experts.gate_up_proj": (hidden, hidden) for i in range(2)
    }
    # The plan holds each stack as one item costing experts x one matrix's cost (one
    # iteration's multiply-adds, 2 m² n + m³ with m the short side).
    plan = dmuon.owner_plan(model)
    shapes = {dp.fqn: tuple(dp.shape) for dp in dmuon.dedicated_parameters(model)}
    assert plan == dmuon.plan_owners(shapes, 1)
    assert plan.loads[0] == sum(
        (s[0] if len(s) == 3 else 1) * (2 * min(s[-2:]) ** 2 * max(s[-2:]) + min(s[-2:]) ** 3)
        for s in shapes.values()
    )


def test_plan_gives_a_stack_one_owner() -> None:
    """Unless split by experts (forbidden here; see test_moe_split), a stack is one item."""
    shapes = {"experts": (8, 64, 32), "a": (32, 32), "b": (32, 32)}
    plan = dmuon.plan_owners(shapes, 2, split_expert_stacks=False)
    assert plan.owners["experts"] != plan.owners["a"] == plan.owners["b"]
    assert sorted(plan.loads) == [2 * 3 * 32**3, 8 * (2 * 32**2 * 64 + 32**3)]


class FourD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].kernel = nn.Parameter(torch.zeros(2, 3, 4, 5))


def test_four_dimensional_selection_is_refused() -> None:
    with pytest.raises(ValueError, match="2-D matrices, or 3-D stacks"):
        dmuon.dedicate_params(FourD(), predicate=lambda n, p: True)


def test_split_errors_name_the_problem() -> None:
    model = tiny_mixtral()
    dmuon.dedicate_params(model)
    with pytest.raises(ValueError, match=r"split patterns \['qkv_proj'\] match no dedicated"):
        dmuon.Muon(model, split={"qkv_proj": 3})
    with pytest.raises(ValueError, match="5 equal parts do not divide 96"):
        dmuon.Muon(model, split={"gate_up_proj": 5})
    with pytest.raises(ValueError, match=r"must be positive integers summing to 96"):
        dmuon.Muon(model, split={"gate_up_proj": (48, 40)})
    with pytest.raises(ValueError, match="all match"):
        dmuon.Muon(model, split={"gate_up_proj": 2, "*.experts.*": 2})
    with pytest.raises(ValueError, match='split must be "auto", "per_head", None'):
        dmuon.Muon(model, split="yes")
    assert dmuon.Muon(model, split=None).split_sizes == {}


def test_split_conv1d_qkv_matches_three_separate_matrices() -> None:
    """GPT-2's fused c_attn (stored (in, 3 x out)): split=3 is q, k and v on their own."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0
    )
    config.embd_pdrop = config.attn_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config)
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(model.state_dict())
    dmuon.dedicate_params(model)
    lr = 0.05
    opt = dmuon.Muon(model, lr=lr, ns_dtype=torch.float32, split={"c_attn": 3})
    assert opt.split_sizes == {"transformer.h.0.attn.c_attn.weight": (32, 32, 32)}
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens, labels=tokens).loss.backward()
    plain(tokens, labels=tokens).loss.backward()
    weight = dict(plain.named_parameters())["transformer.h.0.attn.c_attn.weight"]
    expected = weight.detach().clone()
    update = weight.grad.lerp(weight.grad * 0.05, 0.95)  # Nesterov on a fresh buffer
    for k in range(3):
        part = update[:, 32 * k : 32 * (k + 1)]
        ortho = dmuon.newton_schulz(part, 5, "polar_express", dtype=torch.float32)
        expected[:, 32 * k : 32 * (k + 1)] -= lr * 0.2 * 32**0.5 * ortho
    opt.step()
    got = dict(model.named_parameters())["transformer.h.0.attn.c_attn.weight"]
    assert (got - expected).abs().max().item() < 1e-6


# ----- distributed ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MoECase:
    """One distributed configuration."""

    kind: str
    mode: str
    split: bool
    checkpoint: bool = False
    #: The rest of the model under ``fully_shard`` (``"fsdp"``) or DDP (``"ddp"``).
    layout: str = "fsdp"

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.mode}-{'split' if self.split else 'whole'}-{self.layout}"


#: Each model in Z2 and Z3, each with gate_up_proj whole once and split once.
WORLDS = {
    2: [
        MoECase("mixtral", "z2", False, checkpoint=True),
        MoECase("mixtral", "z3", True),
        MoECase("qwen2_moe", "z2", True),
        MoECase("qwen2_moe", "z3", False),
        MoECase("qwen2_moe", "z3", True, layout="ddp"),
    ],
    3: [
        MoECase("mixtral", "z2", True, checkpoint=True),
        MoECase("mixtral", "z2", False, layout="ddp"),
    ],
}


def global_batch(step: int, world: int) -> torch.Tensor:
    """Tokens of one optimizer step: world x ACCUM x MICRO sequences of SEQ + 1."""
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, VOCAB, (world * ACCUM * MICRO, SEQ + 1), generator=gen)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def dedicate_and_shard(
    model: nn.Module,
    mesh: Any,
    z3: bool,
    split_expert_stacks: bool | str = "auto",
    split: str | None = None,
) -> dmuon.Muon:
    """The three-line integration on a transformers MoE model: dedicate, FSDP2 on every
    decoder layer and the root, and `dmuon.Muon` with float32 Newton-Schulz."""
    from torch.distributed.fsdp import fully_shard

    dmuon.dedicate_params(
        model, mesh, reshard_after_forward=z3, split_expert_stacks=split_expert_stacks
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=z3)
    fully_shard(model, mesh=mesh, reshard_after_forward=z3)
    model.set_reduce_scatter_unused_params(True)
    return dmuon.Muon(
        model,
        lr=LR,
        ns_dtype=torch.float32,
        adamw_lr=ADAMW_LR,
        adamw_weight_decay=ADAMW_WD,
        split=split,
    )


def _build(case: MoECase, world: int) -> tuple[nn.Module, dmuon.Muon]:
    """The case's model (its DDP wrapper under DDP) and optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    model = MODELS[case.kind]()
    mesh = init_device_mesh("cpu", (world,))
    split = "auto" if case.split else None
    if case.layout == "ddp":
        dmuon.dedicate_params(model, mesh, reshard_after_forward=case.mode == "z3")
        # Routers and gates of idle experts get no gradient on some ranks.
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        optimizer = dmuon.Muon(
            ddp,
            lr=LR,
            ns_dtype=torch.float32,
            adamw_lr=ADAMW_LR,
            adamw_weight_decay=ADAMW_WD,
            split=split,
        )
        return ddp, optimizer
    return model, dedicate_and_shard(model, mesh, case.mode == "z3", split=split)


def _step(model: nn.Module, optimizer: dmuon.Muon, step: int, rank: int, world: int) -> float:
    """One optimizer step of ACCUM micro-batches (no_sync between); returns the grad norm."""
    mine = global_batch(step, world).chunk(world)[rank]
    for micro, tokens in enumerate(mine.chunk(ACCUM)):
        accumulating = micro + 1 < ACCUM
        with dmuon.no_sync(model) if accumulating else nullcontext():
            (_loss(model, tokens) / ACCUM).backward()
    norm = optimizer.grad_norm()
    optimizer.step()
    optimizer.zero_grad()
    return norm


STACK = "model.layers.0.mlp.experts.gate_up_proj"


def _checkpoint_round_trip(
    case: MoECase, world: int, rank: int, model: nn.Module, optimizer: dmuon.Muon
) -> dict[str, Any]:
    """Save the trained state, load it into a fresh model, take one more step on both."""
    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    stack = model_sd[STACK]
    index = [dp.fqn for dp in dmuon.dedicated_parameters(model)].index(STACK)
    momentum = optim_sd["state"][STACK]["momentum_buffer"]
    layout = {
        "type": type(stack).__name__,
        "placements": tuple(stack.placements),
        "shape": tuple(stack.shape),
        "local_rows": stack.to_local().shape[0],
        "momentum_type": type(momentum).__name__,
        "full": stack.full_tensor().detach().clone(),
        "owner": dmuon.dedicated_parameters(model)[index].owner,
    }
    fresh, fresh_optimizer = _build(case, world)
    # Copies, as a save and load would make: the state dicts alias the live FSDP2 state.
    model_sd, optim_sd = tree_map_only(
        torch.Tensor, lambda t: t.detach().clone(), (model_sd, optim_sd)
    )
    dmuon.set_state_dict(
        fresh, fresh_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    _step(model, optimizer, STEPS, rank, world)
    _step(fresh, fresh_optimizer, STEPS, rank, world)
    ours, theirs = full_parameters(model), full_parameters(fresh)
    layout["resume_diff"] = max((ours[n] - theirs[n]).abs().max().item() for n in ours)
    return layout


def _train(rank: int, world: int, case: MoECase) -> dict[str, Any]:
    model, optimizer = _build(case, world)
    idle = 0

    def count_idle(_module: nn.Module, args: tuple[Any, ...]) -> None:
        nonlocal idle
        idle += int(args[1].unique().numel() < 4)  # top_k_index: experts with tokens

    inner = model.module if case.layout == "ddp" else model
    for layer in inner.model.layers:
        layer.mlp.experts.register_forward_pre_hook(count_idle)
    norms, units = [], []
    for step in range(STEPS):
        norms.append(_step(model, optimizer, step, rank, world))
        units.append(dmuon.comm_audit(model).last_step().units)
    result = {
        "params": full_parameters(inner),
        "norms": norms,
        "units": units,
        "idle": idle,
        "dedicated": sorted(dp.fqn for dp in dmuon.dedicated_parameters(model)),
        "split": dict(optimizer.split_sizes),
    }
    if case.checkpoint:
        result["checkpoint"] = _checkpoint_round_trip(case, world, rank, model, optimizer)
    return result


def _run_cases(rank: int, world: int, cases: list[MoECase]) -> dict[str, Any]:
    return run_in_order((case.name, partial(_train, rank, world, case)) for case in cases)


@pytest.fixture(scope="module")
def moe_results() -> dict[int, list[dict[str, Any]]]:
    return {world: spawn_ranks(world, _run_cases, cases) for world, cases in WORLDS.items()}


def _by_hand(model: nn.Module, muon: set[str], split: bool, world: int) -> dict[str, Any]:
    """One process, global batch: Muon per expert matrix written out, AdamW for the rest."""
    params = dict(model.named_parameters())
    adamw = torch.optim.AdamW(
        [p for n, p in params.items() if n not in muon], lr=ADAMW_LR, weight_decay=ADAMW_WD
    )
    momentum = {n: torch.zeros_like(params[n]) for n in muon}
    norms = []
    for step in range(STEPS):
        _loss(model, global_batch(step, world)).backward()
        grads = [p.grad for p in params.values() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item())
        with torch.no_grad():
            for name in sorted(muon):
                p = params[name]
                momentum[name].lerp_(p.grad, 1 - 0.95)
                update = p.grad.lerp(momentum[name], 0.95)
                for e in range(p.shape[0] if p.dim() == 3 else 1):
                    target = p[e] if p.dim() == 3 else p
                    matrix = update[e] if p.dim() == 3 else update
                    halves = 2 if split and name.endswith("gate_up_proj") else 1
                    rows = matrix.shape[0] // halves
                    for h in range(halves):
                        part = matrix[h * rows : (h + 1) * rows]
                        ortho = dmuon.newton_schulz(part, 5, "polar_express", dtype=torch.float32)
                        scale = 0.2 * max(part.shape) ** 0.5
                        target[h * rows : (h + 1) * rows].sub_(LR * scale * ortho)
                p.grad = None
        adamw.step()
        adamw.zero_grad()
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "norms": norms}


PARAMS = [(world, case) for world, cases in WORLDS.items() for case in cases]


@pytest.mark.parametrize(("world", "case"), PARAMS, ids=[f"{w}-{c.name}" for w, c in PARAMS])
def test_expert_stacks_match_per_expert_newton_schulz(
    moe_results, world: int, case: MoECase
) -> None:
    per_rank = []
    for rank, result in enumerate(moe_results[world]):
        assert case.name in result, f"rank {rank}: {case.name} did not run (an earlier case failed)"
        assert "error" not in result[case.name], f"rank {rank}:\n{result[case.name]['error']}"
        per_rank.append(result[case.name])
    muon = expected_muon_names(case.kind)
    assert per_rank[0]["dedicated"] == sorted(muon)
    assert bool(per_rank[0]["split"]) == case.split
    initial = dict(MODELS[case.kind]().named_parameters())
    reference = _by_hand(MODELS[case.kind](), muon, case.split, world)
    assert sum(result["idle"] for result in per_rank) > 0, "every expert saw tokens everywhere"
    expected_units = 2.0 if case.mode == "z2" else 2 * ACCUM + 1.0
    for rank, result in enumerate(per_rank):
        assert result["units"] == [pytest.approx(expected_units)] * STEPS
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        for name, expected in reference["params"].items():
            diff = (result["params"][name] - expected).abs().max().item()
            assert diff <= TOLERANCE, f"rank {rank} {name}: max |diff| {diff:.3g}"
    for name in muon:  # every dedicated tensor moved, so a skipped one would show
        moved = (reference["params"][name] - initial[name]).abs().max().item()
        assert moved > 1e-3, name


CHECKPOINTED = [(world, case) for world, case in PARAMS if case.checkpoint]


@pytest.mark.parametrize(
    ("world", "case"), CHECKPOINTED, ids=[f"{w}-{c.name}" for w, c in CHECKPOINTED]
)
def test_a_stack_round_trips_through_the_state_dict(moe_results, world: int, case: MoECase) -> None:
    """A stack is saved as a Shard(0) DTensor over its experts and resumes exactly."""
    per_rank = [result[case.name] for result in moe_results[world]]
    for rank, result in enumerate(per_rank):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
        saved = result["checkpoint"]
        assert (saved["type"], saved["placements"]) == ("DTensor", (Shard(0),))
        assert saved["momentum_type"] == "DTensor"
        assert saved["shape"] == (4, 96, 32)
        assert torch.equal(saved["full"], result["params"][STACK])
        assert saved["resume_diff"] == 0.0, f"rank {rank}: resumed run differs"
    rows = [result["checkpoint"]["local_rows"] for result in per_rank]
    assert sum(rows) == 4 and max(rows) < 4, rows  # the experts spread over the ranks
