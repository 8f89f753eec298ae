"""Memory per rank of a planned layout, DMuon's and FSDP2 + AdamW's, counted the same way.

Both sides hold, per rank:

* the parameters FSDP2 shards over the ``shard_size x tp`` ranks of a replica, each with
  a float32 value, a float32 gradient and AdamW's two float32 moments: 16 bytes an
  element (for DMuon, only the parameters it does not dedicate);
* the unsharded parameters of the layer running and the one prefetched, in bfloat16;
* the activations of one micro-batch: `ACTIVATION_BYTES` per token, layer and hidden unit
  (bfloat16, no recomputation, fused attention), when the model's config gives its hidden
  size and number of layers;
* under ``no_sync`` (scope ``"all"``), the unsharded float32 gradients FSDP2 keeps.

DMuon adds, per rank, what `dmuon.plan.RankPlan` counts (the masters: float32 where the
rank steps them, the forward's dtype on the other replicas' owners under HSDP; momentum,
the Newton-Schulz workspace, the packed buffers, the accumulator, the reduce buffers), the
averaged float32 gradients of the matrices it steps (as many as its momentum) and, under
HSDP, the step's updates on their way between replicas (every replica's section of the
rank's chunks).
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class RankPlan(Protocol):
    """What this module reads of a `dmuon.plan.RankPlan`."""

    master_bytes: int
    momentum_bytes: int
    update_bytes: int

    @property
    def added_bytes(self) -> int: ...


class ClusterPlan(Protocol):
    """What this module reads of a `dmuon.plan.ClusterPlan`."""

    world: int
    shard_size: int
    replicas: int
    boundaries: int
    tokens_per_step: int
    accum: int
    no_sync: bool
    no_sync_scope: str
    activation_bytes_per_token: int
    parameters: int
    dedicated_elements: int


#: Bytes of activations per token, layer and hidden unit kept for backward (bfloat16,
#: without recomputation, with a fused attention kernel: no sequence-squared term).
ACTIVATION_BYTES = 34
#: Bytes per element of FSDP2's sharded state with AdamW: float32 value, gradient, moments.
SHARDED_STATE_BYTES = 16


def activation_bytes_per_token(model: nn.Module) -> int:
    """`ACTIVATION_BYTES` x hidden size x layers, from the model's Hugging Face config
    (0 when it has none: activations are then left out, and the plan says so)."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return 0
    return ACTIVATION_BYTES * hidden * layers


def _common(plan: ClusterPlan, sharded: int) -> float:
    """What both sides hold for ``sharded`` elements that FSDP2 shards, with the layer
    buffers and the activations."""
    tp = plan.world // (plan.shard_size * plan.replicas)
    per_rank = sharded / (plan.shard_size * tp)
    layer = sharded / max(plan.boundaries, 1) / tp
    micro_tokens = plan.tokens_per_step / (plan.world // tp) / plan.accum
    kept_unsharded = 4 * sharded / tp if plan.no_sync and plan.accum > 1 else 0
    if plan.no_sync_scope == "replicas":
        kept_unsharded = 0
    return (
        SHARDED_STATE_BYTES * per_rank
        + 2 * layer * 2
        + micro_tokens * plan.activation_bytes_per_token
        + kept_unsharded
    )


def fsdp2_memory_bytes(plan: ClusterPlan) -> int:
    """FSDP2 + AdamW's memory per rank for the same model, mesh and batch."""
    return int(_common(plan, plan.parameters))


def rank_memory_bytes(rank: RankPlan) -> int:
    """What DMuon holds on ``rank`` for its dedicated matrices: what `RankPlan` counts,
    the averaged float32 gradients of the matrices it steps (as many as its momentum),
    and the step's updates on their way between replicas."""
    return rank.added_bytes + rank.momentum_bytes + rank.update_bytes


def dmuon_memory_bytes(plan: ClusterPlan, rank: RankPlan) -> int:
    """DMuon's memory on ``rank``: FSDP2 + AdamW for the parameters it does not
    dedicate, and the dedicated matrices' share of this rank (`rank_memory_bytes`)."""
    return int(_common(plan, plan.parameters - plan.dedicated_elements) + rank_memory_bytes(rank))
