"""`python -m dmuon.plan --recommend`: the layouts of a model on a cluster, ranked.

For a world of GPUs and a number of tokens per step, every layout DMuon can run is
planned: a 1-D mesh and HSDP with shard groups of 8 GPUs or more (the size of a node and
up), Z2 and Z3, and the fewest micro-batches per step (1, 2, 4, ... 64) with which its
fullest rank fits the accelerator's memory (`dmuon.plan._memory`; accumulation under
``dmuon.no_sync``, with ``scope="replicas"`` under HSDP, or, where no number of
micro-batches fits under it, with each micro-batch reduced). Those that fit are ranked by
step time (forward+backward and what is exposed, `ClusterPlan.step_overhead`); those
within `WITHIN` of the fastest are ranked by memory headroom instead, since the model
cannot tell them apart. Each says why, beside FSDP2 + AdamW's step and memory on the same
layout. Every layout left out is listed with its reason.

Memory does not depend on the number of micro-batches beyond whether there are several
(the ``no_sync`` accumulator), except for the activations of one micro-batch: a layout
is planned with 1 and 2 micro-batches, and the fewest that fit beyond are found from the
second plan's memory (`dataclasses.replace` of its ``accum``) and then planned; the same
again with each micro-batch reduced where ``no_sync`` fits with none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from dmuon.plan._estimate import GIB, ClusterPlan, reusing_dedications

#: Micro-batches per step tried, fewest first.
ACCUMULATIONS = (1, 2, 4, 8, 16, 32, 64)
#: The smallest HSDP shard group considered (a node of 8 GPUs).
MIN_SHARD_GROUP = 8
#: Layouts whose step time is within this share of the fastest rank by memory headroom.
WITHIN = 0.01


def _mesh(shard: int, world: int) -> str:
    return "1-D" if shard == world else f"HSDP {world // shard} x {shard}"


def accumulation(plan: ClusterPlan, tokens: str = "") -> str:
    """A plan's micro-batches in words (``tokens`` after their count), and how their
    gradients travel."""
    count = f"{plan.accum} micro-batches" if plan.accum > 1 else "1 micro-batch"
    if plan.accum == 1:
        how = ""
    elif not plan.no_sync:
        how = ", each reduced (no no_sync)"
    elif plan.no_sync_scope == "replicas":
        how = ' under no_sync(scope="replicas")'
    else:
        how = " under no_sync"
    return f"{count}{tokens}{how}"


@dataclass(frozen=True)
class Choice:
    """One layout that fits, with its plan."""

    plan: ClusterPlan

    @property
    def step_seconds(self) -> float:
        """DMuon's step time: forward+backward and what it leaves exposed."""
        return self.plan.forward_backward_seconds * (1 + self.plan.step_overhead)

    @property
    def headroom_bytes(self) -> float:
        """The accelerator's memory left on the fullest rank."""
        return self.plan.hardware.memory_gib * GIB - self.plan.memory_bytes

    @property
    def micro_batch_tokens(self) -> float:
        """Tokens of one micro-batch on one data-parallel rank."""
        p = self.plan
        return p.tokens_per_step / (p.replicas * p.shard_size) / p.accum

    @property
    def layout(self) -> str:
        """The layout in words: mesh, mode, micro-batches."""
        p = self.plan
        mesh = _mesh(p.shard_size, p.replicas * p.shard_size)
        return f"{mesh}, {p.mode.upper()}, {accumulation(p)}"

    @property
    def why(self) -> str:
        """What decides its place: memory, Newton-Schulz, exposed traffic, FSDP2's step."""
        p = self.plan
        where = "between nodes" if p.shard_traffic.crosses_nodes else "inside a node"
        return (
            f"{self.micro_batch_tokens:,.0f} tokens per micro-batch per rank; fits in "
            f"{p.memory_bytes / GIB:.1f} of {p.hardware.memory_gib:g} GiB, "
            f"{self.headroom_bytes / GIB:.1f} GiB free (FSDP2 + AdamW "
            f"{p.fsdp2_memory_bytes / GIB:.1f}); shard group {where}: its gathers and "
            f"reduce-scatters (FSDP2's and DMuon's) exposed {p.shard_overhead:.2%}; "
            f"Newton-Schulz {p.ns_overhead:.2%}, exposed between replicas "
            f"{p.update_overhead + p.reduce_overhead:.2%} of forward+backward; "
            f"{p.step_ratio:.3f}x FSDP2 + AdamW's step"
        )


