"""The traffic inside a shard group, per FSDP2 unit, against that unit's compute.

Both sides of a plan move every parameter of a unit (a hook boundary's layer, or the root
with what no layer holds) inside the shard group once per pass: FSDP2 + AdamW gathers all
of it and reduce-scatters its gradients; DMuon gathers its dedicated matrices itself and
leaves the rest to FSDP2, so the bytes are the same (the packed buffers' dtype for the
gathers, the reduce dtype for the gradients). Per micro-batch and unit:

* forward: the unit's all-gather overlaps the unit's forward compute;
* backward: Z3's second all-gather and, on a synchronised backward, the reduce-scatter
  overlap the unit's backward compute (twice its forward);

and what is longer than the compute is exposed. A unit's compute is forward+backward's
share of its parameters (the root's embedding is counted as if it computed; its output
head does). A ring over ``S`` ranks moves ``(S - 1) / S`` of the unit per rank, at the
rate inside a node when the group (``shard x tp`` consecutive ranks) fits in one, at the
network rate per accelerator when it crosses nodes, plus each call's latency.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from dmuon.plan._hardware import Hardware


@dataclass(frozen=True)
class ShardTraffic:
    """One step's traffic inside a shard group (the same for DMuon and FSDP2 + AdamW)."""

    #: Seconds the gathers and reduce-scatters take per step, overlapped or not.
    seconds: float
    #: Seconds of them longer than the compute they overlap, per step.
    exposed_seconds: float
    #: Whether a shard group spans more than one node (the network rate applies).
    crosses_nodes: bool
    #: The unit whose traffic is most exposed ("" when none is).
    worst_unit: str = ""


NO_SHARD_TRAFFIC = ShardTraffic(0.0, 0.0, False)
"""A plan without a shard group's traffic (one rank per replica)."""


def unit_elements(model: nn.Module, boundaries: Mapping[str, str]) -> dict[str, int]:
    """Elements of each FSDP2 unit in forward order: ``""`` (the root: what no hook
    boundary holds) first, then each boundary. ``boundaries`` maps dedicated parameters to
    their boundary's module name, as `dedicate_params` finds them."""
    names = sorted(set(boundaries.values()), key=_natural)
    units = {"": 0, **dict.fromkeys(names, 0)}
    for fqn, param in model.named_parameters():
        unit = boundaries.get(fqn)
        if unit is None:
            unit = next((u for u in _prefixes(fqn) if u in units), "")
        units[unit] += param.numel()
    return units


def shard_traffic(
    units: Mapping[str, int],
    *,
    shard: int,
    tp: int,
    mode: str,
    accum: int,
    synced: int,
    forward_backward_seconds: float,
    gather_bytes: int,
    reduce_bytes: int,
    hardware: Hardware,
) -> ShardTraffic:
    """The shard group's traffic of one step (see the module's docstring)."""
    crosses = shard * tp > hardware.node_size
    if shard == 1:
        return ShardTraffic(0.0, 0.0, crosses)
    rate = (hardware.network_gbps if crosses else hardware.node_gbps) * 1e9
    latency = hardware.latency_us * 1e-6
    ring = (shard - 1) / shard / tp
    total = sum(units.values()) or 1
    seconds = exposed = worst = 0.0
    worst_unit = ""
    for name, elements in units.items():
        forward = forward_backward_seconds / accum / 3 * elements / total
        gather = elements * ring * gather_bytes / rate + latency
        reduce = elements * ring * reduce_bytes / rate + latency
        regather = gather if mode == "z3" else 0.0
        unit_exposed = accum * max(0.0, gather - forward)
        unit_exposed += synced * max(0.0, regather + reduce - 2 * forward)
        unit_exposed += (accum - synced) * max(0.0, regather - 2 * forward)
        seconds += accum * (gather + regather) + synced * reduce
        exposed += unit_exposed
        if unit_exposed > worst:
            worst, worst_unit = unit_exposed, name or "the root"
    return ShardTraffic(seconds, exposed, crosses, worst_unit)


def _prefixes(fqn: str) -> list[str]:
    """``a.b.c.weight`` -> ``["a.b.c", "a.b", "a"]``: the modules that hold it."""
    parts = fqn.split(".")[:-1]
    return [".".join(parts[:k]) for k in range(len(parts), 0, -1)]


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting ``layers.10`` after ``layers.9``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))
