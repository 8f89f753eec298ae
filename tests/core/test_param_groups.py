"""`dmuon.Muon(param_groups=...)`: per-group hyperparameters for both algorithms.

Oracles: ``torch.optim.AdamW`` with the same groups (bit for bit), Muon written out per
group (float32 Newton-Schulz; 1e-6 absolute), ``LambdaLR``'s per-group factors, and a run
resumed through DCP at another world size (2 ranks saved, 1 rank loaded: the groups'
settings come back and the continuation equals the uninterrupted run within 1e-5).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_harness import MICRO, SEQ, VOCAB, Scenario, full_parameters, make_model, spawn_ranks
from torch import nn

import dmuon

NO_DECAY_LR = 0.05


def tokens(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch[:, :-1], batch[:, 1:])


def user_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Three groups: layer 0's matrices at another Muon rate and momentum, the rest of the
    split from `weight_decay_groups` (no decay on norms, biases and the embedding)."""
    decay, no_decay = dmuon.weight_decay_groups(model)
    first = {id(p) for p in model.layers[0].parameters() if p.ndim >= 2 or p.numel() == 0}
    first_dedicated = [p for p in decay["params"] if id(p) in first]
    decay["params"] = [p for p in decay["params"] if id(p) not in first]
    no_decay["adamw_lr"] = NO_DECAY_LR
    return [
        {"name": "layer0", "params": first_dedicated, "lr": 0.05, "momentum": 0.9},
        decay,
        no_decay,
    ]


def test_groups_layout_and_the_decay_split() -> None:
    model = make_model(Scenario("groups"))
    dmuon.dedicate_params(model)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, param_groups=user_groups(model))
    layout = [(g["name"], g["algorithm"], len(g["params"])) for g in opt.param_groups]
    # layer 0: 7 matrices (its o_proj bias is 1-D: no_decay); decay: layer 1's 7 matrices
    # and lm_head; no_decay: embedding, 5 norms, 2 biases.
    assert layout == [
        ("layer0", "muon", 7),
        ("decay", "muon", 7),
        ("decay", "adamw", 1),
        ("no_decay", "adamw", 8),
    ]
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = opt.param_groups[3]
    assert sorted(names[id(p)] for p in no_decay["params"]) == sorted(
        ["embed.weight", "norm.weight", "layers.0.attn.o_proj.bias", "layers.1.attn.o_proj.bias"]
        + [f"layers.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")]
    )
    assert (no_decay["weight_decay"], no_decay["lr"]) == (0.0, NO_DECAY_LR)
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["momentum"] == 0.9
    assert opt.param_groups[1]["lr"] == 0.02 and opt.param_groups[2]["lr"] == 1e-3


def test_adamw_parts_equal_torch_adamw_with_the_same_groups_bit_for_bit() -> None:
    model = make_model(Scenario("groups"))
    plain = make_model(Scenario("groups"))
    dmuon.dedicate_params(model)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, param_groups=user_groups(model))
    by_name = dict(plain.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    torch_groups = [
        {
            "params": [by_name[names[id(p)]] for p in g["params"]],
            "lr": g["lr"],
            "betas": g["betas"],
            "eps": g["eps"],
            "weight_decay": g["weight_decay"],
        }
        for g in opt.param_groups
        if g["algorithm"] == "adamw"
    ]
    reference = torch.optim.AdamW(torch_groups)
    own = dict(model.named_parameters())
    for step in range(3):
        loss_of(model, tokens(step)).backward()
        for group in torch_groups:  # the same gradients (the matrices move under Muon)
            for p in group["params"]:
                name = next(n for n, q in by_name.items() if q is p)
                p.grad = own[name].grad.clone()
        opt.step()
        reference.step()
        opt.zero_grad()
        reference.zero_grad()
    got = dict(model.named_parameters())
    for group in torch_groups:
        for p in group["params"]:
            name = next(n for n, q in by_name.items() if q is p)
            assert torch.equal(got[name], p), name


def test_muon_parts_use_their_own_hyperparameters() -> None:
    model = make_model(Scenario("groups"))
    plain = make_model(Scenario("groups"))
    dmuon.dedicate_params(model)
    groups = user_groups(model)
    opt = dmuon.Muon(model, lr=0.02, ns_dtype=torch.float32, param_groups=groups)
    batch = tokens(9)
    loss_of(model, batch).backward()
    loss_of(plain, batch).backward()
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    opt.step()
    got = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        if not name.startswith("layers.") or p.ndim != 2:
            continue
        lr, momentum = (0.05, 0.9) if name.startswith("layers.0.") else (0.02, 0.95)
        update = p.grad.lerp(p.grad * (1 - momentum), momentum)  # Nesterov, fresh buffer
        ortho = dmuon.newton_schulz(update, 5, dtype=torch.float32)
        expected = before[name] - lr * 0.2 * max(p.shape) ** 0.5 * ortho
        assert (got[name] - expected).abs().max().item() <= 1e-6, name


def test_lambda_lr_drives_each_group() -> None:
    model = make_model(Scenario("groups"))
    dmuon.dedicate_params(model)
    opt = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, param_groups=user_groups(model))
    factors = [lambda s: 0.5**s, lambda s: 1.0, lambda s: 0.1 * (s + 1), lambda s: 2.0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factors)
    base = scheduler.base_lrs
    for step in range(1, 3):
        loss_of(model, tokens(step)).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(
            [b * f(step) for b, f in zip(base, factors, strict=True)]
        )


