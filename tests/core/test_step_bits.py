"""The stepping owner and every other replica apply a step through one function
(`dmuon._ownership.step_arithmetic`), so a bf16 model's replicas cannot drift on any
device, and the decay is the one asked for.

On a GPU a 0-dim float32 factor of a bfloat16 master is rounded to bfloat16 first (0.998
becomes 0.99609375: twice the decay asked for), while a replica applying the same factor
from its header promoted to float32: one ulp apart on most elements after one step. These
tests run the real functions under `cuda_semantics.cuda_scalar_rounding` (CUDA's rounding
on CPU) and without it; ``tests/core/test_cuda.py`` runs the same on a GPU.

Oracle: each product and sum computed exactly in float64 from the same inputs (the
factor as the float32 number it is kept as), rounded to float32 as a float32 kernel
rounds it, then to the master's dtype.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from cuda_semantics import cuda_scalar_rounding

from dmuon._ownership.replica_updates import UpdateSlot
from dmuon._ownership.step_arithmetic import add_updates_, scale_update_, step_scalar
from dmuon.optim._muon_step import decay_

SHAPES = [(64, 96), (96, 64), (3, 32, 48)]
DECAY = 1 - 0.02 * 0.1
MULTIPLIERS = [-0.02 * 0.2 * 96**0.5, -0.004, -0.02 * 0.2 * 48**0.5]
ROUNDINGS = {"cpu": nullcontext, "cuda-emulated": cuda_scalar_rounding}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def _kernel(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 result as a float32 kernel writing ``dtype`` rounds it."""
    return exact.float().to(dtype)


def _inputs(dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(s, generator=gen).to(dtype) for s in SHAPES]
    updates = [torch.randn(s, generator=gen).bfloat16() for s in SHAPES]
    return masters, updates


def test_the_emulation_rounds_as_a_gpu_does() -> None:
    """The documented GPU result: a bf16 one times a 0-dim float32 0.998 is 0.99609375,
    and a one-element 1-D factor promotes (0.998 rounded once from float32)."""
    a = torch.ones(4, dtype=torch.bfloat16)
    with cuda_scalar_rounding():
        zero_dim = a.clone()
        torch._foreach_mul_([zero_dim], torch.tensor(0.998))
        one_dim = a.clone().mul_(torch.tensor([0.998]))
    assert zero_dim.float().unique().tolist() == [0.99609375]
    assert one_dim.float().unique().tolist() == [torch.tensor(0.998).bfloat16().item()]
    plain = a.clone()
    torch._foreach_mul_([plain], torch.tensor(0.998))
    assert plain.float().unique().tolist() == [torch.tensor(0.998).bfloat16().item()]


@pytest.mark.parametrize("rounding", list(ROUNDINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decay_is_the_one_asked_for(rounding: str, dtype: torch.dtype) -> None:
    masters, _ = _inputs(dtype)
    expected = [_kernel(m.double() * _f32(DECAY), dtype) for m in masters]
    with ROUNDINGS[rounding]():
        decay_(masters, DECAY)
    for got, want in zip(masters, expected, strict=True):
        assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("rounding", list(ROUNDINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_replicas_update_gives_the_steppers_bits(rounding: str, dtype: torch.dtype) -> None:
    """The stepping owner's path (`decay_`, `scale_update_` by a `step_scalar`,
    `add_updates_`) against a replica's `UpdateSlot.apply` of the same header, over 50
    steps: identical bits, and each step the float64 oracle rounded once per operation."""
    masters, updates = _inputs(dtype)
    stepped = [m.clone() for m in masters]
    replica = [m.clone() for m in masters]
    with ROUNDINGS[rounding]():
        for _ in range(50):
            oracle = [_kernel(m.double() * _f32(DECAY), dtype) for m in stepped]
            decay_(stepped, DECAY)
            scaled = []
            for u, k in zip(updates, MULTIPLIERS, strict=True):
                widened = u.to(dtype, copy=True)
                scaled.append(scale_update_(widened, step_scalar(k, dtype, widened.device)))
            for o, u, k in zip(oracle, updates, MULTIPLIERS, strict=True):
                scaled_update = _kernel(u.double() * _f32(k), dtype)
                o.copy_(_kernel(o.double() + scaled_update.double(), dtype))
            add_updates_(stepped, scaled)
            for master, update, k in zip(replica, updates, MULTIPLIERS, strict=True):
                out = master.shape[-2]
                header = torch.tensor([DECAY, *[k] * out, *[1.0] * out], dtype=torch.float32)
                dp = SimpleNamespace(param=master, shape=master.shape, transposed=False)
                UpdateSlot(dp, header, update).apply()  # type: ignore[arg-type]
            for a, b, o in zip(stepped, replica, oracle, strict=True):
                assert torch.equal(_bits(a), _bits(b))
                assert torch.equal(_bits(a), _bits(o))
