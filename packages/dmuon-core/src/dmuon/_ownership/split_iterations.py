"""Which matrices' Newton-Schulz iterations are split over a block of ranks.

With more ranks than matrices to balance, the busiest rank runs one large matrix's whole
iteration while other ranks wait. `dedicate_params(..., ns_split=g)` groups the ranks of
the mesh into blocks of ``g`` consecutive ranks (inside one replica: ``g`` divides the
shard size, so a block is a node's GPUs when ``g`` is the GPUs per node) and lets a
block share a matrix's iteration: the rank that steps the matrix sends each member a
``1/g`` slice of its long side, every iteration all-reduces the ``m x m`` Gram matrix
``A = X Xᵀ`` over the block, and each member updates its slice. Each member computes
``2 m² ⌈n/g⌉ + m³`` multiply-adds per iteration instead of ``2 m² n + m³``.

This module is pure: the plan is the same on every rank, and the planner prices it
(`dmuon._ownership.split_blocks` makes the blocks' process groups).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SplitBlock:
    """This rank's block of ranks that share iterations (where one of its ranks steps a
    split matrix): its process group, and its members' global ranks and first position
    in the mesh (replica x shard size + shard rank), in position order."""

    group: Any
    ranks: tuple[int, ...]
    first: int


#: Matrices whose iteration costs less than the costliest one's over this are never split.
SMALLEST_SHARE = 4


def split_iteration_cost(shape: Sequence[int], group: int) -> int:
    """Multiply-adds of one iteration of an ``m x n`` matrix (``m`` the short side) on
    each of ``group`` ranks: ``2 m² ⌈n / group⌉ + m³`` (its slice's two products with the
    long side, and ``A·A`` in full on every member)."""
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    return 2 * m * m * math.ceil(n / group) + m**3


def block_of(position: int, group: int) -> range:
    """The positions of the block of ``group`` consecutive ranks holding ``position``."""
    first = position - position % group
    return range(first, first + group)


def plan_split_iterations(
    ranks: Mapping[str, int],
    costs: Mapping[str, int],
    shapes: Mapping[str, Sequence[int]],
    loads: Sequence[int],
    group: int,
) -> tuple[frozenset[str], list[int]]:
    """Split the iterations that lighten the busiest ranks; return the split items and
    every rank's load afterwards.

    Only 2-D matrices (``shapes`` gives the eligible ones) whose iteration costs at least
    1/`SMALLEST_SHARE` of the costliest one's are split: a small one's saving is not
    worth its block's collectives. Greedy: take the busiest rank (the lowest on a tie)
    and its costliest such matrix not yet split, and split it over the rank's block;
    while that leaves another member of the block at least as loaded as the busiest
    was, split that member's costliest one too. Keep the move when the loads, sorted
    from the heaviest, come out lexicographically lighter (equal matrices on several
    ranks are then taken one by one); stop at the first move that does not. ``ranks``
    maps each item to its rank of the whole mesh, ``costs`` to its
    `newton_schulz_cost`; items keep their order for ties.
    """
    loads = list(loads)
    if group == 1:
        return frozenset(), loads
    order = {name: index for index, name in enumerate(ranks)}
    eligible = [n for n in ranks if n in shapes and len(shapes[n]) == 2 and max(shapes[n]) >= group]
    floor = max((costs[n] for n in eligible), default=0) / SMALLEST_SHARE
    by_rank: dict[int, list[str]] = {}
    for name in eligible:
        if costs[name] >= floor:
            by_rank.setdefault(ranks[name], []).append(name)
    split: set[str] = set()

    def costliest(rank: int, taken: set[str]) -> str | None:
        left = [n for n in by_rank.get(rank, []) if n not in taken]
        return min(left, key=lambda n: (-costs[n], order[n])) if left else None

    while True:
        busiest = min(range(len(loads)), key=lambda r: (-loads[r], r))
        block = block_of(busiest, group)
        moved: set[str] = set()
        after = list(loads)
        rank: int | None = busiest
        while rank is not None:
            name = costliest(rank, split | moved)
            if name is None:
                break
            moved.add(name)
            after[rank] -= costs[name]
            for member in block:
                after[member] += split_iteration_cost(shapes[name], group)
            rank = next((r for r in block if after[r] >= loads[busiest]), None)
        if not moved or sorted(after, reverse=True) >= sorted(loads, reverse=True):
            break
        loads = after
        split |= moved
    return frozenset(split), loads
