"""`python -m dmuon.plan --recommend`: the layouts of a model on a cluster, ranked.

For a world of GPUs and a number of tokens per step, every layout DMuon can run is
planned: a 1-D mesh and HSDP with shard groups of 8 GPUs or more (the size of a node and
up), Z2 and Z3, and the fewest micro-batches per step (1, 2, 4, ...) with which its
fullest rank fits the accelerator's memory (`dmuon.plan._memory`; accumulation under
``dmuon.no_sync``, with ``scope="replicas"`` under HSDP). Those that fit are ranked by
step time (forward+backward and what DMuon leaves exposed, `ClusterPlan.step_overhead`),
then by memory; each says why, beside FSDP2 + AdamW's step and memory on the same layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from dmuon.plan._estimate import GIB, ClusterPlan

#: Micro-batches per step tried, fewest first.
ACCUMULATIONS = (1, 2, 4, 8, 16, 32, 64)
#: The smallest HSDP shard group considered (a node of 8 GPUs).
MIN_SHARD_GROUP = 8


@dataclass(frozen=True)
class Choice:
    """One layout that fits, with its plan."""

    plan: ClusterPlan

    @property
    def step_seconds(self) -> float:
        """DMuon's step time: forward+backward and what it leaves exposed."""
        return self.plan.forward_backward_seconds * (1 + self.plan.step_overhead)

    @property
    def layout(self) -> str:
        """The layout in words: mesh, mode, micro-batches."""
        p = self.plan
        mesh = "1-D" if p.replicas == 1 else f"HSDP {p.replicas} x {p.shard_size}"
        accum = f"{p.accum} micro-batches" if p.accum > 1 else "1 micro-batch"
        scope = ' under no_sync(scope="replicas")' if p.no_sync_scope == "replicas" else ""
        scope = scope or (" under no_sync" if p.no_sync and p.accum > 1 else "")
        return f"{mesh}, {p.mode.upper()}, {accum}{scope}"

    @property
    def why(self) -> str:
        """What decides its place: memory, Newton-Schulz, exposed traffic, FSDP2's step."""
        p = self.plan
        return (
            f"fits in {p.memory_bytes / GIB:.1f} of {p.hardware.memory_gib:g} GiB "
            f"(FSDP2 + AdamW {p.fsdp2_memory_bytes / GIB:.1f}); Newton-Schulz "
            f"{p.ns_overhead:.2%}, exposed between replicas "
            f"{p.update_overhead + p.reduce_overhead:.2%} of forward+backward; "
            f"{p.step_ratio:.3f}x FSDP2 + AdamW's step"
        )


def layouts(world: int) -> list[int]:
    """The shard sizes tried on ``world`` GPUs: HSDP groups of at least
    `MIN_SHARD_GROUP` that divide the world, and the whole world (1-D)."""
    sizes = {s for s in range(min(MIN_SHARD_GROUP, world), world + 1) if world % s == 0}
    return sorted(sizes)


def recommend(
    plan: Callable[..., ClusterPlan], model: nn.Module, world: int, **common: object
) -> tuple[list[Choice], int]:
    """Every layout that fits, best first, and how many were planned in all.

    ``plan`` is `dmuon.plan.plan_cluster`; ``common`` its arguments shared by every
    layout (tokens per step, hardware, active parameters, ...).
    """
    fitting: list[Choice] = []
    planned = 0
    split = common.get("ns_split", 1)
    for shard in layouts(world):
        if shard % split:  # type: ignore[operator]
            continue  # a block of ranks sharing an iteration stays inside a shard group
        for mode in ("z3", "z2"):
            for accum in ACCUMULATIONS:
                scope = "replicas" if accum > 1 and shard < world else "all"
                candidate = plan(
                    model,
                    world,
                    shard,
                    mode=mode,
                    accum=accum,
                    no_sync=accum > 1,
                    no_sync_scope=scope,
                    **common,
                )
                planned += 1
                if candidate.fits:
                    fitting.append(Choice(candidate))
                    break
    fitting.sort(key=lambda c: (round(c.step_seconds, 6), c.plan.memory_bytes))
    return fitting, planned