@dataclass(frozen=True)
class Rejected:
    """A layout left out, and why."""

    layout: str
    reason: str


def layouts(world: int) -> list[int]:
    """The shard sizes tried on ``world`` GPUs: HSDP groups of at least
    `MIN_SHARD_GROUP` that divide the world, and the whole world (1-D)."""
    sizes = {s for s in range(min(MIN_SHARD_GROUP, world), world + 1) if world % s == 0}
    return sorted(sizes)


def rank(choices: list[Choice]) -> list[Choice]:
    """Fastest first; those within `WITHIN` of the fastest by memory headroom first."""
    if not choices:
        return []
    fastest = min(c.step_seconds for c in choices)

    def key(choice: Choice) -> tuple[int, float, float]:
        if choice.step_seconds <= fastest * (1 + WITHIN):
            return (0, -choice.headroom_bytes, choice.step_seconds)
        return (1, choice.step_seconds, -choice.headroom_bytes)

    return sorted(choices, key=key)


def recommend(
    plan: Callable[..., ClusterPlan], model: nn.Module, world: int, **common: object
) -> tuple[list[Choice], list[Rejected], int]:
    """Every layout that fits, best first (`rank`); every one left out with its reason;
    and how many plans were made.

    ``plan`` is `dmuon.plan.plan_cluster`; ``common`` its arguments shared by every
    layout (tokens per step, hardware, active parameters, ...).
    """
    fitting: list[Choice] = []
    rejected: list[Rejected] = []
    planned = 0
    split = common.get("ns_split", 1)
    with reusing_dedications():
        for shard in layouts(world):
            mesh = _mesh(shard, world)
            if shard % split:  # type: ignore[operator]
                rejected.append(
                    Rejected(
                        mesh,
                        f"refused by the library: ns_split={split} must divide the shard "
                        f"size {shard} (a block sharing an iteration stays in a shard group)",
                    )
                )
                continue
            for mode in ("z3", "z2"):
                try:
                    found, made = _fewest_micro_batches(plan, model, world, shard, mode, common)
                except ValueError as error:
                    rejected.append(Rejected(mesh, f"refused by the library: {error}"))
                    break
                planned += made
                if isinstance(found, Rejected):
                    rejected.append(found)
                else:
                    fitting.append(found)
    return rank(fitting), rejected, planned


def _fewest_micro_batches(
    plan: Callable[..., ClusterPlan],
    model: nn.Module,
    world: int,
    shard: int,
    mode: str,
    common: dict[str, object],
) -> tuple[Choice | Rejected, int]:
    """The layout with the fewest micro-batches that fits, or why none does; and how many
    plans it took.

    Micro-batches accumulate under ``dmuon.no_sync`` first; where no number of them fits
    (its accumulator holds every dedicated gradient on a 1-D mesh), with each micro-batch
    reduced to the owners instead, which holds no accumulator and sends more."""

    def make(accum: int, no_sync: bool) -> ClusterPlan:
        no_sync = no_sync and accum > 1
        scope = "replicas" if no_sync and shard < world else "all"
        return plan(
            model,
            world,
            shard,
            mode=mode,
            accum=accum,
            no_sync=no_sync,
            no_sync_scope=scope,
            **common,
        )

    single = make(1, no_sync=False)
    if single.fits:
        return Choice(single), 1
    tried = [single]
    made = 1
    for no_sync in (True, False):
        several = make(2, no_sync)
        made += 1
        if several.fits:
            return Choice(several), made
        # Memory depends on the micro-batches only through one micro-batch's activations.
        for accum in ACCUMULATIONS[2:]:
            if dataclasses.replace(several, accum=accum).fits:
                return Choice(make(accum, no_sync)), made + 1
        tried += [dataclasses.replace(several, accum=a) for a in ACCUMULATIONS[1:]]
    best = min(tried, key=lambda p: p.memory_bytes)
    short = (best.memory_bytes - best.hardware.memory_gib * GIB) / GIB
    tokens = f" of {Choice(best).micro_batch_tokens:,.0f} tokens per rank"
    return (
        Rejected(
            f"{_mesh(shard, world)}, {mode.upper()}",
            f"does not fit by {short:.1f} GiB at best: {accumulation(best, tokens)}, fullest "
            f"rank {best.memory_bytes / GIB:.1f} of {best.hardware.memory_gib:g} GiB",
        ),
        made,
    )
