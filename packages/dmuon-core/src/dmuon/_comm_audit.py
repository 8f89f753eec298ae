"""The audit of what DMuon sent: collective calls, elements and bytes per optimizer step,
per mesh dimension, and the traffic in the units the docs' formulas use.

`dmuon._comm.Communicator` records every collective it issues here; ``Muon.step()`` closes
each step's record.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

#: How many "units" one collective of E elements costs, in units of (N-1)/N x E.
_UNITS_PER_ELEMENT = {
    "broadcast": 1,
    "reduce": 1,
    "all_gather": 1,
    "reduce_scatter": 1,
    "all_reduce": 2,
    "gather": 1,
    "scatter": 1,
}


@dataclass
class CollectiveTally:
    """Count, elements and bytes of one kind of collective."""

    count: int = 0
    elements: int = 0
    bytes: int = 0


#: The mesh dimensions the audit tells apart: the ranks sharing owners (data parallel), the
#: replicas of HSDP, tensor parallelism, and the blocks that share a matrix's Newton-Schulz
#: iteration (``dedicate_params(ns_split=...)``).
SHARD, REPLICATE, TENSOR, SPLIT = "shard", "replicate", "tensor", "split"

#: Small control collectives (gradient norms for clipping and the non-finite check), kept
#: apart from the dedicated matrices' traffic.
CONTROL = "control"


def _units(by_kind: dict[str, CollectiveTally], dedicated_elements: int) -> float:
    if dedicated_elements == 0:
        return 0.0
    moved = sum(_UNITS_PER_ELEMENT[kind] * t.elements for kind, t in by_kind.items())
    return moved / dedicated_elements


def _tallies(by_kind: dict[str, CollectiveTally]) -> dict[str, dict[str, int]]:
    return {
        kind: {"count": t.count, "elements": t.elements, "bytes": t.bytes}
        for kind, t in sorted(by_kind.items())
    }


@dataclass
class StepComm:
    """Collectives issued for dedicated parameters during one optimizer step, on this rank.

    ``by_kind`` is the shard dimension: the all-gathers and reduce-scatters (broadcasts and
    reduces where one rank owns a whole boundary) among the ranks that share the matrices'
    owners (all ranks of a 1-D mesh, the dp ranks under tensor parallelism). ``replicate``
    is the replicate dimension of a 2-D (HSDP) mesh: the reduce-scatters of gradients and
    the all-gathers of the step's updates among the owners of the same matrices in the
    different replicas (empty on a 1-D mesh). ``tensor`` is the
    tensor-parallel dimension: the gathers and scatters of ``optimizer.step()`` among the
    owners of a tp-sharded matrix' shards. ``split`` is the block of ``ns_split`` ranks
    that share a matrix's Newton-Schulz iteration: per split matrix a scatter and a gather
    of the slices and an all-reduce of the Gram matrix per iteration (the planner's
    ``RankPlan.split_collectives``, element for element).
    """

    dedicated_elements: int
    #: Replicas of the mesh (1 on a 1-D mesh); with more, `as_dict` splits by dimension.
    replicas: int = 1
    #: Elements of the whole dedicated matrices (more than ``dedicated_elements``, this
    #: rank's shards, under tensor parallelism); ``None``: the same.
    global_elements: int | None = None
    by_kind: dict[str, CollectiveTally] = field(
        default_factory=lambda: defaultdict(CollectiveTally)
    )
    replicate: dict[str, CollectiveTally] = field(
        default_factory=lambda: defaultdict(CollectiveTally)
    )
    tensor: dict[str, CollectiveTally] = field(default_factory=lambda: defaultdict(CollectiveTally))
    split: dict[str, CollectiveTally] = field(default_factory=lambda: defaultdict(CollectiveTally))
    control: dict[str, CollectiveTally] = field(
        default_factory=lambda: defaultdict(CollectiveTally)
    )

    @property
    def units(self) -> float:
        """Shard-dimension traffic in units of (N-1)/N x P_M elements.

        N is the shard group's size and P_M the number of dedicated elements.
        """
        return _units(self.by_kind, self.dedicated_elements)

    @property
    def replicate_units(self) -> float:
        """This rank's replicate-dimension traffic in units of (R-1)/R x P_M elements.

        A rank reduce-scatters the gradients of the matrices it owns once per synchronised
        backward, and all-gathers their updates once per step, so the
        ranks of one shard group add up to 1 unit per synchronised backward plus 1 unit per
        step (R is the replicate group's size).
        """
        return _units(self.replicate, self.dedicated_elements)

    @property
    def tensor_units(self) -> float:
        """This rank's tensor-parallel traffic in units of (T-1)/T x P_M elements.

        P_M counts the whole matrices here. A rank gathers and scatters only the matrices
        its dp position owns, so the dp ranks add up to 2 units per step when every
        dedicated matrix is tp-sharded (T is the tensor-parallel group's size).
        """
        return _units(self.tensor, self.global_elements or self.dedicated_elements)

    def count(self, kind: str) -> int:
        """Number of collectives of ``kind`` (``"broadcast"``, ``"reduce"``, ...)."""
        return self.by_kind[kind].count if kind in self.by_kind else 0

    def as_dict(self) -> dict[str, object]:
        """A JSON-friendly summary: per-kind tallies and the total in units."""
        summary: dict[str, object] = {
            "units": self.units,
            "dedicated_elements": self.dedicated_elements,
            "collectives": _tallies(self.by_kind),
        }
        dimensions: dict[str, object] = {}
        if self.replicas > 1:
            dimensions[REPLICATE] = {
                "units": self.replicate_units,
                "collectives": _tallies(self.replicate),
            }
        if self.global_elements is not None:
            dimensions[TENSOR] = {
                "units": self.tensor_units,
                "collectives": _tallies(self.tensor),
            }
        if self.split:
            dimensions[SPLIT] = {"collectives": _tallies(self.split)}
        if dimensions:
            shard = {SHARD: {"units": self.units, "collectives": _tallies(self.by_kind)}}
            summary["dimensions"] = shard | dimensions
        if self.control:
            summary[CONTROL] = _tallies(self.control)
        return summary


class CommAudit:
    """Per-optimizer-step record of the collectives DMuon issued for dedicated parameters.

    ``current`` collects what was sent since the last optimizer step; ``Muon.step()`` closes
    it into ``steps`` (one `StepComm` per optimizer step). ``total`` counts everything.
    """

    def __init__(
        self, dedicated_elements: int, replicas: int = 1, global_elements: int | None = None
    ) -> None:
        self.dedicated_elements = dedicated_elements
        self.replicas = replicas
        self.global_elements = global_elements
        self.current = self._new_step()
        self.total = self._new_step()
        self.steps: list[StepComm] = []

    def _new_step(self) -> StepComm:
        return StepComm(self.dedicated_elements, self.replicas, self.global_elements)

    def record(
        self,
        kind: str,
        tensor: torch.Tensor,
        dim: str = SHARD,
        numel: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Add one collective of ``kind`` over mesh dimension ``dim`` that moved ``tensor``
        (``numel`` elements of its dtype, when they are not ``tensor``'s own). ``nbytes``,
        given, is what moved when ``numel`` counts values that travel packed as bytes (the
        updates between replicas)."""
        attr = {
            SHARD: "by_kind",
            REPLICATE: "replicate",
            TENSOR: "tensor",
            SPLIT: "split",
            CONTROL: "control",
        }[dim]
        tallies = (getattr(self.current, attr)[kind], getattr(self.total, attr)[kind])
        elements = tensor.numel() if numel is None else numel
        moved = elements * tensor.element_size() if nbytes is None else nbytes
        for tally in tallies:
            tally.count += 1
            tally.elements += elements
            tally.bytes += moved

    def close_step(self) -> StepComm:
        """End the current optimizer step; return its record."""
        finished, self.current = self.current, self._new_step()
        self.steps.append(finished)
        return finished

    def last_step(self) -> StepComm:
        """The record of the most recent finished optimizer step."""
        if not self.steps:
            raise ValueError("no optimizer step has finished yet; call optimizer.step() first")
        return self.steps[-1]