def test_state_dict_round_trip_keeps_the_groups() -> None:
    model = make_model(Scenario("groups"))
    dmuon.dedicate_params(model)
    opt = dmuon.Muon(model, param_groups=user_groups(model))
    loss_of(model, tokens(1)).backward()
    opt.step()
    saved = opt.state_dict()
    other = make_model(Scenario("groups"))
    dmuon.dedicate_params(other)
    fresh = dmuon.Muon(other, lr=0.9, param_groups=user_groups(other))
    fresh.load_state_dict(saved)
    keys = ("name", "algorithm", "lr", "momentum", "weight_decay")
    assert [tuple(g.get(k) for k in keys) for g in fresh.param_groups] == [
        tuple(g.get(k) for k in keys) for g in opt.param_groups
    ]


def test_user_errors_in_groups() -> None:
    model = make_model(Scenario("groups"))
    model.embed.weight.requires_grad_(False)
    dmuon.dedicate_params(model)
    q = model.layers[0].attn.q_proj.weight
    cases = [
        ([{"params": [q]}, {"params": [q]}], "in param_groups[0] and param_groups[1]"),
        ([{"params": [q], "learning_rate": 1}], "unknown keys ['learning_rate']"),
        ([{"params": [model.embed.weight]}], "frozen parameter 'embed.weight'"),
        ([{"params": [nn.Parameter(torch.ones(3))]}], "not one of the model's parameters"),
        ([{"lr": 0.1}], "needs 'params'"),
        ([{"params": [q], "lr": -1.0}], "param group None (muon): lr must be"),
        ([{"params": [model.norm.weight], "adamw_betas": (0.9,)}], "adamw_betas must be"),
        (["not a dict"], "must be a dict"),
    ]
    for groups, message in cases:
        with pytest.raises(ValueError, match=None) as exc:
            dmuon.Muon(model, param_groups=groups)
        assert message in str(exc.value), (message, str(exc.value))


# ----- across world sizes ----------------------------------------------------------------
STEPS, MORE = 2, 2


def _batch(step: int) -> torch.Tensor:
    return tokens(700 + step, 2 * MICRO * 2)


def _train_groups(rank: int, world: int, root: str, load: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("groups"))
    dmuon.dedicate_params(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(
        model, lr=0.9 if load else 0.02, ns_dtype=torch.float32, param_groups=user_groups(model)
    )

    def steps(which: range) -> None:
        for step in which:
            loss_of(model, _batch(step).chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()

    path = os.path.join(root, "groups")
    if load:
        model_sd, optim_sd = dmuon.get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        dmuon.set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        steps(range(STEPS))
        model_sd, optim_sd = dmuon.get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    groups = [(g["name"], g["algorithm"], g["lr"], g.get("momentum")) for g in opt.param_groups]
    steps(range(STEPS, STEPS + MORE))
    return {"groups": groups, "final": full_parameters(model)}


def test_groups_survive_dcp_at_another_world_size(tmp_path) -> None:
    saved = spawn_ranks(2, _train_groups, str(tmp_path), False)
    loaded = spawn_ranks(1, _train_groups, str(tmp_path), True)
    for result in saved + loaded:
        assert "error" not in result, result.get("error")
    assert loaded[0]["groups"] == saved[0]["groups"]
    for name, value in saved[0]["final"].items():
        diff = (loaded[0]["final"][name] - value).abs().max().item()
        assert diff <= 1e-5, f"{name}: {diff:.3g}"
