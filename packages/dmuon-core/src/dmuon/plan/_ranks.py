"""Per rank, what DMuon adds on a planned cluster: `RankPlan`, and how `plan_cluster`
works each one out from the cluster's `ClusterSetup` (:func:`rank_plans`).

Ranks are numbered ``(replica * shard + position) * tp + t``. What a shard position owns
is the same in every replica, so it is worked out once per position and tp position; a
rank then adds what it steps itself (the replica that steps each matrix, the tp rank that
orthogonalizes it) and the seconds its traffic takes.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import torch

from dmuon._ownership.gradients import REDUCES_IN_FLIGHT
from dmuon._ownership.planner import (
    OwnerPlan,
    newton_schulz_cost,
    newton_schulz_flops,
    spread_over_tp,
)
from dmuon._ownership.replica_updates import record_nbytes, values_nbytes
from dmuon._ownership.split_iterations import block_of, split_iteration_cost
from dmuon.optim._gram import gram_restarts, uses_gram
from dmuon.plan._collectives import (
    Span,
    Tally,
    boundary_calls,
    replica_update_calls,
    workspace_bytes,
)
from dmuon.plan._hardware import Hardware

FLOAT32 = 4


@dataclass(frozen=True)
class RankPlan:
    """What DMuon adds to one rank (replica ``replica``, shard position ``shard``).

    Bytes are per rank; collectives per optimizer step, by kind, on the shard dimension
    (inside a replica) and the replicate dimension (between replicas).
    """

    rank: int
    replica: int
    shard: int
    ns_flops: int
    ns_seconds: float
    update_seconds: float
    master_bytes: int
    momentum_bytes: int
    workspace_bytes: int
    buffer_bytes: int
    accumulator_bytes: int
    reduce_buffer_bytes: int
    shard_collectives: dict[str, Tally] = field(default_factory=dict)
    replicate_collectives: dict[str, Tally] = field(default_factory=dict)
    #: Position in its tensor-parallel group (0 without tensor parallelism).
    tp: int = 0
    #: Collectives over the tensor-parallel group per step (a gather and a scatter of
    #: each tp-sharded matrix the rank's owner steps).
    tensor_collectives: dict[str, Tally] = field(default_factory=dict)
    #: Seconds the rank's traffic between replicas takes during backward (HSDP): the
    #: reduce-scatter of its owned gradients and FSDP2's all-reduce of its shard of the
    #: other parameters.
    replicate_reduce_seconds: float = 0.0
    #: Bytes of the step's updates between replicas this rank holds from the step to the
    #: next forward (HSDP): every replica's section of its chunks.
    update_bytes: int = 0
    #: Seconds the step waits for the tensor-parallel gathers and scatters of the
    #: matrices this rank steps (inside the node).
    tp_seconds: float = 0.0
    #: Seconds the step waits for the ranks' agreement on non-finite gradients (one
    #: all-reduce of one number per mesh dimension: latency only).
    agreement_seconds: float = 0.0
    #: Collectives over the rank's block per step (``ns_split``): for each split matrix
    #: stepped in the block, a scatter and a gather of the rank's slice and an all-reduce
    #: of the Gram matrix per iteration.
    split_collectives: dict[str, Tally] = field(default_factory=dict)
    #: Seconds the step waits for those collectives (the stepping rank's volume).
    split_seconds: float = 0.0

    @property
    def added_bytes(self) -> int:
        """Everything DMuon holds at its peak on this rank (the reduce buffers included)."""
        return (
            self.master_bytes
            + self.momentum_bytes
            + self.workspace_bytes
            + self.buffer_bytes
            + self.accumulator_bytes
            + self.reduce_buffer_bytes
        )

    @property
    def calls(self) -> int:
        """Collective calls per optimizer step, every dimension."""
        tallies = [
            *self.shard_collectives.values(),
            *self.replicate_collectives.values(),
            *self.tensor_collectives.values(),
            *self.split_collectives.values(),
        ]
        return sum(t.count for t in tallies)


@dataclass(frozen=True)
class ClusterSetup:
    """What `plan_cluster` works out once and every rank's plan reads: the dedicated
    matrices (by plan item), their owners and hook-boundary spans, the mesh and the
    settings that price them."""

    #: Each dedicated matrix's (or stack's) shape, by fqn.
    shapes: dict[str, tuple[int, ...]]
    #: ``(matrices, rows, cols)`` of each plan item (a matrix, or a split stack's range).
    item_shapes: dict[str, tuple[int, int, int]]
    #: The dimension tensor parallelism splits each tp-sharded matrix along.
    split_dims: dict[str, int]
    #: Matrices stored transposed (their output rows are columns).
    transposed: frozenset[str]
    plan: OwnerPlan
    spans: dict[str, list[Span]]
    tp: int
    shard: int
    replicas: int
    mode: str
    accum: int
    no_sync: bool
    #: ``no_sync(scope="replicas")``: every micro-batch reduces inside its replica.
    inside_only: bool
    #: Synchronised backwards per step inside a replica, and between replicas.
    synced: int
    replica_synced: int
    param_bytes: int
    reduce_bytes: int
    ns_steps: int
    ns_dtype: torch.dtype
    ns_gram: bool
    device: torch.device
    max_workspace_bytes: int
    hardware: Hardware
    parameters: int
    dedicated_elements: int

    @functools.cached_property
    def fsdp2_units(self) -> int:
        """FSDP2's units on the same model: each hook boundary's layer, and the root."""
        return len(self.spans) + 1

    @functools.cached_property
    def fsdp2_reduce_calls(self) -> int:
        """FSDP2's all-reduces between replicas of the other parameters, per step."""
        return self.fsdp2_units * self.replica_synced

    @property
    def fsdp2_calls(self) -> int:
        """FSDP2's collective calls per step per rank: gathers, reduces, all-reduces."""
        gathers = self.fsdp2_units * self.accum * (2 if self.mode == "z3" else 1)
        all_reduces = self.fsdp2_reduce_calls if self.replicas > 1 else 0
        return gathers + self.fsdp2_units * self.synced + all_reduces

    @property
    def fsdp2_reduce_seconds(self) -> float:
        """FSDP2's all-reduce between replicas per step: its bytes and its calls' latency."""
        if self.replicas == 1:
            return 0.0
        per_rank = self.parameters / (self.shard * self.tp) * self.reduce_bytes
        ring = 2 * (self.replicas - 1) / self.replicas * per_rank * self.replica_synced
        latency = self.fsdp2_reduce_calls * self.hardware.latency_us * 1e-6
        return ring / (self.hardware.network_gbps * 1e9) + latency

    @functools.cached_property
    def gram_restarts(self) -> int:
        """Restarts of the Gram iteration at these steps and dtype."""
        return len(gram_restarts(self.ns_steps, self.ns_dtype))

    @functools.cached_property
    def boundaries_held(self) -> list[int]:
        """Per shard position, the boundaries in which it owns matrices."""
        held = [0] * self.shard
        for spans in self.spans.values():
            for owner in {span.owner for span in spans}:
                held[owner] += 1
        return held

    @functools.cached_property
    def all_spans(self) -> list[Span]:
        """Every boundary's spans, back to back in boundary order."""
        return [span for boundary in self.spans.values() for span in boundary]

    @functools.cached_property
    def latency(self) -> float:
        """Seconds one collective call costs on top of its bytes."""
        return self.hardware.latency_us * 1e-6

    @functools.cached_property
    def _local_elements(self) -> dict[tuple[str, int], int]:
        return {}

    def local(self, name: str, t: int) -> int:
        """Elements of ``name``'s shard at tp position ``t`` (a plan item name or fqn)."""
        known = self._local_elements.get((name, t))
        if known is None:
            known = self._local_elements[name, t] = self._count_local(name, t)
        return known

    def _count_local(self, name: str, t: int) -> int:
        fqn = name.split("[", 1)[0]
        matrices, rows, cols = self.item_shapes[name]
        dim = self.split_dims.get(fqn)
        if dim is None:
            return matrices * rows * cols
        length = (rows, cols)[dim]
        chunk = -(-length // self.tp)
        part = max(0, min(chunk, length - t * chunk))
        return matrices * part * ((cols, rows)[dim])

    @functools.cached_property
    def narrow_masters(self) -> bool:
        """Whether masters live once per world: under HSDP with a forward dtype narrower
        than float32, the replicas that do not step a matrix hold it in that dtype."""
        return self.replicas > 1 and self.param_bytes < FLOAT32

    def update_nbytes(self, name: str, t: int) -> int:
        """Bytes of ``name``'s step between replicas: its new values in the forward's
        dtype where masters live once per world, else its header and update."""
        if self.narrow_masters:
            return values_nbytes(self.local(name, t), self.param_bytes)
        _, rows, cols = self.item_shapes[name]
        out = cols if name.split("[", 1)[0] in self.transposed else rows
        return record_nbytes(self.local(name, t), out, self.ns_dtype, torch.float32)

    def tp_workers(self) -> dict[str, int]:
        """The tp rank that orthogonalizes each tp-sharded matrix, spread over its owner's
        tp group as the optimizer does."""
        workers: dict[str, int] = {}
        by_position: dict[int, list[str]] = {}
        for n in self.shapes:
            if n in self.split_dims and n in self.plan.owners:
                by_position.setdefault(self.plan.owners[n], []).append(n)
        for position in range(self.shard):
            sharded = by_position.get(position, [])
            costs = [newton_schulz_cost(self.shapes[n]) for n in sharded]
            workers.update(zip(sharded, spread_over_tp(costs, self.tp), strict=True))
        return workers


@dataclass(frozen=True)
class _Position:
    """What every replica's rank at one shard position and tp position holds alike."""

    shard_tallies: dict[str, Tally]
    buffer_bytes: int
    accumulator_bytes: int
    reduce_buffer_bytes: int


def rank_plans(setup: ClusterSetup) -> list[RankPlan]:
    """Every rank's plan, in rank order."""
    tp_worker = setup.tp_workers()
    names_by: list[list[str]] = [[] for _ in range(setup.shard)]
    for n in setup.item_shapes:
        names_by[setup.plan.owners[n]].append(n)
    all_spans = setup.all_spans
    ranks = []
    for t in range(setup.tp):
        span_elements = [sum(setup.local(n, t) for n in s.names) for s in all_spans]
        position = _position(setup, t, span_elements)
        elements_by = [0] * setup.shard
        for elements, span in zip(span_elements, all_spans, strict=True):
            elements_by[span.owner] += elements
        replicate_by = [
            _replicate_tallies(setup, t, p, names_by[p], elements_by[p]) for p in range(setup.shard)
        ]
        # What a shard position sends between replicas is the same in every replica.
        update_by = [
            sum(setup.update_nbytes(n, t) for n in names_by[p]) if setup.replicas > 1 else 0
            for p in range(setup.shard)
        ]
        for dp_rank in range(setup.replicas * setup.shard):
            replica, shard = divmod(dp_rank, setup.shard)
            mine = [n for n in names_by[shard] if setup.plan.workers[n] == replica]
            ranks.append(
                _rank_plan(
                    setup,
                    dp_rank * setup.tp + t,
                    (replica, shard, t),
                    mine,
                    [n for n in mine if tp_worker.get(n, t) == t],
                    [n for n in mine if n in tp_worker],
                    position,
                    replicate_by[shard],
                    elements_by[shard],
                    update_by[shard],
                )
            )
    ranks.sort(key=lambda r: r.rank)
    return ranks


def _position(setup: ClusterSetup, t: int, span_elements: list[int]) -> _Position:
    """The collectives and buffers of a shard position's ranks at tp position ``t``."""
    shard_tallies: dict[str, Tally] = {}
    rounds = 1 if setup.mode == "z2" else 2 * setup.accum  # gathers of every span per step
    if setup.shard > 1:
        elements = iter(span_elements)  # all_spans is spans' lists back to back
        shard_tallies = boundary_calls(
            [[(s.owner, next(elements)) for s in b] for b in setup.spans.values()],
            rounds,
            setup.synced,
        )
    boundary_elements = [
        sum(setup.local(n, t) for span in setup.spans[b] for n in span.names) for b in setup.spans
    ]
    local_p_m = sum(span_elements)
    if setup.mode == "z2":
        buffer_bytes = local_p_m * setup.param_bytes
    else:  # the boundary running and the one prefetched
        pairs = [a + b for a, b in itertools.pairwise(boundary_elements)]
        buffer_bytes = max(pairs or boundary_elements or [0]) * setup.param_bytes
    full_accumulator = setup.no_sync and setup.accum > 1 and not setup.inside_only
    window = REDUCES_IN_FLIGHT + 2  # boundaries whose float32 reduce inputs are alive
    reduce_window = max(
        (sum(boundary_elements[i : i + window]) for i in range(len(boundary_elements))),
        default=0,
    )
    return _Position(
        shard_tallies,
        buffer_bytes,
        local_p_m * FLOAT32 if full_accumulator else 0,
        reduce_window * FLOAT32,
    )


def _replicate_tallies(
    setup: ClusterSetup, t: int, position: int, names: list[str], owned_elements: int
) -> dict[str, Tally]:
    """A shard position's collectives between replicas: its updates after the step, and
    its owned gradients' reduce-scatter per synchronised backward."""
    if setup.replicas == 1 or not names:
        return {}
    tallies = replica_update_calls(
        [(setup.local(n, t), setup.update_nbytes(n, t), setup.plan.workers[n]) for n in names],
        setup.replicas,
    )
    holding = setup.boundaries_held[position]
    tallies["reduce_scatter"] = Tally(
        holding * setup.replica_synced, owned_elements * setup.replica_synced
    )
    return tallies


def _rank_plan(
    setup: ClusterSetup,
    rank: int,
    where: tuple[int, int, int],
    mine: list[str],
    orthogonalized: list[str],
    sharded_mine: list[str],
    position: _Position,
    replicate_tallies: dict[str, Tally],
    owned_elements: int,
    owned_update_bytes: int,
) -> RankPlan:
    """One rank: ``mine`` are the items it steps, ``orthogonalized`` those it iterates
    itself, ``sharded_mine`` its tp-sharded ones; ``where`` is (replica, shard, tp)."""
    replica, shard, t = where
    stepped = sum(setup.local(n, t) for n in mine)
    held_bytes = setup.param_bytes if setup.narrow_masters else FLOAT32
    split, split_flops, split_seconds = _split_share(setup, replica * setup.shard + shard)
    whole = tuple(sorted(setup.item_shapes[n] for n in orthogonalized if n not in setup.plan.split))
    flops = split_flops + _iteration_flops(
        whole, setup.ns_steps, setup.ns_gram, setup.ns_dtype, setup.gram_restarts
    )
    tensor_tallies: dict[str, Tally] = {}
    if sharded_mine:
        whole = sum(math.prod(setup.item_shapes[n]) for n in sharded_mine)
        tensor_tallies = {
            "gather": Tally(len(sharded_mine), whole),
            "scatter": Tally(len(sharded_mine), whole),
        }
    update, reduce, update_bytes = _replica_seconds(
        setup, owned_update_bytes, owned_elements, replicate_tallies
    )
    # tp: each sharded matrix the rank steps is gathered in float32 and its update
    # scattered back, inside the node, while the step waits.
    tp_moved = sum(tally.elements for tally in tensor_tallies.values()) * FLOAT32
    tp_calls = sum(tally.count for tally in tensor_tallies.values())
    dims = (setup.shard > 1) + (setup.replicas > 1) + (setup.tp > 1)
    return RankPlan(
        rank=rank,
        replica=replica,
        shard=shard,
        ns_flops=flops,
        ns_seconds=flops / (setup.hardware.ns_tflops * 1e12),
        update_seconds=update,
        master_bytes=stepped * FLOAT32 + (owned_elements - stepped) * held_bytes,
        momentum_bytes=stepped * FLOAT32,
        workspace_bytes=workspace_bytes(
            tuple(sorted(setup.item_shapes[n] for n in orthogonalized)),
            setup.ns_dtype,
            setup.device,
            setup.max_workspace_bytes,
            setup.ns_gram,
        ),
        buffer_bytes=position.buffer_bytes,
        # scope="replicas": the owner holds the sums of its own matrices.
        accumulator_bytes=(
            owned_elements * FLOAT32
            if setup.inside_only and setup.accum > 1
            else position.accumulator_bytes
        ),
        reduce_buffer_bytes=position.reduce_buffer_bytes,
        shard_collectives=position.shard_tallies,
        replicate_collectives=dict(replicate_tallies),
        tp=t,
        tensor_collectives=tensor_tallies,
        replicate_reduce_seconds=reduce,
        update_bytes=update_bytes,
        tp_seconds=tp_moved / (setup.hardware.node_gbps * 1e9) + tp_calls * setup.latency,
        agreement_seconds=dims * setup.latency,
        split_collectives=split,
        split_seconds=split_seconds,
    )


@functools.lru_cache(maxsize=1024)
def _iteration_flops(
    shapes: tuple[tuple[int, int, int], ...],
    ns_steps: int,
    ns_gram: bool,
    ns_dtype: torch.dtype,
    restarts: int,
) -> int:
    """Newton-Schulz FLOPs of one rank's whole items (their shapes, sorted): remembered,
    since thousands of ranks step the same few sets of shapes."""
    flops = 0
    for shape in shapes:
        gram = uses_gram(shape[1], shape[2], ns_gram, ns_dtype)
        flops += newton_schulz_flops(shape, ns_steps, gram, restarts if gram else 0)
    return flops


def _split_share(setup: ClusterSetup, position: int) -> tuple[dict[str, Tally], int, float]:
    """A rank's part in its block's split iterations (``ns_split``): its collectives, its
    FLOPs and the seconds the collectives take. Blocks of up to 8 ranks are taken to be
    inside a node; larger ones send between nodes."""
    plan, size = setup.plan, setup.plan.ns_split
    if not plan.split:
        return {}, 0, 0.0
    block = block_of(position, size)
    names = [
        n for n in setup.item_shapes if n in plan.split
        and plan.workers[n] * setup.shard + plan.owners[n] in block
    ]  # fmt: skip
    if not names:
        return {}, 0, 0.0
    itemsize = torch.finfo(setup.ns_dtype).bits // 8
    rate = (setup.hardware.node_gbps if size <= 8 else setup.hardware.network_gbps) * 1e9
    slices = grams = flops = 0
    moved = 0.0
    for n in names:
        _, rows, cols = setup.item_shapes[n]
        m, long_side = sorted((rows, cols))
        width = math.ceil(long_side / size)
        slices += m * width
        grams += m * m
        flops += 2 * setup.ns_steps * split_iteration_cost((rows, cols), size)
        # The stepping rank scatters and gathers every other member's slice; each
        # iteration's all-reduce is a ring over the block.
        moved += 2 * (size - 1) * m * width * itemsize
        moved += setup.ns_steps * 2 * (size - 1) / size * m * m * itemsize
    steps = setup.ns_steps
    tallies = {
        "scatter": Tally(len(names), slices),
        "all_reduce": Tally(len(names) * steps, grams * steps),
        "gather": Tally(len(names), slices),
    }
    calls = sum(t.count for t in tallies.values())
    return tallies, flops, moved / rate + calls * setup.latency


def _replica_seconds(
    setup: ClusterSetup,
    update_bytes: int,
    owned_elements: int,
    replicate_tallies: dict[str, Tally],
) -> tuple[float, float, int]:
    """``(update seconds, backward reduce seconds, update bytes)`` between replicas;
    ``update_bytes`` are the rank's owned records' (`ClusterSetup.update_nbytes`)."""
    if setup.replicas == 1:
        return 0.0, 0.0, 0
    share = (setup.replicas - 1) / setup.replicas
    rate = setup.hardware.network_gbps * 1e9
    update_calls = sum(
        replicate_tallies[k].count for k in ("broadcast", "all_gather") if k in replicate_tallies
    )
    update = update_bytes * share / rate + update_calls * setup.latency
    # Backward: the owned gradients' reduce-scatter, and FSDP2's all-reduce of this
    # rank's shard of the other parameters.
    rest = (setup.parameters - setup.dedicated_elements) / (setup.shard * setup.tp)
    moved = (owned_elements * share + 2 * share * rest) * setup.reduce_bytes * setup.replica_synced
    scattered = replicate_tallies.get("reduce_scatter", Tally()).count
    reduce = moved / rate + (scattered + setup.fsdp2_reduce_calls) * setup.latency
    return update, reduce, update_bytes
