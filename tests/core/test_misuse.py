"""What users do that used to train silently wrong, on 2 gloo ranks and in one process.

Each case either matches its oracle or raises a clear error on every rank:

- ``model.zero_grad()`` (also with ``set_to_none=False``) clears dedicated gradients:
  three backwards of the same batch give the same gradient as autograd on the plain model;
- ``dmuon.Muon`` created before ``fully_shard`` raises at the first step;
- a dedicated matrix frozen after dedication (or at step 2) stays put, and one frozen at
  dedication and unfrozen later trains: against the one-process reference with the same
  freezing schedule;
- one, two and three forwards per backward, with and without accumulation: the dedicated
  gradients equal autograd's on the plain model;
- ``torch.nn.utils.clip_grad_norm_`` raises the same clear error on every rank;
- ``dmuon.no_sync`` on an inner module covers the whole model (Z3 at accumulation 2: 5
  units, not 6);
- a gradient of zeros is a gradient: momentum still acts, as in ``torch.optim.Muon``;
- ``step()`` after a window in which every backward ran under ``no_sync`` raises on every
  rank, naming the missing synchronised backward, before any weight changes;
- a loss computed through a module inside a hook boundary (``model.layers[0].mlp(x)``)
  raises at the step, naming the matrix and the boundary, before any weight changes.

Tolerances: 1e-6 absolute on gradients, 1e-5 on parameters after training (float32 sums
in another order).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import pytest
import torch
from dist_harness import (
    LR,
    MICRO,
    SEQ,
    VOCAB,
    Scenario,
    _loss,
    full_gradients,
    full_parameters,
    global_batch,
    make_model,
    reference_train,
    run_in_order,
    spawn_ranks,
)
from torch import nn

import dmuon
from dmuon._ownership.gradients import DedicatedGradientError

WORLD = 2
MUON_NAMES = {
    f"layers.{i}.{m}.weight"
    for i in range(2)
    for m in (
        *("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"),
        *("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    )
}


def tokens(seed: int, rows: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch[:, :-1], batch[:, 1:])


def sharded(rank: int, world: int, mode: str = "z3", optimizer: bool = True) -> Any:
    """The three-line integration on the test model: (model, optimizer or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("misuse"))
    dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not optimizer:
        return model, None
    return model, dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, adamw_lr=3e-3)


