"""`plan_cluster`: what DMuon costs each rank of a cluster, from the owner plan alone.

Everything follows from the plan that `dmuon.dedicate_params` makes (`plan_dedication`, the
same code) and from the library's own rules:

- **Newton-Schulz FLOPs** of a rank: its plan load (`dmuon.plan_owners`'s multiply-adds
  per iteration) x 2 x the iteration count, what ``FlopCounterMode`` counts in
  ``optimizer.step()`` for the standard iteration;
- **collectives**: per hook boundary one call to send its matrices (an all-gather of its
  owners' parts, a broadcast for one owner) and one to sum their gradients (a
  reduce-scatter, a reduce for one owner), as many times as Z2/Z3 and accumulation say;
  across replicas, one reduce-scatter per boundary the rank owns matrices of per
  synchronised backward and, per step, one all-gather (a broadcast when one replica sends
  all of it) per chunk of updates (`update_chunks`): what ``dmuon.comm_audit``
  counts;
- **memory**: masters of the matrices a shard position owns (float32 where the rank steps
  them; under HSDP with a narrower ``param_bytes``, in that width on the other replicas'
  owners), momentum of those the rank steps, the Newton-Schulz workspace
  (`dmuon.optim.workspace_nbytes`, within the optimizer's cap), the packed buffers, the
  ``no_sync`` accumulator and the reduce buffers (float32, of the ``REDUCES_IN_FLIGHT + 2``
  boundaries whose reduces backward keeps in flight).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from dmuon._ownership.planner import OwnerPlan, SplitStacks
from dmuon._ownership.selection import plan_selected, select_with_boundaries
from dmuon.optim._blocks import DEFAULT_MAX_WORKSPACE_BYTES, check_max_workspace_bytes
from dmuon.plan._collectives import (
    boundary_spans,
    plan_items,
    tp_split_dims,
)
from dmuon.plan._hardware import Hardware, parse_hardware
from dmuon.plan._memory import (
    activation_bytes_per_token,
    dmuon_memory_bytes,
    fsdp2_memory_bytes,
    rank_memory_bytes,
)
from dmuon.plan._ranks import ClusterSetup, RankPlan, rank_plans
from dmuon.plan._shard_traffic import (
    NO_SHARD_TRAFFIC,
    ShardTraffic,
    shard_traffic,
    unit_elements,
)
from dmuon.plan._warnings import plan_warnings

GIB = 1024**3
FLOAT32 = 4

#: Dedication plans already made for one model, while `reusing_dedications` is open.
_DEDICATIONS: contextvars.ContextVar[dict[tuple[Any, ...], Any] | None] = contextvars.ContextVar(
    "dmuon_plan_dedications", default=None
)


@contextlib.contextmanager
def reusing_dedications() -> Iterator[None]:
    """Inside, `plan_cluster` plans a model's owners once per (shard size, replicas, ...):
    the modes and micro-batch counts of one layout share them. For planning many layouts
    of one model that is not changed meanwhile (``--recommend``)."""
    token = _DEDICATIONS.set({})
    try:
        yield
    finally:
        _DEDICATIONS.reset(token)


def _reused(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """``make()``, or what it returned for ``key`` inside `reusing_dedications`."""
    cache = _DEDICATIONS.get()
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


@dataclass(frozen=True)
class ClusterPlan:
    """A model on a cluster, per rank and in total (see `plan_cluster`)."""

    world: int
    shard_size: int
    replicas: int
    mode: str
    accum: int
    no_sync: bool
    tokens_per_step: int
    ns_steps: int
    hardware: Hardware
    matrices: int
    dedicated_elements: int
    parameters: int
    active_parameters: int
    boundaries: int
    fsdp2_calls: int
    forward_backward_seconds: float
    ranks: list[RankPlan]
    owner_plan: OwnerPlan
    warnings: list[str]
    #: The Gram iteration (``dmuon.Muon(ns_gram=True)``) where it applies.
    ns_gram: bool = False
    #: Bytes per element of the gradients summed between replicas (both optimizers).
    reduce_bytes: int = FLOAT32
    #: Seconds FSDP2 + AdamW's all-reduce between replicas takes per step (HSDP).
    fsdp2_reduce_seconds: float = 0.0
    #: ``dmuon.no_sync(scope=...)`` of the accumulating micro-batches.
    no_sync_scope: str = "all"
    #: Activation bytes per token of a micro-batch (`dmuon.plan._memory`; 0: unknown).
    activation_bytes_per_token: int = 0
    #: Ranks per block that may share a matrix's iteration (``dedicate_params(ns_split=)``).
    ns_split: int = 1
    #: The gathers and reduce-scatters inside a shard group, per FSDP2 unit against its
    #: compute (`dmuon.plan._shard_traffic`): the same on both sides.
    shard_traffic: ShardTraffic = NO_SHARD_TRAFFIC

    @property
    def shard_overhead(self) -> float:
        """The shard group's traffic longer than the compute it overlaps, over
        forward+backward (both sides pay it)."""
        return self.shard_traffic.exposed_seconds / self.forward_backward_seconds

    @functools.cached_property
    def memory_bytes(self) -> int:
        """DMuon's memory on its fullest rank (`dmuon.plan._memory`)."""
        return dmuon_memory_bytes(self, max(self.ranks, key=rank_memory_bytes))

    @functools.cached_property
    def fsdp2_memory_bytes(self) -> int:
        """FSDP2 + AdamW's memory per rank for the same model and mesh."""
        return fsdp2_memory_bytes(self)

    @property
    def fits(self) -> bool:
        """Whether DMuon's fullest rank fits the accelerator's memory."""
        return self.memory_bytes <= self.hardware.memory_gib * GIB

    @property
    def busiest(self) -> RankPlan:
        """The rank with the longest Newton-Schulz time."""
        return max(self.ranks, key=lambda r: (r.ns_seconds, -r.rank))

    @property
    def ns_imbalance(self) -> float:
        """The busiest rank's Newton-Schulz time over the mean rank's, over every rank of
        the world (1.0: perfect balance; ranks that step nothing count)."""
        mean = sum(r.ns_seconds for r in self.ranks) / len(self.ranks)
        return self.busiest.ns_seconds / mean if mean > 0 else 1.0

    @property
    def ns_overhead(self) -> float:
        """The busiest rank's Newton-Schulz time over forward+backward's."""
        return self.busiest.ns_seconds / self.forward_backward_seconds

    @property
    def optimizer_overhead(self) -> float:
        """The slowest rank's optimizer step (Newton-Schulz, tensor parallelism's gathers
        and scatters, the non-finite agreement) over forward+backward's."""
        slowest = max(
            r.ns_seconds + r.tp_seconds + r.split_seconds + r.agreement_seconds for r in self.ranks
        )
        return slowest / self.forward_backward_seconds

    @property
    def update_overhead(self) -> float:
        """What the updates between replicas leave exposed, over forward+backward
        (0 on a 1-D mesh): they travel during the next step's first forward, so only the
        part longer than that forward shows."""
        window = self.forward_backward_seconds / 3 / self.accum
        exposed = max(max(0.0, r.update_seconds - window) for r in self.ranks)
        return exposed / self.forward_backward_seconds

    @property
    def reduce_overhead(self) -> float:
        """What the traffic between replicas during backward leaves exposed, over
        forward+backward (0 on a 1-D mesh): the part longer than backward."""
        window = 2 * self.forward_backward_seconds / 3
        exposed = max(max(0.0, r.replicate_reduce_seconds - window) for r in self.ranks)
        return exposed / self.forward_backward_seconds

    @property
    def step_overhead(self) -> float:
        """DMuon's step beyond forward+backward, over forward+backward: the slowest rank's
        optimizer step, the exposed traffic between replicas and inside the shard group."""
        return (
            self.optimizer_overhead
            + self.update_overhead
            + self.reduce_overhead
            + self.shard_overhead
        )

    @property
    def fsdp2_overhead(self) -> float:
        """FSDP2 + AdamW's step beyond forward+backward, over forward+backward, modelled
        the same way: its all-reduce between replicas overlaps backward, and the part
        longer than backward shows (AdamW's own step is taken as free); its traffic inside
        the shard group is DMuon's (`shard_overhead`)."""
        window = 2 * self.forward_backward_seconds / 3
        between = max(0.0, self.fsdp2_reduce_seconds - window) / self.forward_backward_seconds
        return between + self.shard_overhead

    @property
    def step_ratio(self) -> float:
        """DMuon's step time over FSDP2 + AdamW's on the same model and mesh."""
        return (1 + self.step_overhead) / (1 + self.fsdp2_overhead)

    @property
    def calls(self) -> int:
        """The most collective calls per optimizer step any rank issues for DMuon."""
        return max(r.calls for r in self.ranks)

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-ready (``--json``)."""
        ranks = []
        for rank in self.ranks:
            entry = asdict(rank)
            entry["added_bytes"] = rank.added_bytes
            entry["calls"] = rank.calls
            ranks.append(entry)
        return {
            "world": self.world,
            "shard_size": self.shard_size,
            "replicas": self.replicas,
            "mode": self.mode,
            "accum": self.accum,
            "no_sync": self.no_sync,
            "no_sync_scope": self.no_sync_scope,
            "tokens_per_step": self.tokens_per_step,
            "ns_steps": self.ns_steps,
            "ns_gram": self.ns_gram,
            "ns_split": self.ns_split,
            "split_matrices": len(self.owner_plan.split),
            "hardware": asdict(self.hardware),
            "matrices": self.matrices,
            "dedicated_elements": self.dedicated_elements,
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
            "boundaries": self.boundaries,
            "fsdp2_calls": self.fsdp2_calls,
            "forward_backward_seconds": self.forward_backward_seconds,
            "ns_overhead": self.ns_overhead,
            "optimizer_overhead": self.optimizer_overhead,
            "update_overhead": self.update_overhead,
            "reduce_overhead": self.reduce_overhead,
            "shard_overhead": self.shard_overhead,
            "shard_seconds": self.shard_traffic.seconds,
            "shard_crosses_nodes": self.shard_traffic.crosses_nodes,
            "step_overhead": self.step_overhead,
            "fsdp2_overhead": self.fsdp2_overhead,
            "step_ratio": self.step_ratio,
            "memory_bytes": self.memory_bytes,
            "fsdp2_memory_bytes": self.fsdp2_memory_bytes,
            "activation_bytes_per_token": self.activation_bytes_per_token,
            "reduce_bytes": self.reduce_bytes,
            "calls": self.calls,
            "ns_imbalance": self.ns_imbalance,
            "ranks": ranks,
            "warnings": list(self.warnings),
        }


def plan_cluster(
    model: nn.Module,
    world: int,
    shard_size: int | None = None,
    *,
    tokens_per_step: int = 4_000_000,
    mode: str = "z3",
    accum: int = 1,
    no_sync: bool = False,
    hardware: Hardware | str = "h100",
    active_parameters: int | None = None,
    ns_steps: int = 5,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_gram: bool = False,
    device_type: str = "cuda",
    param_bytes: int = FLOAT32,
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
    split_expert_stacks: SplitStacks = "auto",
    tp: int = 1,
    tp_plan: Mapping[str, str] | None = None,
    reduce_bytes: int = FLOAT32,
    no_sync_scope: str = "all",
    ns_split: int = 1,
) -> ClusterPlan:
    """Plan ``model`` (built on the meta device, or a real one: nothing is changed) on a
    cluster of ``world`` ranks: per rank, what DMuon adds in memory, Newton-Schulz work and
    collectives, and the optimizer step's overhead against forward+backward.

    Args:
        model: The model, before `dmuon.dedicate_params` (its default predicate selects).
        world: Ranks in all (data-parallel ranks x ``tp``).
        shard_size: Data-parallel ranks per replica of an HSDP mesh (``world / tp /
            shard_size`` replicas); ``None``: every data-parallel rank (a 1-D mesh).
        tokens_per_step: Tokens of one optimizer step over the whole cluster.
        mode: ``"z2"`` or ``"z3"`` (``dedicate_params(reshard_after_forward=...)``).
        accum: Micro-batches per optimizer step.
        no_sync: Whether the micro-batches but the last run under `dmuon.no_sync`.
        hardware: A `Hardware`, or a preset name (``"h100"``, ``"h200"``, ``"b200"``).
        active_parameters: Parameters a token passes through (forward+backward is taken as
            6 x this x tokens); ``None``: every parameter of ``model``.
        ns_steps: Newton-Schulz iterations.
        ns_dtype: The iteration dtype (the workspace's); bfloat16 on GPUs by default.
        ns_gram: ``dmuon.Muon(ns_gram=...)``: the Gram iteration, for the matrices
            `dmuon.optim.uses_gram` gives it (float32 or wider, long side at least twice
            the short one), with its own FLOP count (`dmuon.plan_owners` still balances
            the standard iteration's cost).
        device_type: Where the iteration runs (``"cuda"``, or ``"cpu"``: the workspace's
            layout differs).
        param_bytes: Bytes per element of the packed buffers (4 for float32, 2 with
            ``param_dtype=torch.bfloat16``).
        max_workspace_bytes: `dmuon.Muon`'s cap on the Newton-Schulz workspace.
        split_expert_stacks: As for `dmuon.dedicate_params`.
        tp: Tensor-parallel size: each data-parallel rank is a group of ``tp`` ranks, and
            the matrices ``tp_plan`` shards are dedicated per shard (see
            `dmuon._ownership.tp_integration`). Ranks are numbered
            ``(replica * shard_size + shard) * tp + tp_rank``.
        tp_plan: ``{module pattern: style}`` as in a Hugging Face config's
            ``base_model_tp_plan`` (``"layers.*.self_attn.q_proj": "colwise"``); a
            ``colwise`` weight is split by rows, a ``rowwise`` one by columns, others stay
            whole. ``None`` with ``tp > 1``: the model config's ``base_model_tp_plan``.
        reduce_bytes: Bytes per element of the gradients summed between replicas, for
            DMuon and FSDP2 + AdamW alike (4: float32; 2: ``reduce_dtype=torch.bfloat16``).
        no_sync_scope: ``dmuon.no_sync(scope=...)`` with ``no_sync``: ``"all"``, or
            ``"replicas"`` (every micro-batch reduces inside its replica, the owners hold
            their matrices' sums, and one reduce-scatter crosses replicas per step; FSDP2
            + AdamW then uses ``set_requires_all_reduce(False)`` alike).
        ns_split: ``dedicate_params(ns_split=...)``: ranks per block that may share a
            matrix's iteration (a divisor of the shard size; not with ``tp``).

    Returns:
        The `ClusterPlan`.

    Raises:
        ValueError: A layout that does not divide, an unknown mode or hardware, or what
            `dmuon.dedicate_params` would refuse.
    """
    dp_world, shard = _check_layout(
        world, shard_size, tp, mode, accum, ns_steps, no_sync_scope, ns_split
    )
    check_max_workspace_bytes(max_workspace_bytes)
    if isinstance(hardware, str):
        hardware = parse_hardware(hardware)
    replicas = dp_world // shard
    selected, boundaries, plan = _dedication(model, shard, replicas, split_expert_stacks, ns_split)
    shapes = {fqn: tuple(int(d) for d in p.shape) for fqn, _, _, p, _, _ in selected}
    p_m = sum(math.prod(s) for s in shapes.values())
    spans = _reused(("spans", id(plan)), lambda: boundary_spans(shapes, boundaries, plan))
    inside_only = no_sync and no_sync_scope == "replicas"
    #: Synchronised backwards per step inside a replica, and between replicas.
    synced = accum if inside_only else 1 if no_sync else accum
    replica_synced = 1 if no_sync else accum
    parameters = _reused(("parameters", id(model)), lambda: _parameter_count(model))
    active = parameters if active_parameters is None else active_parameters
    forward_backward = (
        6 * active * tokens_per_step / (hardware.mfu * hardware.peak_tflops * 1e12 * world)
    )
    setup = ClusterSetup(
        shapes=shapes,
        item_shapes=plan_items(shapes, plan),
        split_dims=tp_split_dims(model, shapes, tp, tp_plan),
        transposed=frozenset(fqn for fqn, _, _, _, is_transposed, _ in selected if is_transposed),
        plan=plan,
        spans=spans,
        tp=tp,
        shard=shard,
        replicas=replicas,
        mode=mode,
        accum=accum,
        no_sync=no_sync,
        inside_only=inside_only,
        synced=synced,
        replica_synced=replica_synced,
        param_bytes=param_bytes,
        reduce_bytes=reduce_bytes,
        ns_steps=ns_steps,
        ns_dtype=ns_dtype,
        ns_gram=ns_gram,
        device=torch.device(device_type),
        max_workspace_bytes=max_workspace_bytes,
        hardware=hardware,
        parameters=parameters,
        dedicated_elements=p_m,
    )
    result = ClusterPlan(
        world=world,
        shard_size=shard,
        replicas=replicas,
        mode=mode,
        accum=accum,
        no_sync=no_sync,
        tokens_per_step=tokens_per_step,
        ns_split=ns_split,
        ns_steps=ns_steps,
        hardware=hardware,
        matrices=sum(int(s[0]) if len(s) == 3 else 1 for s in shapes.values()),
        dedicated_elements=p_m,
        parameters=parameters,
        active_parameters=active,
        boundaries=len(spans),
        fsdp2_calls=setup.fsdp2_calls,
        forward_backward_seconds=forward_backward,
        ranks=rank_plans(setup),
        owner_plan=plan,
        warnings=[],
        ns_gram=ns_gram,
        reduce_bytes=reduce_bytes,
        no_sync_scope=no_sync_scope,
        activation_bytes_per_token=activation_bytes_per_token(model),
        fsdp2_reduce_seconds=setup.fsdp2_reduce_seconds,
        shard_traffic=_shard_group(model, boundaries, setup, forward_backward),
    )
    result.warnings.extend(plan_warnings(result))
    return result


def _dedication(
    model: nn.Module, shard: int, replicas: int, split_expert_stacks: SplitStacks, ns_split: int
) -> Any:
    """`dmuon._ownership.selection.plan_dedication` of the layout, in its two parts: the
    selection once per model and the owners once per layout inside `reusing_dedications`."""
    selected, boundaries = _reused(("selection", id(model)), lambda: select_with_boundaries(model))
    plan = _reused(
        ("owners", id(model), shard, replicas, split_expert_stacks, ns_split),
        lambda: plan_selected(selected, boundaries, shard, replicas, split_expert_stacks, ns_split),
    )
    return selected, boundaries, plan


def _parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _shard_group(
    model: nn.Module, boundaries: Mapping[str, str], setup: ClusterSetup, forward_backward: float
) -> ShardTraffic:
    """The shard group's gathers and reduce-scatters against each unit's compute."""
    return shard_traffic(
        _reused(("units", id(model)), lambda: unit_elements(model, boundaries)),
        shard=setup.shard,
        tp=setup.tp,
        mode=setup.mode,
        accum=setup.accum,
        synced=setup.synced,
        forward_backward_seconds=forward_backward,
        gather_bytes=setup.param_bytes,
        reduce_bytes=setup.reduce_bytes,
        hardware=setup.hardware,
    )


def _check_layout(
    world: int,
    shard_size: int | None,
    tp: int,
    mode: str,
    accum: int,
    ns_steps: int,
    no_sync_scope: str,
    ns_split: int = 1,
) -> tuple[int, int]:
    """``(data-parallel ranks, shard size)`` of a layout `plan_cluster` can plan, or
    ``ValueError`` saying why not (what `dmuon.dedicate_params` would refuse too)."""
    if world < 1:
        raise ValueError(f"the world size must be at least 1 rank, got {world}")
    if ns_steps < 1:
        raise ValueError(f"ns_steps must be at least 1 (5 is usual), got {ns_steps}")
    if tp < 1:
        raise ValueError(f"the tensor-parallel size must be at least 1, got {tp}")
    if world % tp:
        raise ValueError(f"the tensor-parallel size {tp} must divide the world size {world}")
    if ns_split > 1 and tp > 1:
        raise ValueError(
            "ns_split does not combine with tensor parallelism (dedicate_params refuses it); "
            "pass ns_split=1 with tp"
        )
    dp_world = world // tp
    shard = dp_world if shard_size is None else shard_size
    if shard < 1 or dp_world % shard:
        ranks = f"world size {world}" if tp == 1 else f"{dp_world} data-parallel ranks"
        raise ValueError(
            f"the shard size {shard} must divide the {ranks} (HSDP runs world / tp / "
            "shard-size replicas; a 1-D mesh has shard size = world / tp)"
        )
    if tp > 1 and shard_size is not None and shard_size * tp < world:
        raise ValueError(
            f"tensor parallelism ({tp}) with HSDP ({world // (shard_size * tp)} replicas of "
            f"{shard_size}): a 3-D mesh, which dmuon.dedicate_params refuses; plan a "
            "(dp, tp) mesh (no --shard-size) or HSDP without --tp"
        )
    if mode not in ("z2", "z3"):
        raise ValueError(f"mode must be 'z2' or 'z3', got {mode!r}")
    if accum < 1:
        raise ValueError(f"accum must be at least 1, got {accum}")
    if no_sync_scope not in ("all", "replicas"):
        raise ValueError(f'no_sync_scope is "all" or "replicas", not {no_sync_scope!r}')
    return dp_world, shard
