"""One source for each dtype: FSDP2's ``MixedPrecisionPolicy`` and DMuon's buffers agree.

On 2 gloo ranks, a Llama-shaped model under ``fully_shard`` with a policy, and
``dedicate_params`` given nothing, the same dtypes, or others: after the first forward
and backward, every hook boundary's buffer computes in the policy's ``param_dtype`` and
reduces in its effective reduce dtype (``reduce_dtype``, else ``param_dtype``), and the
dedicated gradients that reach the owners were summed in it; a ``dedicate_params`` dtype
that differs from the policy's raises on every rank at the first forward, before any
collective, naming both. The recipe's own policy (`dmuon.train.parallelize.mixed_precision`)
and the values it gives dedication agree for every ``--param-dtype`` x ``--reduce-dtype``.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from dist_harness import Scenario, make_model, spawn_ranks

import dmuon

BF16, FP32 = torch.bfloat16, torch.float32
#: (policy param, policy reduce, dedicate param, dedicate reduce) -> expected or error.
CASES: dict[str, tuple[Any, Any, Any, Any, Any]] = {
    "follows-the-policy": (BF16, FP32, None, None, (BF16, FP32)),
    "reduce-follows-param": (BF16, None, None, None, (BF16, BF16)),
    "repeats-the-policy": (BF16, BF16, BF16, BF16, (BF16, BF16)),
    "reduce-only-policy": (None, BF16, None, None, (FP32, BF16)),
    "silent-policy": (None, None, None, BF16, (FP32, BF16)),
    "reduce-differs": (BF16, FP32, None, BF16, "reduce_dtype=torch.bfloat16) differs"),
    "param-differs": (BF16, FP32, FP32, None, "param_dtype=torch.float32) differs"),
}


def _case(name: str, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dmuon._ownership.dedication_state import get_dedication

    policy_param, policy_reduce, param, reduce, _ = CASES[name]
    model = make_model(Scenario(name))
    mesh = init_device_mesh("cpu", (world,))
    dmuon.dedicate_params(model, mesh, param_dtype=param, reduce_dtype=reduce)
    policy = MixedPrecisionPolicy(param_dtype=policy_param, reduce_dtype=policy_reduce)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
    try:
        model(tokens[:, :-1], tokens[:, 1:]).backward()  # the loss
    except ValueError as error:
        return {"raised": str(error)}
    state = get_dedication(model)
    buffers = list(state.runtime.buffers())
    return {"dtypes": sorted({(str(b.dtype), str(b.reduce_dtype)) for b in buffers})}


def _all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in CASES:
        try:
            out[name] = _case(name, world)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn_ranks(2, _all)


@pytest.mark.parametrize("name", list(CASES))
def test_buffers_take_the_policys_dtypes_or_raise(results: list[dict[str, Any]], name: str) -> None:
    expected = CASES[name][-1]
    for rank, by_case in enumerate(results):
        got = by_case[name]
        assert "error" not in got, got.get("error")
        if isinstance(expected, str):
            assert expected in got.get("raised", ""), (rank, got)
            assert "MixedPrecisionPolicy" in got["raised"]
        else:
            compute, reduce = expected
            assert got == {"dtypes": [(str(compute), str(reduce))]}, (rank, got)


@pytest.mark.parametrize("param", [None, BF16])
@pytest.mark.parametrize("reduce", [None, BF16])
def test_the_recipes_policy_is_the_one_dedication_checks_against(
    param: torch.dtype | None, reduce: torch.dtype | None
) -> None:
    """The recipe passes the same two values to `mixed_precision` and to dedication;
    the policy's effective dtypes are those values, so the first-forward check holds."""
    from dmuon.train.parallelize import mixed_precision

    policy = mixed_precision(param, reduce)
    assert policy.param_dtype == param
    effective_reduce = policy.reduce_dtype or policy.param_dtype or FP32
    assert effective_reduce == (reduce or FP32)