# ----- the cases, run on every rank ----------------------------------------------------------
def model_zero_grad(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    model, _ = sharded(rank, world)
    batch = tokens(1, world * MICRO).chunk(world)[rank]
    seen = []
    for round_ in range(3):
        loss_of(model, batch).backward()
        seen.append(full_gradients(model))
        model.zero_grad(set_to_none=round_ != 1)
    return seen


def optimizer_before_fully_shard(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("early"))
    dmuon.dedicate_params(model, mesh)
    optimizer = dmuon.Muon(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss_of(model, tokens(2, world * MICRO).chunk(world)[rank]).backward()
    try:
        optimizer.step()
    except ValueError as exc:
        return str(exc)
    return "no error"


FROZEN_AT_DEDICATION = "layers.1.mlp.up_proj.weight"
FROZEN_AFTER = "layers.0.attn.q_proj.weight"
FROZEN_AT_STEP_2 = "layers.0.mlp.down_proj.weight"


def freezing_schedule(step: int, model: nn.Module) -> None:
    """Step 2 unfreezes the matrix frozen at dedication and freezes another one."""
    if step == 2:
        model.get_parameter(FROZEN_AT_DEDICATION).requires_grad_(True)
        model.get_parameter(FROZEN_AT_STEP_2).requires_grad_(False)


def freezing(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(Scenario("freeze"))
    model.get_parameter(FROZEN_AT_DEDICATION).requires_grad_(False)
    dmuon.dedicate_params(model, mesh)
    model.get_parameter(FROZEN_AFTER).requires_grad_(False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = dmuon.Muon(
        model, lr=LR, ns_dtype=torch.float32, adamw_lr=3e-3, adamw_weight_decay=0.01
    )
    for step in range(3):
        freezing_schedule(step, model)
        batch = tokens(10 + step, world * MICRO).chunk(world)[rank]
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_parameters(model)


FORWARDS = (1, 2, 3)
ACCUMS = (1, 2)


def several_forwards(rank: int, world: int, mode: str, forwards: int, accum: int) -> Any:
    model, _ = sharded(rank, world, mode, optimizer=False)
    for micro in range(accum):
        with dmuon.no_sync(model) if micro + 1 < accum else nullcontext():
            batches = [
                tokens(100 * micro + f, world * MICRO).chunk(world)[rank] for f in range(forwards)
            ]
            (sum(loss_of(model, b) for b in batches) / accum).backward()
    return {
        "grads": full_gradients(model),
        "units": dmuon.comm_audit(model).current.units,
    }


def torch_clip(rank: int, world: int) -> str:
    model, optimizer = sharded(rank, world)
    loss_of(model, tokens(3, world * MICRO).chunk(world)[rank]).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        message = "no error"
    except DedicatedGradientError as exc:
        message = str(exc)
    # Nothing was changed: DMuon's own clipping and a step still work.
    dmuon.clip_grad_norm_(model, 1.0)
    optimizer.step()
    return message


def inner_no_sync(rank: int, world: int) -> float:
    model, optimizer = sharded(rank, world)
    batch = tokens(4, world * MICRO * 2).chunk(world)[rank]
    first, second = batch.chunk(2)
    with dmuon.no_sync(model.layers[0]):  # one layer: the whole model accumulates
        (loss_of(model, first) / 2).backward()
    (loss_of(model, second) / 2).backward()
    optimizer.step()
    return dmuon.comm_audit(model).last_step().units


def step_after_only_no_sync(rank: int, world: int) -> dict[str, Any]:
    """Two micro-batches, both under no_sync, then step(): it must raise on every rank
    before any weight changes; with the last backward synchronised, the step trains."""
    model, optimizer = sharded(rank, world)
    batch = tokens(8, world * MICRO * 2).chunk(world)[rank]
    before = full_parameters(model)
    for micro in batch.chunk(2):
        with dmuon.no_sync(model):
            (loss_of(model, micro) / 2).backward()
    try:
        optimizer.step()
        message = None
    except RuntimeError as error:
        message = str(error)
    unchanged = all(torch.equal(v, full_parameters(model)[k]) for k, v in before.items())
    optimizer.zero_grad()
    first, second = batch.chunk(2)
    with dmuon.no_sync(model):
        (loss_of(model, first) / 2).backward()
    (loss_of(model, second) / 2).backward()
    optimizer.step()
    moved = any(not torch.equal(v, full_parameters(model)[k]) for k, v in before.items())
    return {"message": message, "unchanged": unchanged, "then_trains": moved}


def reentrant_checkpoint(rank: int, world: int, order: str, mode: str, root: str) -> Any:
    """torch's reentrant checkpoint_wrapper on every block, applied before or after
    dedicate_params; two steps, then a DCP round trip into a fresh model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build() -> tuple[nn.Module, dmuon.Muon]:
        mesh = init_device_mesh("cpu", (world,))
        model = make_model(Scenario("wrapped"))

        def wrap() -> None:
            for i, layer in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(
                    layer, checkpoint_impl=CheckpointImpl.REENTRANT
                )

        if order == "before":
            wrap()
        dmuon.dedicate_params(model, mesh, reshard_after_forward=mode == "z3")
        if order == "after":
            wrap()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32, adamw_lr=3e-3)
        return model, optimizer

    model, optimizer = build()
    units = []
    for step in range(2):
        loss_of(model, tokens(20 + step, world * MICRO).chunk(world)[rank]).backward()
        optimizer.step()
        optimizer.zero_grad()
        units.append(dmuon.comm_audit(model).last_step().units)
    full = StateDictOptions(full_state_dict=True)
    trained = dmuon.get_model_state_dict(model, options=full)
    path = os.path.join(root, f"{order}-{mode}")
    model_sd, optim_sd = dmuon.get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    fresh, fresh_optimizer = build()
    model_sd, optim_sd = dmuon.get_state_dict(fresh, fresh_optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dmuon.set_state_dict(
        fresh, fresh_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    return {
        "trained": {k: v.detach().clone() for k, v in trained.items()},
        "loaded": dmuon.get_model_state_dict(fresh, options=full),
        "optim_keys": sorted(optim_sd["state"]),
        "units": units,
    }


def _cases(rank: int, world: int, root: str) -> dict[Any, Any]:
    cases: list[tuple[Any, Callable[[], Any]]] = [
        ("model_zero_grad", partial(model_zero_grad, rank, world)),
        ("optimizer_before_fully_shard", partial(optimizer_before_fully_shard, rank, world)),
        ("freezing", partial(freezing, rank, world)),
        ("torch_clip", partial(torch_clip, rank, world)),
        ("inner_no_sync", partial(inner_no_sync, rank, world)),
        ("only_no_sync", partial(step_after_only_no_sync, rank, world)),
    ]
    cases += [
        ((mode, f, k), partial(several_forwards, rank, world, mode, f, k))
        for mode in ("z2", "z3")
        for f in FORWARDS
        for k in ACCUMS
    ]
    cases += [
        (("checkpoint", order, mode), partial(reentrant_checkpoint, rank, world, order, mode, root))
        for order, mode in WRAPPER_CASES
    ]
    return run_in_order(cases)


WRAPPER_CASES = [("after", "z3"), ("after", "z2"), ("before", "z3")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return spawn_ranks(WORLD, _cases, str(tmp_path_factory.mktemp("wrapped")))


def _case(ranks: list[dict[Any, Any]], key: Any) -> list[Any]:
    for rank, result in enumerate(ranks):
        value = result[key]
        assert not (isinstance(value, dict) and "error" in value), f"rank {rank}:\n{value['error']}"
    return [result[key] for result in ranks]


def _plain_grads(batches: list[tuple[torch.Tensor, float]]) -> dict[str, torch.Tensor]:
    """Autograd on the plain model: the sum of ``weight * loss(batch)`` over the list."""
    model = make_model(Scenario("plain"))
    for batch, weight in batches:
        (weight * loss_of(model, batch)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        diff = (got[name] - value).abs().max().item()
        assert diff <= 1e-6, f"{what} {name}: {diff:.3g}"


def test_model_zero_grad_clears_dedicated_gradients(ranks) -> None:
    expected = _plain_grads([(tokens(1, WORLD * MICRO), 1.0)])
    for rank, rounds in enumerate(_case(ranks, "model_zero_grad")):
        for round_, grads in enumerate(rounds):
            _assert_same(grads, expected, f"rank {rank} round {round_}")


def test_optimizer_created_before_fully_shard_is_refused(ranks) -> None:
    for message in _case(ranks, "optimizer_before_fully_shard"):
        assert "no longer the model's" in message and "typically by fully_shard" in message
        assert "then dmuon.Muon" in message


def test_freezing_after_dedication_and_unfreezing_later(ranks) -> None:
    model = make_model(Scenario("freeze"))
    model.get_parameter(FROZEN_AT_DEDICATION).requires_grad_(False)
    model.get_parameter(FROZEN_AFTER).requires_grad_(False)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = [tokens(10 + step, WORLD * MICRO) for step in range(3)]
    expected = reference_train(model, MUON_NAMES, batches, before_step=freezing_schedule)
    assert torch.equal(expected[FROZEN_AFTER], initial[FROZEN_AFTER])  # the oracle froze it
    assert not torch.equal(expected[FROZEN_AT_DEDICATION], initial[FROZEN_AT_DEDICATION])
    for rank, params in enumerate(_case(ranks, "freezing")):
        assert torch.equal(params[FROZEN_AFTER], initial[FROZEN_AFTER]), f"rank {rank}"
        for name, value in expected.items():
            diff = (params[name] - value).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {name}: {diff:.3g}"


@pytest.mark.parametrize("mode", ["z2", "z3"])
@pytest.mark.parametrize("forwards", FORWARDS)
@pytest.mark.parametrize("accum", ACCUMS)
def test_several_forwards_per_backward(ranks, mode: str, forwards: int, accum: int) -> None:
    batches = [
        (tokens(100 * micro + f, WORLD * MICRO), 1.0 / accum)
        for micro in range(accum)
        for f in range(forwards)
    ]
    expected = _plain_grads(batches)
    for rank, result in enumerate(_case(ranks, (mode, forwards, accum))):
        _assert_same(result["grads"], expected, f"rank {rank}")
        # One reduce per backward outside no_sync, whatever the number of forwards.
        broadcasts = 1 if mode == "z2" else accum * (forwards + 1)
        assert result["units"] == pytest.approx(broadcasts + 1), f"rank {rank}"


def test_torch_clip_grad_norm_is_refused_on_every_rank(ranks) -> None:
    messages = _case(ranks, "torch_clip")
    assert messages[0] == messages[1]
    assert "dmuon.clip_grad_norm_(model, max_norm)" in messages[0]


def test_no_sync_on_one_layer_covers_the_whole_model(ranks) -> None:
    # Z3, accumulation 2: 2 x 2 broadcasts and one reduce (not 2 + 2 + 2 = 6).
    assert _case(ranks, "inner_no_sync") == [pytest.approx(5.0)] * WORLD


def test_a_step_after_only_no_sync_backwards_raises_before_any_weight_changes(ranks) -> None:
    for result in _case(ranks, "only_no_sync"):
        assert result["message"] is not None, "the step did not raise"
        assert "all ran under dmuon.no_sync" in result["message"]
        assert "never reduced to their owners" in result["message"]
        assert result["unchanged"] and result["then_trains"]


@pytest.mark.parametrize(("order", "mode"), WRAPPER_CASES)
def test_reentrant_checkpoint_wrapper_in_either_order(ranks, order: str, mode: str) -> None:
    """Exact against one process in either order, at the traffic of the formula (Z2: one
    broadcast and one reduce per step, 2 units; Z3: two broadcasts and a reduce, 3): the
    recomputation in backward gathers its own boundary, not the next one again."""
    model = make_model(Scenario("wrapped"))
    batches = [tokens(20 + step, WORLD * MICRO) for step in range(2)]
    expected = reference_train(model, MUON_NAMES, batches)
    plain_keys = sorted(make_model(Scenario("wrapped")).state_dict())
    for rank, result in enumerate(_case(ranks, ("checkpoint", order, mode))):
        assert sorted(result["trained"]) == plain_keys, f"rank {rank}"
        assert all("_checkpoint_wrapped_module" not in k for k in result["optim_keys"])
        assert result["units"] == [3.0 if mode == "z3" else 2.0] * 2, (rank, result["units"])
        for name, value in expected.items():
            diff = (result["trained"][name] - value).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {name}: {diff:.3g}"
            assert torch.equal(result["loaded"][name], result["trained"][name]), name


# ----- one process ---------------------------------------------------------------------------
def test_a_zero_gradient_still_drives_momentum_as_in_torch() -> None:
    """Step 1 on a batch; step 2 after zero_grad(set_to_none=False) with no backward: the
    zero gradients are gradients, so momentum moves the matrices (torch.optim.Muon's rule,
    written out in float32 here)."""
    model = make_model(Scenario("zeros"))
    plain = make_model(Scenario("zeros"))
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=LR, ns_dtype=torch.float32)
    batch = tokens(5, 4)
    loss_of(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    optimizer.step()
    loss_of(plain, batch).backward()
    got = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if name not in MUON_NAMES:
                continue
            scale = LR * 0.2 * max(p.shape) ** 0.5
            grad, buf = p.grad, torch.zeros_like(p)
            for g in (grad, torch.zeros_like(grad)):  # the batch's gradient, then zeros
                buf.lerp_(g, 0.05)
                ortho = dmuon.newton_schulz(g.lerp(buf, 0.95), 5, dtype=torch.float32)
                p.sub_(scale * ortho)
            diff = (got[name] - p).abs().max().item()
            assert diff <= 1e-6, f"{name}: {diff:.3g}"


def test_dedicated_grad_marker_in_one_process() -> None:
    model = make_model(Scenario("marker"))
    dmuon.dedicate_params(model)
    loss_of(model, tokens(6, 2)).backward()
    weight = model.get_parameter("layers.0.attn.q_proj.weight")
    assert "GradientMarker" in repr(weight.grad)
    with pytest.raises(DedicatedGradientError, match=r"dmuon\.clip_grad_norm_"):
        weight.grad.norm()
    model.zero_grad()
    assert weight.grad is None
    with torch.no_grad():
        loss_of(model, tokens(6, 2))  # the next forward frees what zero_grad cleared
    assert getattr(weight, "_reduced_grad", None) is None


def test_scaling_the_marker_by_a_number_scales_the_stored_gradient() -> None:
    """``.grad.div_(n)`` / ``.mul_(s)`` (torch's pipeline schedules dividing by the
    micro-batch count) scale the averaged gradient, as they would a plain ``.grad``;
    a tensor argument of several elements still raises."""
    model, plain = make_model(Scenario("scaled")), make_model(Scenario("scaled"))
    dmuon.dedicate_params(model)
    batch = tokens(6, 2)
    loss_of(model, batch).backward()
    loss_of(plain, batch).backward()
    name = "layers.0.attn.q_proj.weight"
    weight, expected = model.get_parameter(name), plain.get_parameter(name).grad
    weight.grad.div_(4)
    weight.grad.mul_(torch.tensor(2.0))
    assert torch.allclose(weight._reduced_grad, expected / 2, atol=1e-7)
    with pytest.raises(DedicatedGradientError):
        weight.grad.mul_(torch.ones(weight.shape))


# ----- a rank that stalls ---------------------------------------------------------------------
STALL_TIMEOUT_S = 4


def _stalled_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 stops before the forward; rank 0's first all-gather times out and says which
    collective of which boundary it was."""
    import datetime
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = make_model(Scenario("stall"))
    dmuon.dedicate_params(model, mesh)
    start = time.monotonic()
    if rank == 1:
        time.sleep(STALL_TIMEOUT_S + 4)
        return {"stalled": True}
    try:
        loss_of(model, tokens(30, 2))
        return {"error": "no error"}
    except dmuon.CollectiveError as exc:
        return {"message": str(exc), "seconds": time.monotonic() - start}


def test_a_stalled_rank_is_a_clear_error_within_the_timeout() -> None:
    rank0, rank1 = spawn_ranks(2, _stalled_peer)
    assert rank1 == {"stalled": True}
    assert "error" not in rank0, rank0
    message = rank0["message"]
    assert "DMuon's all_gather" in message and "hook boundary 'layers.0'" in message
    assert "init_process_group(..., timeout=" in message
    assert STALL_TIMEOUT_S - 1 <= rank0["seconds"] <= STALL_TIMEOUT_S + 30


@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_a_loss_through_a_child_of_a_hook_boundary_is_refused_naming_it(mode: str) -> None:
    """Distillation, linear probes and expert code call a module inside a boundary
    (``model.layers[0].mlp(x)``): its weights then get a plain ``.grad`` that DMuon never
    sees, and the step used to change nothing. It raises, naming the matrix and the
    boundary, before any weight changes."""
    from tiny_llama import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(vocab=VOCAB, dim=16, hidden=32, n_layers=2)
    dmuon.dedicate_params(model, reshard_after_forward=mode == "z3")
    optimizer = dmuon.Muon(model, lr=LR)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.layers[0].mlp(torch.randn(2, 4, 16)).square().mean().backward()
    with pytest.raises(RuntimeError, match=r"'layers\.0\.mlp\.\w+\.weight'.*boundary 'layers\.0'"):
        optimizer.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    optimizer.zero_grad()
    _loss(model, global_batch(0, 1, 1)).backward()  # through the boundary: it trains
    optimizer.step()
    assert not torch.equal(
        model.layers[0].mlp.up_proj.weight, before["layers.0.mlp.up_proj.weight"]
    )
