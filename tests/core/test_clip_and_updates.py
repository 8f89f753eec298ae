"""Global gradient clipping, and weights changed outside the optimizer.

Oracles: ``torch.nn.utils.clip_grad_norm_`` on the plain model with the global batch
(relative tolerance 1e-6 on the norm, 1e-6 absolute on the clipped gradients), and the
plain model's forward with the same weights.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from dist_harness import MICRO, SEQ, VOCAB, Scenario, make_model, spawn_ranks

import dmuon

ACCUM = 2
MAX_NORM = 0.05


def _batch(world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (world * ACCUM * MICRO, SEQ + 1), generator=gen)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens[:, :-1], tokens[:, 1:])


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as a full tensor on every rank (dedicated ones from their owners)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dedicated = {dp.fqn: dp for dp in dmuon.dedicated_parameters(model)}
    grads = {}
    for name, param in model.named_parameters():
        if name in dedicated:
            dp = dedicated[name]
            full = param._reduced_grad.clone() if dp.is_owned else torch.empty(dp.shape)
            dist.broadcast(full, src=dp.owner)
            grads[name] = full
        elif isinstance(param.grad, DTensor):
            grads[name] = param.grad.full_tensor()
        else:
            grads[name] = param.grad.clone()
    return grads


def _clip_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results: dict[str, Any] = {}
    mesh = init_device_mesh("cpu", (world,))
    for mode in ("z2", "z3"):
        for norm_type in (2.0, math.inf):
            model = make_model(Scenario("clip"))
            dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            mine = _batch(world).chunk(world)[rank]
            for micro, chunk in enumerate(mine.chunk(ACCUM)):
                with dmuon.no_sync(model) if micro + 1 < ACCUM else nullcontext():
                    (_loss(model, chunk) / ACCUM).backward()
            total = dmuon.clip_grad_norm_(model, MAX_NORM, norm_type=norm_type)
            results[f"{mode}-{norm_type}"] = {"total": total.item(), "grads": _full_grads(model)}
    # error_if_nonfinite: a NaN on one rank's gradient stops every rank alike.
    model = make_model(Scenario("nan"))
    dmuon.dedicate_params(model, mesh)
    _loss(model, _batch(world).chunk(world)[rank]).backward()
    owned = [dp for dp in dmuon.dedicated_parameters(model) if dp.is_owned]
    if rank == 0:
        owned[0].param._reduced_grad[0, 0] = float("nan")
    try:
        dmuon.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
        results["nan"] = "no error"
    except RuntimeError as exc:
        results["nan"] = str(exc)
    # model.load_state_dict on every rank (non-owners receive full tensors too).
    for mode in ("z2", "z3"):
        model = make_model(Scenario("load"))
        dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
        with torch.no_grad():
            _loss(model, _batch(world))  # Z2: the buffers are now resident
        model.load_state_dict(_other_weights())
        with torch.no_grad():
            results[f"load-{mode}"] = _loss(model, _batch(world)).item()
    return results


def _other_weights() -> dict[str, torch.Tensor]:
    """The scenario model's weights, each moved by a fixed random amount."""
    gen = torch.Generator().manual_seed(99)
    return {
        name: value + 0.1 * torch.randn(value.shape, generator=gen)
        for name, value in make_model(Scenario("other")).state_dict().items()
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    results = spawn_ranks(2, _clip_worker)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results


@pytest.mark.parametrize("mode", ["z2", "z3"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_matches_torch_on_the_global_batch(two_ranks, mode: str, norm_type: float) -> None:
    model = make_model(Scenario("clip"))
    _loss(model, _batch(2)).backward()
    expected_total = torch.nn.utils.clip_grad_norm_(
        model.parameters(), MAX_NORM, norm_type=norm_type
    ).item()
    assert expected_total > MAX_NORM  # clipping really happened
    for rank, result in enumerate(two_ranks):
        got = result[f"{mode}-{norm_type}"]
        assert got["total"] == pytest.approx(expected_total, rel=1e-6), f"rank {rank}"
        for name, param in model.named_parameters():
            diff = (got["grads"][name] - param.grad).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} {name}: {diff:.3g}"


def test_nonfinite_norm_raises_on_every_rank(two_ranks) -> None:
    messages = [result["nan"] for result in two_ranks]
    assert all("gradients is non-finite" in m for m in messages), messages
    assert messages[0] == messages[1]


@pytest.mark.parametrize("mode", ["z2", "z3"])
def test_load_state_dict_reaches_every_rank(two_ranks, mode: str) -> None:
    model = make_model(Scenario("load"))
    model.load_state_dict(_other_weights())
    with torch.no_grad():
        expected = _loss(model, _batch(2)).item()
    for rank, result in enumerate(two_ranks):
        assert result[f"load-{mode}"] == pytest.approx(expected, abs=1e-6), f"rank {rank}"


def test_grad_norm_is_the_clip_norm_single_process() -> None:
    model, plain = make_model(Scenario("a")), make_model(Scenario("a"))
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model)
    _loss(model, _batch(1)).backward()
    _loss(plain, _batch(1)).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()
    assert optimizer.grad_norm() == pytest.approx(expected, rel=1e-6)
    assert dmuon.clip_grad_norm_(model, 1e9).item() == pytest.approx(expected, rel=1e-6)


def test_in_place_edit_in_one_process_reaches_the_forward_at_once() -> None:
    """In one process a boundary's masters are its buffer (`dmuon._ownership.aliasing`):
    an edit is what the next forward reads, as with the plain model."""
    model, plain = make_model(Scenario("edit")), make_model(Scenario("edit"))
    dmuon.dedicate_params(model, reshard_after_forward=False)
    tokens = _batch(1)
    with torch.no_grad():
        _loss(model, tokens)
        model.layers[0].attn.q_proj.weight.mul_(0.5)
        plain.layers[0].attn.q_proj.weight.mul_(0.5)
        assert _loss(model, tokens).item() == pytest.approx(_loss(plain, tokens).item(), abs=1e-6)


def test_in_place_edit_in_z2_is_caught_and_parameters_updated_fixes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the buffers are a copy (several ranks; here one process made to keep one), a
    resident Z2 buffer would go stale: the forward refuses until `parameters_updated`."""
    from dmuon._ownership import aliasing

    monkeypatch.setattr(aliasing, "qualifies", lambda flat: False)
    model, plain = make_model(Scenario("edit")), make_model(Scenario("edit"))
    dmuon.dedicate_params(model, reshard_after_forward=False)
    tokens = _batch(1)
    with torch.no_grad():
        _loss(model, tokens)  # buffers resident
        model.layers[0].attn.q_proj.weight.mul_(0.5)  # an EMA swap, say
        plain.layers[0].attn.q_proj.weight.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"layers\.0\.attn\.q_proj\.weight.*parameters_updated"):
        _loss(model, tokens)
    dmuon.parameters_updated(model)
    with torch.no_grad():
        assert _loss(model, tokens).item() == pytest.approx(_loss(plain, tokens).item(), abs=1e-6)


def test_optimizer_step_and_load_state_dict_refresh_z2_buffers() -> None:
    model, plain = make_model(Scenario("fresh")), make_model(Scenario("fresh"))
    dmuon.dedicate_params(model, reshard_after_forward=False)
    tokens = _batch(1)
    optimizer = dmuon.Muon(model)
    _loss(model, tokens).backward()
    optimizer.step()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert _loss(model, tokens).item() == pytest.approx(_loss(plain, tokens).item(), abs=1e-6)
        model.load_state_dict(_other_weights())
        plain.load_state_dict(_other_weights())
        assert _loss(model, tokens).item() == pytest.approx(_loss(plain, tokens).item(), abs=1e-6)
