"""The planner's warnings: what will not fit or not pay, each with what to do instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

GIB = 1024**3


class _Hardware(Protocol):
    name: str
    memory_gib: float


class _Rank(Protocol):
    rank: int
    added_bytes: int
    accumulator_bytes: int
    master_bytes: int
    momentum_bytes: int
    buffer_bytes: int
    reduce_buffer_bytes: int
    workspace_bytes: int


class _Plan(Protocol):
    hardware: _Hardware
    ranks: Sequence[_Rank]
    accum: int
    replicas: int
    mode: str
    calls: int
    fsdp2_calls: int


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:,.1f} GiB"


def plan_warnings(plan: _Plan) -> list[str]:
    """What will not fit or not pay, each with what to do instead."""
    memory = plan.hardware.memory_gib * GIB
    busiest = max(plan.ranks, key=lambda r: r.added_bytes)
    notes = []
    if busiest.accumulator_bytes > 0.5 * memory:
        notes.append(
            f"dmuon.no_sync accumulation keeps {_gib(busiest.accumulator_bytes)} of full float32 "
            f"gradients of the dedicated matrices on every rank, more than half of the "
            f"{plan.hardware.memory_gib:g} GiB of a {plan.hardware.name}: accumulate without "
            "dmuon.no_sync (every micro-batch then reduces its gradients to the owners: "
            f"{plan.accum} reduces per step instead of 1, and no accumulator)"
            + (
                ', or under HSDP with dmuon.no_sync(model, scope="replicas") (--no-sync-scope '
                "replicas): each owner then holds its own matrices' sums, and one "
                "reduce-scatter crosses replicas per step"
                if plan.replicas > 1
                else ""
            )
        )
    if busiest.added_bytes > memory:
        parts = (
            f"masters {_gib(busiest.master_bytes)}, momentum {_gib(busiest.momentum_bytes)}, "
            f"buffers {_gib(busiest.buffer_bytes)}, reduce buffers "
            f"{_gib(busiest.reduce_buffer_bytes)}, workspace {_gib(busiest.workspace_bytes)}"
        )
        hints = ["larger shard groups (the masters are split over the shard size)"]
        if plan.mode == "z2":
            hints.insert(0, "Z3 (two boundaries' buffers instead of all of them)")
        notes.append(
            f"DMuon adds up to {_gib(busiest.added_bytes)} on rank {busiest.rank} ({parts}), "
            f"more than the {plan.hardware.memory_gib:g} GiB of a {plan.hardware.name}: use "
            + " or ".join(hints)
        )
    if plan.calls > 2 * plan.fsdp2_calls:
        notes.append(
            f"DMuon issues up to {plan.calls} collective calls per step where FSDP2 issues "
            f"{plan.fsdp2_calls}: at this many ranks each call's latency adds up"
        )
    return notes
