"""Dedicated matrices follow the model when it is moved after `dmuon.dedicate_params`.

On a GPU, a model dedicated where it was built (the CPU) and then moved by FSDP2 (which
moves only the parameters it manages), ``model.to("cuda")`` or Accelerate's FSDP2
preparation left its dedicated masters and flat buffers behind: "mat2 is on cpu,
different from other tensors on cuda:0" at the first forward. A CPU has one device, so
these tests move the model the same way to another dtype (``model.to(torch.float64)``
goes through the same ``nn.Module._apply`` as ``model.to("cuda")``, and leaves the buffers
behind just as well) and from the meta device (``to_empty``).

Oracle: the same model dedicated and trained without the move (bit for bit where the move
changes nothing the arithmetic sees: the meta device, a move to where the model is;
within the new dtype's rounding where it does). Each case also trains: the weights move
by more than 1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist_harness import _loss, global_batch
from tiny_llama import TinyLlama

import dmuon

STEPS = 3


def _model() -> TinyLlama:
    torch.manual_seed(7)
    return TinyLlama(vocab=64, dim=16, hidden=32, n_layers=2)


def _train(model: torch.nn.Module, **muon: object) -> dict[str, torch.Tensor]:
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, weight_decay=0.1, **muon)
    for step in range(STEPS):
        _loss(model, global_batch(step, 1, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in got.items():
        assert value.dtype == want[key].dtype, key
        assert torch.equal(value, want[key]), (key, (value - want[key]).abs().max().item())


#: Per moved dtype: how far its weights may end from the float32 run's after 3 steps. In
#: float64 (float64 iteration) the float32 run's rounding (about 1e-6 per step); in
#: bfloat16 the weights' own rounding (2^-8 relative on weights below 1.5) and the
#: bfloat16 forward's.
TOLERANCE = {torch.float64: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("mode", ["z3", "z2"])
def test_a_model_moved_after_dedication_trains_in_its_new_dtype(
    dtype: torch.dtype, mode: str
) -> None:
    """Oracle: the unmoved float32 model, dedicated and trained the same way (before the
    fix the moved model's first forward raised "expected m1 and m2 to have the same
    dtype")."""
    from dmuon._ownership.dedication_state import get_dedication

    start = _model()
    z3 = mode == "z3"
    unmoved = copy.deepcopy(start)
    dmuon.dedicate_params(unmoved, reshard_after_forward=z3)
    want = _train(unmoved, ns_dtype=torch.float32)

    moved = copy.deepcopy(start)
    dmuon.dedicate_params(moved, reshard_after_forward=z3)
    moved.to(dtype)
    got = _train(moved, ns_dtype=dtype)
    runtime = get_dedication(moved).runtime
    assert {b.buffer.dtype for b in runtime.boundaries} == {dtype}
    assert {dp.param.dtype for dp in runtime.params} == {dtype}
    for key, value in got.items():
        assert value.dtype == dtype, key
        worst = (value.double() - want[key].double()).abs().max().item()
        assert worst <= TOLERANCE[dtype], (key, worst)
    first = start.state_dict()
    assert max((got[k].double() - first[k].double()).abs().max().item() for k in got) > 1e-3


def test_a_model_moved_between_steps_keeps_training() -> None:
    """A move after the optimizer made its state (the momentum follows at the next step)."""
    start = _model()
    reference = copy.deepcopy(start)
    dmuon.dedicate_params(reference)
    want = _train(reference)
    model = copy.deepcopy(start)
    dmuon.dedicate_params(model)
    optimizer = dmuon.Muon(model, lr=0.02, adamw_lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        model.to("cpu")  # a no-op move each step: nothing is made again
        _loss(model, global_batch(step, 1, 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    _assert_same({k: v.detach() for k, v in model.state_dict().items()}, want)


def test_a_model_dedicated_on_the_meta_device_follows_to_empty() -> None:
    start = _model()
    reference = copy.deepcopy(start)
    dmuon.dedicate_params(reference)
    want = _train(reference)

    with torch.device("meta"):
        model = TinyLlama(vocab=64, dim=16, hidden=32, n_layers=2)
    dmuon.dedicate_params(model)
    model.to_empty(device="cpu")
    model.load_state_dict(start.state_dict())
    _assert_same(_train(model), want)


def test_a_move_while_gradients_wait_for_the_step_is_refused() -> None:
    """Caught at the move where torch's ``_apply`` reaches the gradient marker, else at the
    next forward; either way the message says when to move."""
    from dmuon._ownership.gradients import DedicatedGradientError

    model = _model()
    dmuon.dedicate_params(model)
    _loss(model, global_batch(0, 1, 1)).backward()
    with pytest.raises(DedicatedGradientError, match=r"moved .* while gradients wait"):
        model.to(torch.float64)
    model = _model()
    dmuon.dedicate_params(model)
    with dmuon.no_sync(model):
        _loss(model, global_batch(0, 1, 1)).backward()
    for p in model.parameters():  # where a marker is not reached: the data alone moves
        p.data = p.data.double()
    with pytest.raises(ValueError, match=r"while gradients wait for optimizer\.step"):
        _loss(model, global_batch(1, 1, 1))


def test_moving_part_of_the_dedicated_matrices_is_refused() -> None:
    model = _model()
    dmuon.dedicate_params(model)
    model.layers[0].to(torch.float64)
    with pytest.raises(ValueError, match=r"move the whole model with model\.to"):
        _loss(model, global_batch(0, 1, 1))
