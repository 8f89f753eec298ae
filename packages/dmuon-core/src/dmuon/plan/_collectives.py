"""The pieces `dmuon.plan.plan_cluster` counts with: collective tallies, each boundary's
spans, the calls per mesh dimension, the plan's items, tensor-parallel splits and the
Newton-Schulz workspace."""

from __future__ import annotations

import fnmatch
import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dmuon._ownership.planner import OwnerPlan, range_name
from dmuon._ownership.replica_updates import chunk_bounds
from dmuon.optim._orthogonalize import workspace_nbytes


@dataclass(frozen=True)
class Tally:
    """Collectives of one kind per optimizer step: how many, and the elements they carry
    (as ``dmuon.comm_audit`` records them on each rank)."""

    count: int = 0
    elements: int = 0


@dataclass
class Span:
    """A boundary's matrices (or expert ranges) of one owner: its piece of the boundary's calls."""

    owner: int
    elements: int = 0
    names: list[str] = field(default_factory=list)


def boundary_spans(
    shapes: Mapping[str, Sequence[int]], boundaries: Mapping[str, str], plan: OwnerPlan
) -> dict[str, list[Span]]:
    """Each boundary's spans, as `dedicate_params` lays out its flat buffer: one per owner
    of its whole matrices, then per split stack one per run of ranges with one owner."""
    spans: dict[str, list[Span]] = defaultdict(list)
    packed: dict[tuple[str, int], Span] = {}
    for fqn, shape in shapes.items():
        boundary = boundaries[fqn]
        if fqn in plan.expert_ranges:
            continue
        owner = plan.owners[fqn]
        if (boundary, owner) not in packed:
            packed[boundary, owner] = Span(owner)
            spans[boundary].append(packed[boundary, owner])
        span = packed[boundary, owner]
        span.elements += math.prod(shape)
        span.names.append(fqn)
    for fqn, ranges in plan.expert_ranges.items():
        per_expert = math.prod(shapes[fqn][1:])
        runs: list[Span] = []
        for expert_range in sorted(ranges):
            name = range_name(fqn, expert_range.start, expert_range.stop)
            if not runs or runs[-1].owner != expert_range.owner:
                runs.append(Span(expert_range.owner))
            runs[-1].elements += (expert_range.stop - expert_range.start) * per_expert
            runs[-1].names.append(name)
        spans[boundaries[fqn]].extend(runs)
    return spans


def add(tallies: dict[str, Tally], kind: str, count: int, elements: int) -> None:
    if count:
        old = tallies.get(kind, Tally())
        tallies[kind] = Tally(old.count + count, old.elements + elements)


def boundary_calls(
    boundaries: list[list[tuple[int, int]]], rounds: int, synced: int
) -> dict[str, Tally]:
    """The shard dimension's collectives: per boundary with elements (its spans as
    ``(owner, elements)``), one call per forward round and one per synchronised backward,
    a broadcast and a reduce when one rank owns them all, else an all-gather and a
    reduce-scatter of the owners' pieces (see `dmuon._ownership.flat_buffer`)."""
    tallies: dict[str, Tally] = {}
    for spans in boundaries:
        elements = sum(e for _, e in spans)
        if not elements:
            continue
        one_owner = len({owner for owner, e in spans if e}) == 1
        add(tallies, "broadcast" if one_owner else "all_gather", rounds, elements * rounds)
        add(tallies, "reduce" if one_owner else "reduce_scatter", synced, elements * synced)
    return tallies


def replica_update_calls(records: list[tuple[int, int, int]], replicas: int) -> dict[str, Tally]:
    """The replicate dimension's collectives after a step: one per chunk of updates
    (cut as `dmuon._ownership.replica_updates.update_chunks` cuts them; ``records`` are ``(elements,
    bytes, update replica)``, cut by bytes, counted in elements), a broadcast when one
    replica stepped the whole chunk, else an all-gather."""
    tallies: dict[str, Tally] = {}
    for start, stop in chunk_bounds([b for _, b, _ in records]):
        chunk = records[start:stop]
        elements = sum(e for e, _, _ in chunk)
        one_replica = len({r for _, _, r in chunk}) == 1
        add(tallies, "broadcast" if one_replica else "all_gather", 1, elements)
    return tallies


def plan_items(
    shapes: Mapping[str, Sequence[int]], plan: OwnerPlan
) -> dict[str, tuple[int, int, int]]:
    """``{plan item name: (matrices, rows, cols)}``: each matrix or stack, and each range
    of a stack the plan split by experts."""
    items: dict[str, tuple[int, int, int]] = {}
    for fqn, shape in shapes.items():
        if fqn in plan.expert_ranges:
            _, rows, cols = shape
            for r in plan.expert_ranges[fqn]:
                items[range_name(fqn, r.start, r.stop)] = (r.stop - r.start, rows, cols)
        else:
            items[fqn] = (shape[0], shape[1], shape[2]) if len(shape) == 3 else (1, *shape)
    return items


#: Hugging Face tp-plan styles that split a weight by rows (0) or by columns (1).
TP_STYLES = {"colwise": 0, "colwise_rep": 0, "local_colwise": 0, "rowwise": 1,
              "rowwise_rep": 1, "local_rowwise": 1}  # fmt: skip


def tp_split_dims(
    model: nn.Module,
    shapes: Mapping[str, Sequence[int]],
    tp: int,
    tp_plan: Mapping[str, str] | None,
) -> dict[str, int]:
    """``{fqn: dim}`` of the dedicated matrices a tp plan splits (rows 0, columns 1)."""
    if tp == 1:
        return {}
    if tp_plan is None:
        config = getattr(model, "config", None)
        tp_plan = getattr(config, "base_model_tp_plan", None) or {}
        if not tp_plan:
            raise ValueError(
                "tensor parallelism needs a tp plan: the model's config has no "
                "base_model_tp_plan; pass tp_plan={module pattern: 'colwise' | 'rowwise'}"
            )
    dims: dict[str, int] = {}
    for fqn, shape in shapes.items():
        module = fqn.rsplit(".", 1)[0]
        for pattern, style in tp_plan.items():
            if len(shape) == 2 and (
                fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, "*." + pattern)
            ):
                if style in TP_STYLES:
                    dims[fqn] = TP_STYLES[style]
                break
    return dims


@functools.lru_cache(maxsize=1024)
def workspace_bytes(
    items: tuple[tuple[int, int, int], ...],
    dtype: torch.dtype,
    device: torch.device,
    cap: int,
    gram: bool,
) -> int:
    """Bytes of the Newton-Schulz workspace `dmuon.Muon` keeps for these items (a tuple,
    sorted: thousands of ranks ask for the same few sets, and the answer is remembered):
    the largest bucket of one shape, run in chunks within ``cap``."""
    counts: dict[tuple[int, int], int] = defaultdict(int)
    for matrices, rows, cols in items:
        counts[rows, cols] += matrices
    largest = 0
    for (rows, cols), count in counts.items():
        one = _workspace_nbytes(1, rows, cols, dtype, device, gram)
        batch = min(count, max(1, cap // one))
        largest = max(largest, _workspace_nbytes(batch, rows, cols, dtype, device, gram))
    return largest


@functools.lru_cache(maxsize=4096)
def _workspace_nbytes(
    batch: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device, gram: bool
) -> int:
    """`workspace_nbytes` remembered: thousands of ranks ask for the same few shapes."""
    return workspace_nbytes(batch, rows, cols, dtype, device, gram, torch.float32)
